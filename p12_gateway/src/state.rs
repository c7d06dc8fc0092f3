//! The gateway's shared state, built once from its config.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::rng::Rng;

use crate::auth::{Caller, Keys};
use crate::clock::Clock;
use crate::config::Config;
use crate::count::Counter;
use crate::limits::Limiter;
use crate::metrics::Metrics;
use crate::routing::{Affinity, Backend, Pool};

/// One model: its backends and its prompt counter.
#[derive(Debug)]
pub struct Route {
    pub pool: Pool,
    pub counter: Arc<Counter>,
}

#[derive(Debug)]
pub struct Gateway {
    pub cfg: Config,
    pub keys: Keys,
    pub limiter: Limiter,
    pub clock: Arc<dyn Clock>,
    /// By model name, in config order.
    pub routes: HashMap<String, Route>,
    pub metrics: Metrics,
    pub http: reqwest::Client,
    rng: Mutex<Rng>,
}

impl Gateway {
    /// `counters` gives each model's counter (a model with none counts bytes).
    pub fn new(
        cfg: Config,
        clock: Arc<dyn Clock>,
        mut counters: HashMap<String, Counter>,
    ) -> Result<Gateway, reqwest::Error> {
        let keys = Keys::new(cfg.keys.iter().map(|k| {
            let models = cfg
                .tenants
                .iter()
                .find(|t| t.name == k.tenant)
                .map(|t| t.models.clone())
                .unwrap_or_default();
            let caller = Caller {
                key: k.name.clone(),
                tenant: k.tenant.clone(),
                models,
            };
            (k.sha256.clone(), caller)
        }));
        let limiter = Limiter::new(
            clock.clone(),
            cfg.keys.iter().map(|k| (k.name.clone(), k.limits())),
        );
        let routes = cfg
            .models
            .iter()
            .map(|m| {
                let backends = m
                    .backends
                    .iter()
                    .map(|u| Arc::new(Backend::new(u, cfg.breaker.config())))
                    .collect();
                let affinity = Affinity {
                    block_tokens: m.affinity_block_tokens,
                    prefix_tokens: m.affinity_prefix_tokens,
                    max_imbalance: m.affinity_max_imbalance,
                };
                let counter = counters
                    .remove(&m.name)
                    .unwrap_or_else(|| Counter::bytes(m.context_length));
                let route = Route {
                    pool: Pool::new(backends, m.routing, affinity).with_scoring(cfg.scoring),
                    counter: Arc::new(counter),
                };
                (m.name.clone(), route)
            })
            .collect();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(cfg.timeouts.connect_ms))
            .pool_idle_timeout(Duration::from_secs(30))
            .build()?;
        Ok(Gateway {
            keys,
            limiter,
            clock,
            routes,
            metrics: Metrics::default(),
            http,
            rng: Mutex::new(Rng::new(0x9e37_79b9_7f4a_7c15 ^ common::openai::unix_now())),
            cfg,
        })
    }

    /// Uniform in [0, 1) (retry jitter).
    pub fn random(&self) -> f64 {
        self.rng
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .next_f64()
    }

    /// (model, url, breaker state, healthy, outstanding) of every backend.
    pub fn backends(&self) -> Vec<(String, String, u8, bool, usize)> {
        use std::sync::atomic::Ordering;
        let mut v: Vec<_> = self
            .routes
            .iter()
            .flat_map(|(m, r)| {
                r.pool.backends().into_iter().map(move |b| {
                    (
                        m.clone(),
                        b.url.clone(),
                        b.breaker().state() as u8,
                        b.healthy.load(Ordering::Relaxed),
                        b.outstanding.load(Ordering::Relaxed),
                    )
                })
            })
            .collect();
        v.sort();
        v
    }
}
