//! Project 05: a KV cache, sampling and the `Model` seam.
//!
//! - [`attention`]: a ragged step's attention over each sequence's own K/V store (decode rows and prefill heads).
//! - [`kv_cache`]: per-layer K/V of shape (n_kv_head, max_seq, head_dim), allocated once.
//! - [`llama_engine`]: p04's Llama behind `common::Model` (prefill, then one token per decode).
//! - [`sampling`]: temperature, top-k, top-p, min-p, repetition penalty, seeded.
//! - [`sequence`]: one request's state (history, sampler, stops, UTF-8, logprobs, finish) with `on_logits`.
//! - [`generate`]: the loop later crates share: streaming, stop ids and strings, finish reasons.

pub mod attention;
#[cfg(feature = "bench")]
pub mod bench;
pub mod generate;
pub mod gpt2_engine;
pub mod kv_cache;
pub mod llama_engine;
pub mod load;
pub mod sampling;
pub mod sequence;
pub mod simd;

use thiserror::Error;

/// The error of this crate's local models (the `Model` implementations
/// and their loader): load, prefill, decode and the batched step. Not the
/// request-level `common::engine::EngineError` a server reports; Project
/// 06 maps one to the other.
#[derive(Debug, Error)]
pub enum LocalModelError {
    #[error(transparent)]
    Model(#[from] p04_transformer::ModelError),
    #[error(transparent)]
    Cache(#[from] kv_cache::CacheError),
    #[error(transparent)]
    Batch(#[from] common::batch::BatchError),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("a pipeline stage was handed {len} values of residual stream; the step needs {want}")]
    StageInput { len: usize, want: usize },
}
