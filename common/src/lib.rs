//! `common`: the pieces every project of inference-lab shares.
//!
//! - [`tensor`]: an f32, row-major, shape-checked [`Tensor`].
//! - [`st`]: safetensors load and save, with errors that name the file and tensor.
//! - [`compare`]: absolute + relative tolerance checks that report the worst index.
//! - [`stats`]: warm-up, repeated timing, median / p95 / min / max.
//! - [`numbers`]: the `numbers.md` recorder (date, machine, commit, command, metric, value, unit, prediction).
//! - [`plot`]: line and log-log charts to PNG.
//! - [`assets`]: locating the workspace and fetching assets through `scripts/fetch_assets.sh`.

pub mod alloc_count;
pub mod assets;
pub mod compare;
pub mod model;
pub mod numbers;
pub mod plot;
pub mod st;
pub mod stats;
pub mod tensor;
pub mod testdata;

pub use model::{Model, ModelInfo};
pub use tensor::{Tensor, TensorError};
