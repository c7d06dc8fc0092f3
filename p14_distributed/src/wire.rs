//! The JSON the proxy and the workers' control endpoints exchange: a
//! prepared request (tokens and every generation setting: the proxy
//! tokenized it, chat template and chat ending included), a prefill's
//! result, a decode order, and the events a decode worker streams back (one JSON object
//! per line). The K/V itself never travels here: it has its own protocol
//! ([`crate::protocol`]).

use common::engine::{EngineError, SamplingParams, TokenLogprob, TokenOut};
use common::Finish;
use p05_kv_cache::generate::GenerateParams;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireSampling {
    pub temperature: f32,
    pub top_k: Option<usize>,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub seed: Option<u64>,
}

impl From<&SamplingParams> for WireSampling {
    fn from(s: &SamplingParams) -> Self {
        WireSampling {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            seed: s.seed,
        }
    }
}

impl From<&WireSampling> for SamplingParams {
    fn from(s: &WireSampling) -> Self {
        SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            seed: s.seed,
        }
    }
}

/// A prepared request (tokens and generation settings): what a decode
/// worker needs to recompute the prompt itself.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WirePrepared {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: WireSampling,
    pub stop_ids: Vec<u32>,
    pub stop_strings: Vec<String>,
    pub ignore_eos: bool,
    pub min_tokens: usize,
    pub logprobs: Option<usize>,
    pub salt: Vec<u8>,
    /// Tokens already streamed to the client by a worker since lost (a
    /// migrated request): the prefill computes prompt and these, the
    /// sampler stands where it would after them, and what is sampled next
    /// is the token after them. Empty for a new request.
    #[serde(default)]
    pub output: Vec<u32>,
}

impl WirePrepared {
    pub fn new(prompt: Vec<u32>, p: &GenerateParams, salt: Vec<u8>) -> WirePrepared {
        WirePrepared {
            output: Vec::new(),
            prompt,
            max_tokens: p.max_tokens,
            sampling: (&p.sampling).into(),
            stop_ids: p.stop_ids.clone(),
            stop_strings: p.stop_strings.clone(),
            ignore_eos: p.ignore_eos,
            min_tokens: p.min_tokens,
            logprobs: p.logprobs,
            salt,
        }
    }

    /// Prompt then output: the positions a prefill of this request
    /// computes, and its K/V transfer holds.
    pub fn computed_tokens(&self) -> Vec<u32> {
        let mut t = self.prompt.clone();
        t.extend_from_slice(&self.output);
        t
    }

    pub fn params(&self) -> GenerateParams {
        GenerateParams {
            max_tokens: self.max_tokens,
            sampling: (&self.sampling).into(),
            stop_ids: self.stop_ids.clone(),
            stop_strings: self.stop_strings.clone(),
            ignore_eos: self.ignore_eos,
            min_tokens: self.min_tokens,
            logprobs: self.logprobs,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WireLogprob {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WireToken {
    /// The token's id: the proxy keeps the ids it streamed, to continue
    /// the request elsewhere if its worker is lost.
    pub id: u32,
    pub text: String,
    pub logprob: Option<WireLogprob>,
    pub top_logprobs: Vec<WireLogprob>,
}

fn lp_to(l: &TokenLogprob) -> WireLogprob {
    WireLogprob {
        token: l.token.clone(),
        bytes: l.bytes.clone(),
        logprob: l.logprob,
    }
}

fn lp_from(l: WireLogprob) -> TokenLogprob {
    TokenLogprob {
        token: l.token,
        bytes: l.bytes,
        logprob: l.logprob,
    }
}

impl WireToken {
    /// Token `id` as the engine put it out.
    pub fn new(id: u32, t: &TokenOut) -> Self {
        WireToken {
            id,
            text: t.text.clone(),
            logprob: t.logprob.as_ref().map(lp_to),
            top_logprobs: t.top_logprobs.iter().map(lp_to).collect(),
        }
    }
}

impl From<WireToken> for TokenOut {
    fn from(t: WireToken) -> Self {
        TokenOut {
            text: t.text,
            logprob: t.logprob.map(lp_from),
            top_logprobs: t.top_logprobs.into_iter().map(lp_from).collect(),
        }
    }
}

/// An engine error as data, kept to the kinds the HTTP layer maps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WireError {
    /// invalid_request, context_length, queue_full, unavailable, internal
    pub kind: String,
    pub message: String,
    pub param: Option<String>,
    pub retry_after_s: Option<u64>,
}

impl From<&EngineError> for WireError {
    fn from(e: &EngineError) -> Self {
        let (kind, param, retry) = match e {
            EngineError::InvalidRequest { param, .. } => ("invalid_request", param.clone(), None),
            EngineError::ContextLength { .. } => {
                ("invalid_request", Some("max_tokens".into()), None)
            }
            EngineError::QueueFull { retry_after_s, .. } => {
                ("queue_full", None, Some(*retry_after_s))
            }
            EngineError::Unavailable(_) => ("unavailable", None, None),
            EngineError::Upstream { .. } | EngineError::Internal(_) => ("internal", None, None),
        };
        WireError {
            kind: kind.into(),
            message: e.to_string(),
            param,
            retry_after_s: retry,
        }
    }
}

impl From<WireError> for EngineError {
    fn from(w: WireError) -> Self {
        match w.kind.as_str() {
            "invalid_request" => EngineError::InvalidRequest {
                message: w.message,
                param: w.param,
            },
            "queue_full" => EngineError::QueueFull {
                waiting: 0,
                retry_after_s: w.retry_after_s.unwrap_or(1),
            },
            "unavailable" => EngineError::Unavailable(w.message),
            _ => EngineError::Internal(w.message),
        }
    }
}

/// One line of a decode worker's stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum WireEvent {
    /// The sequence runs here now (imported, or queued to recompute):
    /// what comes next is the stream itself.
    Admitted {
        recomputed: bool,
        kv_bytes: usize,
        /// Seconds the pull took (connect to ack); 0 for a recompute.
        pull_s: f64,
    },
    Token(WireToken),
    Done {
        finish: String,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Error(WireError),
}

pub fn finish_from(s: &str) -> Finish {
    match s {
        "stop" => Finish::Stop,
        "length" => Finish::Length,
        _ => Finish::Abort,
    }
}

/// Where a prefill worker holds a prompt's K/V for a decode worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferHandle {
    /// host:port of the prefill worker's K/V server.
    pub kv_addr: String,
    pub transfer_id: u64,
    pub prompt_hash: u64,
    /// K/V positions held (the prompt's).
    pub tokens: usize,
    /// Milliseconds the prefill worker holds it unacknowledged.
    pub lease_ms: u64,
}

/// A prefill worker's answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum PrefillReply {
    /// The first token is sampled and the K/V waits to be pulled.
    /// (The request itself stays with the proxy, which sent it.)
    Transfer {
        first: WireToken,
        handle: TransferHandle,
        /// Seconds: waiting in the queue, and the prefill's steps.
        queue_s: f64,
        prefill_s: f64,
    },
    /// A streamed prefill started (or is queued): pull its K/V now, layer
    /// by layer as it is computed; the first token comes in the trailer.
    Started {
        handle: TransferHandle,
    },
    /// The first token ended the request (a stop token, max_tokens 1).
    Finished {
        first: Option<WireToken>,
        finish: String,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Error(WireError),
}

/// What to do when the K/V cannot be loaded (vLLM's
/// `kv_load_failure_policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum LoadFailurePolicy {
    /// The decode worker recomputes the prompt itself.
    Recompute,
    /// The request ends with an error.
    Fail,
}

/// The proxy's order to a decode worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeOrder {
    pub request_id: String,
    pub prepared: WirePrepared,
    /// None: no K/V to pull (recompute from the start).
    pub handle: Option<TransferHandle>,
    /// Tokens the client already has (the prefill's first): a recompute
    /// samples them again and does not stream them twice.
    pub already_sent: usize,
    pub policy: LoadFailurePolicy,
}

/// What travels with the K/V in the accept: the tokens sampled so far
/// (the prefill's first) and where the sampler's random stream stands.
/// A streamed prefill's trailer also carries the first token itself (the
/// client has not seen it), and, when that token ended the request, how.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SeqMeta {
    pub output: Vec<u32>,
    pub sampler_seed: u64,
    pub sampler_draws: u64,
    #[serde(default)]
    pub first: Option<WireToken>,
    #[serde(default)]
    pub finish: Option<String>,
    #[serde(default)]
    pub prompt_tokens: usize,
    #[serde(default)]
    pub completion_tokens: usize,
    /// Seconds in the prefill worker's queue, and prefilling.
    #[serde(default)]
    pub queue_s: f64,
    #[serde(default)]
    pub prefill_s: f64,
}
