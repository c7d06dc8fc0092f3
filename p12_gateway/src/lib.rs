//! Project 12: an inference gateway, the front door of a fleet of
//! OpenAI-compatible servers (ours, llama.cpp's `llama-server`, anything).
//! It knows who calls ([`auth`]: hashed keys), how much they may use
//! ([`limits`]: token buckets with reservations settled at real usage,
//! prompts counted by [`count`] with the model's own tokenizer), and which
//! backend serves them ([`routing`]: round-robin, least outstanding,
//! prefix affinity, [`score`]d on the servers' reports), and it keeps a failing backend from failing its
//! clients ([`proxy`]: retries before the first byte, [`breaker`],
//! [`health`] checks). [`app`] is the HTTP face; [`metrics`] the
//! Prometheus page. Time comes from a [`clock::Clock`] so tests can run a
//! minute of refill in no time.

pub mod app;
pub mod auth;
#[cfg(feature = "bench")]
pub mod bench;
pub mod breaker;
pub mod clock;
pub mod config;
pub mod count;
pub mod health;
pub mod limits;
pub mod metrics;
pub mod proxy;
mod relay;
pub mod resume;
pub mod routing;
pub mod score;
pub mod sse;
pub mod state;

pub use app::router;
pub use config::Config;
pub use state::Gateway;

use std::collections::HashMap;
use std::sync::Arc;

/// Build the gateway from a config: each model's tokenizer is loaded (a
/// model without one is counted by bytes).
pub fn build(cfg: Config, clock: Arc<dyn clock::Clock>) -> anyhow::Result<Gateway> {
    let mut counters = HashMap::new();
    for m in &cfg.models {
        if let Some(spec) = &m.tokenizer {
            let c = count::Counter::from_gguf(spec, m.context_length, &m.name)
                .map_err(|e| anyhow::anyhow!("model `{}`: tokenizer `{spec}`: {e}", m.name))?;
            counters.insert(m.name.clone(), c);
        }
    }
    Ok(Gateway::new(cfg, clock, counters)?)
}
