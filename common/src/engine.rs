//! The `Engine` seam (request level): a completion request in, a stream of
//! text out, ending with a finish reason and usage. The HTTP server, the
//! batchers, the gateway and the platform are written against this trait, so
//! a local serial engine, a batching scheduler or a remote OpenAI-compatible
//! server ([`crate::client::RemoteEngine`]) can stand behind them unchanged.
//!
//! Cancellation is by dropping the stream: an engine checks, between steps,
//! whether its receiver is gone, stops and frees the request's memory.

use std::fmt;

use thiserror::Error;
use tokio::sync::mpsc;

pub use crate::model::Finish;
use crate::openai::ChatMessage;

/// What to complete.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptInput {
    /// Raw text (`/v1/completions`).
    Text(String),
    /// Token ids (`/v1/completions` with a token prompt).
    Tokens(Vec<u32>),
    /// A conversation; the engine applies the model's chat template.
    Chat(Vec<ChatMessage>),
}

/// How a chat prompt ends (in the OpenAI module: the wire fields set it).
pub use crate::openai::ChatEnd;

/// Sampling settings: common's one type (OpenAI's defaults).
pub use crate::sampling::SamplingParams;

/// One completion request as an engine sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineRequest {
    /// The response id (`cmpl-...`, `chatcmpl-...`), for logs and tracing.
    pub id: String,
    pub prompt: PromptInput,
    /// None: up to the end of the context.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// No stop before this many tokens (0 = off).
    pub min_tokens: usize,
    /// Some(k): report log p of each token and its k most likely alternatives.
    pub logprobs: Option<usize>,
    /// Choices to sample from the one prompt (read by
    /// [`Engine::submit_choices`]; `submit` answers one). Choice `i` samples
    /// with seed `seed + i`, so choice 0 is what `n = 1` would give.
    pub n: usize,
    /// Keys the prefix cache: only requests with the same salt share
    /// cached K/V. Engines without a prefix cache ignore it.
    pub cache_salt: Option<String>,
    /// How a chat prompt ends (ignored for text and token prompts).
    pub chat_end: ChatEnd,
}

impl EngineRequest {
    pub fn new(id: impl Into<String>, prompt: PromptInput) -> EngineRequest {
        EngineRequest {
            id: id.into(),
            prompt,
            max_tokens: None,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: false,
            min_tokens: 0,
            logprobs: None,
            n: 1,
            cache_salt: None,
            chat_end: ChatEnd::Open,
        }
    }
}

/// A token's log-probability, with the token as text and bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// One generated token (or, from a remote engine, one streamed chunk).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenOut {
    /// Text that became final with this token (may be empty).
    pub text: String,
    /// Present when logprobs were asked for.
    pub logprob: Option<TokenLogprob>,
    /// Most likely first.
    pub top_logprobs: Vec<TokenLogprob>,
}

/// What an engine sends back for a request, in order: any number of
/// `Token`s, then exactly one `Done` or `Error`.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    Token(TokenOut),
    Done {
        finish: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Error(EngineError),
}

/// The receiving end of a request. Dropping it cancels the request.
pub type EngineStream = mpsc::UnboundedReceiver<EngineEvent>;

/// Requests an engine holds now (the `num_requests_*` gauges).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineLoad {
    pub running: usize,
    pub waiting: usize,
    /// K/V cache memory held by running requests.
    pub kv_cache_bytes: usize,
}

/// Why an engine refused or failed a request. The HTTP layer maps each to a
/// status code (see p06's `error.rs`).
#[derive(Clone, Debug, Error, PartialEq)]
pub enum EngineError {
    /// A field is out of range or unsupported (400).
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
    },
    /// Prompt plus max_tokens beyond the context (400).
    #[error("this model's maximum context length is {context} tokens; the request has {prompt} prompt tokens and asks for {max_tokens} more ({} in all)", prompt + max_tokens)]
    ContextLength {
        prompt: usize,
        max_tokens: usize,
        context: usize,
    },
    /// The wait queue is full (429 with Retry-After).
    #[error(
        "the server is at capacity ({waiting} requests waiting); retry after {retry_after_s} s"
    )]
    QueueFull { waiting: usize, retry_after_s: u64 },
    /// Not ready, or shutting down (503).
    #[error("{0}")]
    Unavailable(String),
    /// A remote engine answered with an error status.
    #[error("upstream answered {status}: {message}")]
    Upstream { status: u16, message: String },
    /// A fault of the engine itself (500).
    #[error("{0}")]
    Internal(String),
}

/// A completion engine. The work happens elsewhere (a model thread, a
/// remote server) and arrives on the returned stream.
pub trait Engine: Send + Sync + fmt::Debug {
    /// The model name clients pass as `model`.
    fn model_name(&self) -> &str;

    /// Longest prompt + completion, in tokens, when known.
    fn context_length(&self) -> Option<usize>;

    /// Requests running and waiting now.
    fn load(&self) -> EngineLoad;

    /// Check the request and hand it to the engine; its tokens arrive on
    /// the stream. A local engine tokenizes here, on the caller's thread
    /// (rendering the chat template and encoding: milliseconds for long
    /// prompts, bounded by the context check on the text's bytes first),
    /// then queues without waiting for the model: a full queue is a 429 at
    /// once. A remote engine starts the upstream call on the tokio runtime
    /// and returns at once; the upstream's errors arrive on the stream.
    fn submit(&self, request: EngineRequest) -> Result<EngineStream, EngineError>;

    /// `request.n` choices of one prompt, one stream each (in choice order).
    /// Engines that cannot share a prompt between samples keep this default,
    /// which refuses `n > 1` with a 400 naming the field.
    fn submit_choices(&self, request: EngineRequest) -> Result<Vec<EngineStream>, EngineError> {
        if request.n != 1 {
            return Err(EngineError::InvalidRequest {
                message: format!(
                    "n must be 1 on this engine (it returns one choice per request), got {}",
                    request.n
                ),
                param: Some("n".into()),
            });
        }
        Ok(vec![self.submit(request)?])
    }

    /// Stop taking requests and end the ones in flight with `Finish::Abort`
    /// (a graceful shutdown whose deadline passed).
    fn abort_all(&self);

    /// Metrics of the engine's own, appended to the server's `/metrics` in
    /// Prometheus' text format (e.g. a batcher's batch-size histogram).
    fn extra_metrics(&self, _out: &mut String) {}
}
