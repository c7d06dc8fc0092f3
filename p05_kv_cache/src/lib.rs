//! Project 05: a KV cache, sampling and the `Model` seam.
//!
//! - [`kv_cache`]: per-layer K/V of shape (n_kv_head, max_seq, head_dim), allocated once.
//! - [`llama_engine`]: p04's Llama behind `common::Model` (prefill, then one token per decode).
//! - [`sampling`]: temperature, top-k, top-p, min-p, repetition penalty, seeded.
//! - [`generate`]: the loop later crates share: streaming, stop ids and strings, finish reasons.

pub mod bench;
pub mod generate;
pub mod gpt2_engine;
pub mod kv_cache;
pub mod llama_engine;
pub mod load;
pub mod sampling;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] p04_transformer::ModelError),
    #[error(transparent)]
    Cache(#[from] kv_cache::CacheError),
    #[error("logits buffer has {len} entries, the vocabulary {vocab}")]
    Logits { len: usize, vocab: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
}
