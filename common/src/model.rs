//! The `Model` seam (logits level), as the curriculum names it:
//! `prefill(ids) -> (logits, cache)` then `decode(token, &mut cache) -> logits`.
//! Local engines implement it; samplers, generation loops and servers are
//! written against it.

use std::fmt;

/// Why a generation (a request) ended: one type from the sampling loop
/// (Project 05) to the wire (`finish_reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` (or the context) reached.
    Length,
    /// Cancelled: the client left, or the server is shutting down.
    Abort,
}

impl Finish {
    /// The OpenAI / vLLM spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Abort => "abort",
        }
    }
}

impl fmt::Display for Finish {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Facts about a model that callers need without knowing its architecture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelInfo {
    pub name: String,
    pub vocab_size: usize,
    /// Longest sequence (prompt + generated) the model accepts.
    pub context_length: usize,
    pub bos_id: Option<u32>,
    /// Tokens that end a generation (e.g. `<|im_end|>`, `<|endoftext|>`).
    pub stop_ids: Vec<u32>,
}

/// A causal language model with an explicit per-sequence cache.
pub trait Model {
    /// Everything a sequence carries between steps (the KV cache).
    type Cache;
    type Error: std::error::Error + Send + Sync + 'static;

    fn info(&self) -> &ModelInfo;

    /// Run the prompt and return the last position's logits (vocab) and a
    /// cache with room for `max_len` positions in all (prompt included).
    fn prefill(&self, ids: &[u32], max_len: usize) -> Result<(Vec<f32>, Self::Cache), Self::Error>;

    /// Append one token at the next position, writing its logits (vocab)
    /// into `logits`.
    fn decode(
        &self,
        token: u32,
        cache: &mut Self::Cache,
        logits: &mut [f32],
    ) -> Result<(), Self::Error>;

    /// Bytes of K/V memory `cache` holds (servers report it as a gauge).
    fn cache_bytes(&self, _cache: &Self::Cache) -> usize {
        0
    }
}
