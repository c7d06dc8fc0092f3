//! Project 01: a forward pass is array math.
//!
//! A model is a list of ops over named values (`model.json`) plus weights
//! (`weights.safetensors`). [`Graph::load`] validates the whole graph against
//! the weights, packs the linear layers once, and [`Graph::forward`] runs a
//! batch through it. Every op has a PyTorch parity test; `linear` has a
//! register-blocked AVX2 path beside its naive reference.

#[cfg(feature = "bench")]
pub mod bench;
pub mod engine;
pub mod error;
pub mod graph;
pub mod linear;
pub mod ops;

pub use engine::{Graph, LoadOptions, ModelStats, Workspace};
pub use error::{GraphError, OpError};

/// The committed fixtures directory of this crate.
pub fn fixtures_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}
