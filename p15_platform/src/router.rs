//! The router: Project 12's gateway (keys, limits, token counting, retries,
//! breakers, its routing policies: prefix affinity, or `scored` on the
//! servers' reported queue and K/V usage) with its backends read from
//! etcd as they change, and Knative's activator in front of a deployment at zero.
//!
//! ```text
//! every 200 ms: endpoints/<deployment>/... -> that model's pool (no restart;
//!               a backend that stays keeps its counters and breaker)
//! a request for a model with no backend: held (its pool counts it) until
//!               one appears or the hold passes, then 503 + Retry-After
//! GET /p15/held: {deployment: requests held} for the controller's
//!               autoscaler (the only load a deployment at zero has)
//! registered under its lease at routers/<id>, so controllers find it
//! ```
//!
//! The router learns endpoints from what the controller published, not
//! from the servers' own reports: a server the controller is draining
//! leaves the router's pool before its node agent stops it.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::State;
use axum::routing::get;
use axum::Json;
use p12_gateway::clock::SystemClock;
use p12_gateway::{build, Config, Gateway};
use p14_distributed::etcd::Etcd;

use crate::state::{RouterRecord, ENDPOINTS, ROUTERS};

#[derive(Clone, Debug)]
pub struct RouterConfig {
    pub id: String,
    pub etcd: Vec<String>,
    pub ttl_s: i64,
}

/// Set every pool from the published endpoints; how many pools changed.
pub async fn sync(g: &Gateway, etcd: &Etcd) -> anyhow::Result<usize> {
    let (kvs, _) = etcd.get_prefix(ENDPOINTS).await?;
    let mut by_model: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for kv in &kvs {
        if let Some((dep, _)) = kv.key[ENDPOINTS.len()..].split_once('/') {
            let url = String::from_utf8_lossy(&kv.value).to_string();
            by_model.entry(dep).or_default().push(url);
        }
    }
    let breaker = g.cfg.breaker.config();
    let mut changed = 0;
    for (model, route) in &g.routes {
        let mut urls = by_model.remove(model.as_str()).unwrap_or_default();
        urls.sort();
        changed += route.pool.set_urls(&urls, breaker) as usize;
    }
    Ok(changed)
}

async fn held(State(g): State<Arc<Gateway>>) -> Json<BTreeMap<String, usize>> {
    Json(
        g.routes
            .iter()
            .map(|(m, r)| (m.clone(), r.pool.held.load(Ordering::Relaxed)))
            .collect(),
    )
}

/// Keep `rec` registered under a lease of `ttl_s` (re-registered if the
/// lease was lost).
async fn keep_registered(etcd: Etcd, rec: RouterRecord, ttl_s: i64) {
    let key = format!("{ROUTERS}{}", rec.id);
    let value = serde_json::to_vec(&rec).unwrap_or_default();
    let mut lease = None;
    loop {
        let alive = match lease {
            Some(l) => etcd.keep_alive(l).await.is_ok(),
            None => false,
        };
        if !alive {
            lease = match etcd.grant(ttl_s).await {
                Ok(l) if etcd.put(&key, &value, Some(l)).await.is_ok() => Some(l),
                _ => None,
            };
        }
        tokio::time::sleep(Duration::from_millis((ttl_s.max(1) as u64 * 1000) / 4)).await;
    }
}

/// Serve with the gateway config at `config` (its models name
/// deployments; their `backends` may be empty) until SIGTERM/SIGINT.
pub async fn run(rc: RouterConfig, config: &Path, listen: Option<String>) -> anyhow::Result<()> {
    let mut cfg = Config::load(config)?;
    if let Some(l) = listen {
        cfg.listen = l;
    }
    let listen = cfg.listen.clone();
    let g = Arc::new(build(cfg, Arc::new(SystemClock::default()))?);
    let etcd = Etcd::new(rc.etcd.clone(), Duration::from_secs(2));
    tokio::spawn(p12_gateway::health::run(g.clone()));
    tokio::spawn(p12_gateway::score::run(g.clone()));
    let (g2, e2) = (g.clone(), etcd.clone());
    tokio::spawn(async move {
        loop {
            if let Err(e) = sync(&g2, &e2).await {
                eprintln!("router: reading endpoints: {e:#}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .with_context(|| format!("bind {listen}"))?;
    let url = format!("http://{}", listener.local_addr()?);
    let rec = RouterRecord {
        id: rc.id.clone(),
        url: url.clone(),
    };
    tokio::spawn(keep_registered(etcd, rec, rc.ttl_s));
    println!("router {} listening on {url}", rc.id);
    let app = p12_gateway::router(g.clone()).merge(
        axum::Router::new()
            .route("/p15/held", get(held))
            .with_state(g),
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(p06_server::server::shutdown_signal())
        .await?;
    Ok(())
}
