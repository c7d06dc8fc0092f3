//! `common`: the pieces every project of inference-lab shares.
//!
//! - [`tensor`]: an f32, row-major, shape-checked [`Tensor`].
//! - [`st`]: safetensors load and save, with errors that name the file and tensor.
//! - [`compare`]: absolute + relative tolerance checks that report the worst index.
//! - [`stats`]: warm-up, repeated timing, median / p95 / min / max.
//! - With the `bench` feature: [`numbers`] (the `numbers.md` recorder: date,
//!   machine, commit, command, metric, value, unit, prediction),
//!   [`criterion_rows`] (`cargo bench` results into numbers.md) and [`plot`]
//!   (line and log-log charts to PNG).
//! - [`assets`]: locating the workspace and fetching assets through `scripts/fetch_assets.sh`.
//! - [`model`]: the `Model` seam (logits level); [`batch`]: the batched, ragged step
//!   under it (`Batch`, the `KvStore` trait, `BatchModel`); [`openai`]: the OpenAI wire format.
//! - With the `net` feature: [`engine`] (the `Engine` seam, request level),
//!   [`client`] (an HTTP client of the OpenAI API, `RemoteEngine`) and
//!   [`loadgen`] (the load generator and vLLM-style serving metrics).

pub mod alloc_count;
pub mod assets;
pub mod batch;
#[cfg(feature = "net")]
pub mod client;
pub mod compare;
#[cfg(feature = "bench")]
pub mod criterion_rows;
#[cfg(feature = "net")]
pub mod engine;
#[cfg(feature = "net")]
pub mod loadgen;
pub mod model;
#[cfg(feature = "bench")]
pub mod numbers;
pub mod openai;
pub mod par;
#[cfg(feature = "bench")]
pub mod plot;
pub mod readme_numbers;
pub mod rng;
pub mod sampling;
pub mod st;
pub mod stats;
pub mod tensor;
pub mod testdata;

pub use batch::{Batch, BatchModel, KvShape, KvStore, SeqSlice};
pub use model::{Finish, Model, ModelInfo};
pub use tensor::{argmax, Tensor, TensorError};
