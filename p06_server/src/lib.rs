//! Project 06: an OpenAI-compatible streaming server.
//!
//! - [`request`]: JSON in, every field checked, an [`common::engine::EngineRequest`] out.
//! - [`input`]: request → token ids and generation settings (template, BOS, context, sampling), shared by local engines.
//! - [`gauges`]: what a local engine counts (waiting, running, K/V bytes, closing, service time).
//! - [`serial`]: the serial engine: one model thread, a bounded queue, cancellation between steps.
//! - [`template`]: the model's chat template (Jinja, from the GGUF).
//! - [`routes`]: the axum router: completions, chat, models, health, metrics; SSE streaming.
//! - [`response`]: response and chunk objects; [`error`]: OpenAI error bodies and status codes.
//! - [`metrics`]: Prometheus text with vLLM's names; [`server`]: start, drain, stop.
//! - [`bench`]: the `bench` command: the load generator against any OpenAI-compatible server.

#[cfg(feature = "bench")]
pub mod bench;
#[cfg(feature = "bench")]
pub mod bench_overhead;
pub mod error;
pub mod gauges;
pub mod input;
pub mod metrics;
pub mod request;
pub mod response;
pub mod routes;
pub mod serial;
pub mod server;
pub mod template;

pub use error::{LoadError, ResolveError, StartError};
pub use routes::{router, AppState};
pub use serial::SerialEngine;
