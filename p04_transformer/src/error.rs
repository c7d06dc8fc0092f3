//! Model-level errors: each names the file, tensor or key, and what was expected.

use std::path::PathBuf;

use thiserror::Error;

use crate::gguf::GgufError;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Safetensors(#[from] common::st::StError),
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: {msg}")]
    Config { path: PathBuf, msg: String },
    #[error("{path}: architecture `{found}` is not supported (supported: {supported})")]
    Arch {
        path: PathBuf,
        found: String,
        supported: &'static str,
    },
    #[error("{path}: tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("token id {id} at position {pos} is outside the vocabulary (size {vocab})")]
    TokenId { id: u32, pos: usize, vocab: usize },
    #[error("sequence of {len} tokens exceeds the model's context of {ctx}")]
    Context { len: usize, ctx: usize },
    #[error("{what} needs at least one token, and was given none")]
    EmptyInput { what: &'static str },
    #[error("projection group: {got} output buffers for {want} projections")]
    Group { got: usize, want: usize },
    #[error("input has {len} ids, not batch {batch} x seq {seq}")]
    Input {
        len: usize,
        batch: usize,
        seq: usize,
    },
    #[error("matmul: {0}")]
    Gemm(#[from] p02_matmul_bench::GemmError),
    /// A weight format refused a tensor or an input (Project 10's blocks).
    /// The format's own error is kept as the source (boxed: this crate
    /// cannot name a later crate's types), so a caller can downcast it.
    #[error("weights `{name}`: {source}")]
    Weights {
        name: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A collective between the ranks that share a split model failed
    /// (Project 13's communicator: a dead, stuck or out-of-order rank),
    /// kept as the source so a caller can downcast it.
    #[error("collective between ranks: {0}")]
    Collective(#[source] Box<dyn std::error::Error + Send + Sync>),
}
