//! Typed errors. Load errors name the file, the node and the tensor, with the
//! expected and found values, so a bad model fails at load, never mid-forward.

use std::path::PathBuf;

use common::st::StError;
use common::TensorError;
use thiserror::Error;

/// An op rejected its input at run time (only data-dependent checks remain
/// after load-time validation, e.g. embedding ids).
#[derive(Debug, Error, PartialEq)]
pub enum OpError {
    #[error("embedding id at flat index {index} is {id}; ids must be integers in [0, {vocab})")]
    EmbeddingId { index: usize, id: f32, vocab: usize },
    #[error("{0}")]
    Shape(String),
    #[error(transparent)]
    Tensor(TensorError),
}

#[derive(Debug, Error)]
pub enum GraphError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: invalid model JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error(transparent)]
    Weights(#[from] StError),
    #[error("{path}: {msg}")]
    Graph { path: PathBuf, msg: String },
    #[error("{path}: {node}: {msg}")]
    Node {
        path: PathBuf,
        /// e.g. "node 2 (linear -> h2)"
        node: String,
        msg: String,
    },
    #[error("input shape {found:?} does not match the model's (batch, {expected:?})")]
    Input {
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{node}: {source}")]
    Op { node: String, source: OpError },
}
