//! The gateway's configuration: a TOML file (see `gateway.toml` in this
//! crate for a documented example). Keys are stored only as SHA-256 hashes
//! (`p12_gateway hash-key` makes one); everything is checked at load, with
//! errors naming the field.

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;

use crate::breaker::BreakerConfig;
use crate::limits::KeyLimits;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Toml {
        path: String,
        source: Box<toml::de::Error>,
    },
    #[error("{path}: {field}: {msg}")]
    Invalid {
        path: String,
        field: String,
        msg: String,
    },
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Address to listen on, e.g. "127.0.0.1:8100".
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Largest request body, bytes.
    #[serde(default = "default_body")]
    pub max_body_bytes: usize,
    #[serde(default)]
    pub timeouts: Timeouts,
    #[serde(default)]
    pub retry: Retry,
    #[serde(default)]
    pub breaker: Breaker,
    #[serde(default)]
    pub health: Health,
    #[serde(default)]
    pub activator: Activator,
    #[serde(default)]
    pub scoring: Scoring,
    #[serde(default)]
    pub tenants: Vec<Tenant>,
    #[serde(default)]
    pub keys: Vec<Key>,
    #[serde(default)]
    pub models: Vec<Model>,
}

fn default_listen() -> String {
    "127.0.0.1:8100".into()
}

fn default_body() -> usize {
    1 << 20
}

#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// TCP connect to a backend.
    pub connect_ms: u64,
    /// From sending a request to the backend's first body bytes (a
    /// streaming response's first event; a whole non-streaming answer's start).
    pub first_byte_ms: u64,
    /// The whole request, first attempt to last byte.
    pub total_ms: u64,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts {
            connect_ms: 1_000,
            first_byte_ms: 60_000,
            total_ms: 600_000,
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Retry {
    /// Attempts per request, the first included.
    pub max_attempts: u32,
    /// Backoff before attempt k (k >= 1): uniform in [0, min(max, base * 2^(k-1))]
    /// ("full jitter").
    pub base_ms: u64,
    pub max_ms: u64,
}

impl Default for Retry {
    fn default() -> Retry {
        Retry {
            max_attempts: 3,
            base_ms: 25,
            max_ms: 1_000,
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Breaker {
    pub failures_to_open: u32,
    pub cooldown_ms: u64,
    pub successes_to_close: u32,
}

impl Default for Breaker {
    fn default() -> Breaker {
        let d = BreakerConfig::default();
        Breaker {
            failures_to_open: d.failures_to_open,
            cooldown_ms: d.cooldown.as_millis() as u64,
            successes_to_close: d.successes_to_close,
        }
    }
}

impl Breaker {
    pub fn config(&self) -> BreakerConfig {
        BreakerConfig {
            failures_to_open: self.failures_to_open,
            cooldown: Duration::from_millis(self.cooldown_ms),
            successes_to_close: self.successes_to_close,
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Health {
    /// How often each backend's `/health` is polled (0: never).
    pub interval_ms: u64,
    pub timeout_ms: u64,
    /// Consecutive failed checks that eject a backend; one success brings it back.
    pub failures_to_eject: u32,
}

impl Default for Health {
    fn default() -> Health {
        Health {
            interval_ms: 2_000,
            timeout_ms: 1_000,
            failures_to_eject: 2,
        }
    }
}

/// Requests for a model with no backend in rotation: held this long for
/// one to appear (0: answered 503 at once), then answered 503 with
/// `Retry-After`. With a hold, a model may list no backends: a platform
/// fills them in as its servers become ready.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Activator {
    pub hold_ms: u64,
    pub retry_after_s: u64,
}

/// The `scored` policy's weights and inputs (see `score`). The defaults
/// are llm-d's default profile (prefix 3, queue 2) plus K/V usage at 1.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Scoring {
    pub prefix_weight: f64,
    pub queue_weight: f64,
    pub kv_weight: f64,
    /// A backend reporting this much of its K/V pool in use is filtered
    /// out (unless every backend is).
    pub kv_full: f64,
    /// How often each backend's `/metrics` is read.
    pub scrape_ms: u64,
    /// Block hashes remembered per backend (about its prefix cache's
    /// size in blocks).
    pub index_blocks: usize,
}

impl Default for Scoring {
    fn default() -> Scoring {
        Scoring {
            prefix_weight: 3.0,
            queue_weight: 2.0,
            kv_weight: 1.0,
            kv_full: 0.95,
            scrape_ms: 100,
            index_blocks: 4096,
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    pub name: String,
    /// Models this tenant's keys may use.
    pub models: Vec<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Key {
    /// A label for metrics and logs (never the key itself).
    pub name: String,
    pub tenant: String,
    /// Hex SHA-256 of the key.
    pub sha256: String,
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
    pub max_concurrent: Option<usize>,
}

impl Key {
    pub fn limits(&self) -> KeyLimits {
        KeyLimits {
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
            max_concurrent: self.max_concurrent,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    #[default]
    RoundRobin,
    LeastOutstanding,
    PrefixAffinity,
    /// llm-d's filter -> score -> pick on the servers' reports.
    Scored,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Model {
    /// The name clients send as `model` (and the backends serve).
    pub name: String,
    /// Base URLs, e.g. "http://127.0.0.1:8000" (no `/v1`).
    pub backends: Vec<String>,
    #[serde(default)]
    pub routing: Policy,
    /// The model's tokenizer (a GGUF path, or a name `p06_server` resolves,
    /// e.g. "smollm2"): prompts are counted exactly. Without one, a prompt
    /// is reserved at its byte count, an upper bound on its tokens.
    pub tokenizer: Option<String>,
    /// The context length, for requests without `max_tokens` (they may
    /// generate up to it). Read from the tokenizer's GGUF when absent.
    pub context_length: Option<usize>,
    /// Prefix affinity: tokens per hashed block, and how many leading
    /// tokens decide the backend. Shorter than the shared part of the
    /// prompts (a system prompt), or their differing tails split them.
    #[serde(default = "default_block")]
    pub affinity_block_tokens: usize,
    #[serde(default = "default_affinity")]
    pub affinity_prefix_tokens: usize,
    /// Prefix affinity gives way to the least-loaded backend when its
    /// choice has this many more requests in flight.
    #[serde(default = "default_imbalance")]
    pub affinity_max_imbalance: usize,
}

fn default_block() -> usize {
    16
}

fn default_affinity() -> usize {
    64
}

fn default_imbalance() -> usize {
    8
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: p.clone(),
            source,
        })?;
        Config::parse(&text, &p)
    }

    /// Parse and check; `path` names the source in errors.
    pub fn parse(text: &str, path: &str) -> Result<Config, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|source| ConfigError::Toml {
            path: path.to_string(),
            source: Box::new(source),
        })?;
        cfg.check(path)?;
        Ok(cfg)
    }

    fn check(&self, path: &str) -> Result<(), ConfigError> {
        let bad = |field: String, msg: String| {
            Err(ConfigError::Invalid {
                path: path.to_string(),
                field,
                msg,
            })
        };
        let mut names = std::collections::HashSet::new();
        for (i, m) in self.models.iter().enumerate() {
            if !names.insert(m.name.as_str()) {
                return bad(format!("models[{i}].name"), format!("`{}` twice", m.name));
            }
            if m.backends.is_empty() && self.activator.hold_ms == 0 {
                return bad(
                    format!("models[{i}].backends"),
                    "at least one backend".into(),
                );
            }
            for (j, b) in m.backends.iter().enumerate() {
                if !(b.starts_with("http://") || b.starts_with("https://")) {
                    return bad(
                        format!("models[{i}].backends[{j}]"),
                        format!("`{b}` is not an http(s) URL"),
                    );
                }
            }
            if m.affinity_block_tokens == 0 || m.affinity_prefix_tokens < m.affinity_block_tokens {
                return bad(
                    format!("models[{i}].affinity_prefix_tokens"),
                    "at least one block of at least one token".into(),
                );
            }
        }
        for (i, t) in self.tenants.iter().enumerate() {
            for m in &t.models {
                if !names.contains(m.as_str()) {
                    return bad(
                        format!("tenants[{i}].models"),
                        format!("`{m}` is not a configured model"),
                    );
                }
            }
        }
        let mut hashes = std::collections::HashSet::new();
        for (i, k) in self.keys.iter().enumerate() {
            if !self.tenants.iter().any(|t| t.name == k.tenant) {
                return bad(
                    format!("keys[{i}].tenant"),
                    format!("`{}` is not a configured tenant", k.tenant),
                );
            }
            if crate::auth::parse_hash(&k.sha256).is_none() {
                return bad(
                    format!("keys[{i}].sha256"),
                    "expected 64 hex digits (`p12_gateway hash-key` prints them)".into(),
                );
            }
            if !hashes.insert(k.sha256.to_ascii_lowercase()) {
                return bad(format!("keys[{i}].sha256"), "the same key twice".into());
            }
        }
        if self.retry.max_attempts == 0 {
            return bad("retry.max_attempts".into(), "at least 1".into());
        }
        if self.breaker.failures_to_open == 0 || self.breaker.successes_to_close == 0 {
            return bad("breaker".into(), "counts must be at least 1".into());
        }
        if self.health.failures_to_eject == 0 {
            return bad("health.failures_to_eject".into(), "at least 1".into());
        }
        let sc = &self.scoring;
        for (field, w) in [
            ("prefix_weight", sc.prefix_weight),
            ("queue_weight", sc.queue_weight),
            ("kv_weight", sc.kv_weight),
        ] {
            if !(w.is_finite() && w >= 0.0) {
                return bad(format!("scoring.{field}"), format!("{w} is not >= 0"));
            }
        }
        if !(sc.kv_full > 0.0 && sc.kv_full <= 1.0) {
            return bad("scoring.kv_full".into(), "a fraction in (0, 1]".into());
        }
        if sc.scrape_ms == 0 || sc.index_blocks == 0 {
            return bad(
                "scoring".into(),
                "scrape_ms and index_blocks at least 1".into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = r#"
        [[tenants]]
        name = "a"
        models = ["m"]
        [[keys]]
        name = "k"
        tenant = "a"
        sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
        [[models]]
        name = "m"
        backends = ["http://127.0.0.1:1"]
    "#;

    #[test]
    fn the_example_config_parses() {
        let text = include_str!("../gateway.toml");
        let c = Config::parse(text, "gateway.toml").unwrap();
        assert!(!c.models.is_empty() && !c.keys.is_empty());
    }

    #[test]
    fn a_model_may_list_no_backends_only_with_an_activator_hold() {
        let empty = OK.replace("backends = [\"http://127.0.0.1:1\"]", "backends = []");
        let e = Config::parse(&empty, "t").unwrap_err();
        assert!(e.to_string().contains("models[0].backends"), "{e}");
        let held = format!("[activator]\nhold_ms = 1000\n{empty}");
        let c = Config::parse(&held, "t").unwrap();
        assert_eq!(c.activator.hold_ms, 1000);
        assert!(c.models[0].backends.is_empty());
    }

    #[test]
    fn mistakes_name_their_field() {
        assert!(Config::parse(OK, "t").is_ok());
        let cases = [
            (
                OK.replace("models = [\"m\"]", "models = [\"x\"]"),
                "tenants[0].models",
            ),
            (
                OK.replace("tenant = \"a\"", "tenant = \"b\""),
                "keys[0].tenant",
            ),
            (OK.replace("9f86", "zz86"), "keys[0].sha256"),
            (
                OK.replace("http://127", "ftp://127"),
                "models[0].backends[0]",
            ),
            (
                OK.replace("backends = [\"http://127.0.0.1:1\"]", "backends = []"),
                "models[0].backends",
            ),
            (
                format!("[scoring]\nqueue_weight = -1\n{OK}"),
                "scoring.queue_weight",
            ),
            (format!("[scoring]\nkv_full = 1.5\n{OK}"), "scoring.kv_full"),
        ];
        for (text, field) in cases {
            let e = Config::parse(&text, "t").unwrap_err().to_string();
            assert!(e.contains(field), "{e} should name {field}");
        }
        let e = Config::parse(&format!("{OK}\nbogus = 1"), "t")
            .unwrap_err()
            .to_string();
        assert!(e.contains("bogus"), "{e}");
    }
}
