//! Project 06: an OpenAI-compatible streaming server.
//!
//! - [`request`]: JSON in, every field checked, an [`common::engine::EngineRequest`] out.
//! - [`input`]: request → token ids and generation settings (template, BOS, context, sampling), shared by local engines.
//! - [`gauges`]: what a local engine counts (waiting, running, K/V bytes, closing, service time).
//! - [`front`]: the front every local engine shares: model thread, job queue, submit, drain.
//! - [`serial`]: the serial engine: one model thread, a bounded queue, cancellation between steps.
//! - [`load`]: `--model` to a loaded model and tokenizer, and the errors of loading and starting.
//! - [`template`]: the model's chat template (Jinja, from the GGUF).
//! - [`routes`]: the axum router: completions, chat, models, health, metrics; SSE streaming.
//! - [`response`]: response and chunk objects; [`error`]: OpenAI error bodies and status codes.
//! - [`metrics`]: Prometheus text with vLLM's names; [`server`]: start, drain, stop.
//!
//! The HTTP layer (`routes`, `server`, `error`) is the `http` feature (on
//! by default); without it the crate is the engines' side alone, with no
//! axum: Projects 07 and 08 build their engines on it.
//! - [`bench`]: the `bench` command: the load generator against any OpenAI-compatible server.

#[cfg(feature = "bench")]
pub mod bench;
#[cfg(feature = "bench")]
pub mod bench_overhead;
#[cfg(feature = "http")]
pub mod error;
pub mod front;
pub mod gauges;
pub mod input;
pub mod load;
pub mod metrics;
#[cfg(feature = "http")]
pub mod request;
#[cfg(feature = "http")]
pub mod response;
#[cfg(feature = "http")]
pub mod routes;
pub mod serial;
#[cfg(feature = "http")]
pub mod server;
pub mod template;

pub use load::{LoadError, ResolveError, StartError};
#[cfg(feature = "http")]
pub use routes::{router, AppState};
pub use serial::SerialEngine;
