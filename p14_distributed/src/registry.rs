//! Discovery through etcd. A worker writes its record under
//! `/inference-lab/p14/workers/<role>/<id>` (or, in a namespace,
//! `/inference-lab/p14/<namespace>/workers/<role>/<id>`: a proxy sees
//! only its namespace's workers) with a lease it keeps alive
//! (a third of the TTL between renewals); when the worker dies or stops,
//! the lease expires and etcd deletes the key. A lease found expired (a
//! worker that was stopped and resumed) is replaced and the record
//! written again. The proxy lists the prefix, then watches it from the
//! next revision, and lists again whenever the watch ends: its view is
//! recomputed from etcd, never only patched by events it may have missed.
//! While etcd is unreachable the proxy keeps its last view.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::etcd::{Etcd, WatchEvent};

pub const PREFIX: &str = "/inference-lab/p14/workers/";

/// The workers' key prefix in `namespace` ([`PREFIX`] without one).
pub fn prefix(namespace: Option<&str>) -> String {
    match namespace {
        None => PREFIX.to_string(),
        Some(ns) => format!("/inference-lab/p14/{ns}/workers/"),
    }
}

/// A namespace as an argument: 1 to 128 of `A-Z a-z 0-9 . _ -` (it
/// becomes one segment of an etcd key).
pub fn parse_namespace(s: &str) -> Result<String, String> {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if s.is_empty() || s.len() > 128 || !s.chars().all(ok) {
        return Err(format!(
            "`{s}`: a namespace is 1 to 128 letters, digits, `.`, `_` or `-`"
        ));
    }
    Ok(s.to_string())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// What a worker says about itself.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerRecord {
    pub id: String,
    pub role: Role,
    /// The served model name.
    pub model: String,
    /// Model file and weight format (K/V of one is garbage to another).
    pub model_id: u64,
    /// Its control endpoint, `http://host:port`.
    pub http: String,
    /// Its K/V server, `host:port` (prefill workers).
    pub kv_addr: Option<String>,
    /// Hash of its K/V layout: prefill and decode must agree.
    pub layout_hash: u64,
    pub block_size: usize,
    pub kv_blocks: usize,
    pub context_length: usize,
    pub pid: u32,
}

impl WorkerRecord {
    /// One process of the worker: its id, endpoint and pid (a worker
    /// restarted under its old id is another instance).
    pub fn instance(&self) -> String {
        format!("{}@{} (pid {})", self.id, self.http, self.pid)
    }

    /// Its key under `prefix` (see [`prefix`]).
    pub fn key_in(&self, prefix: &str) -> String {
        format!("{prefix}{}/{}", self.role.as_str(), self.id)
    }
}

/// Keep `record` registered under `prefix` with a lease of `ttl_s` until
/// the process ends: renew, and re-register whenever the lease is lost.
/// (A draining worker deletes its key: the lease lives on, the key is
/// not written again.)
pub async fn keep_registered(etcd: Etcd, prefix: String, record: WorkerRecord, ttl_s: i64) {
    let value = serde_json::to_vec(&record).unwrap_or_default();
    let key = record.key_in(&prefix);
    let period = Duration::from_millis((ttl_s.max(1) as u64 * 1000) / 3);
    loop {
        let lease = match etcd.grant(ttl_s).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("registry: {e}; retrying");
                tokio::time::sleep(period).await;
                continue;
            }
        };
        if let Err(e) = etcd.put(&key, &value, Some(lease)).await {
            eprintln!("registry: {e}; retrying");
            tokio::time::sleep(period).await;
            continue;
        }
        eprintln!("registry: {key} registered (lease {lease:x}, ttl {ttl_s} s)");
        loop {
            tokio::time::sleep(period).await;
            match etcd.keep_alive(lease).await {
                Ok(_) => {}
                Err(crate::etcd::EtcdError::LeaseExpired(_)) => {
                    eprintln!("registry: lease {lease:x} expired; registering again");
                    break;
                }
                // etcd unreachable: keep trying the same lease until it
                // is known to be gone.
                Err(e) => eprintln!("registry: {e}"),
            }
        }
    }
}

/// The proxy's view of the workers.
#[derive(Debug, Default)]
pub struct View {
    workers: RwLock<HashMap<String, WorkerRecord>>,
    /// Times the view was rebuilt from a full listing.
    pub resyncs: std::sync::atomic::AtomicU64,
}

impl View {
    pub fn workers(&self, role: Role) -> Vec<WorkerRecord> {
        let mut v: Vec<WorkerRecord> = self
            .workers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|w| w.role == role)
            .cloned()
            .collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    fn replace(&self, all: HashMap<String, WorkerRecord>) {
        *self.workers.write().unwrap_or_else(|e| e.into_inner()) = all;
    }

    fn apply(&self, e: WatchEvent) {
        let mut w = self.workers.write().unwrap_or_else(|e| e.into_inner());
        match e {
            WatchEvent::Put(kv) => {
                if let Ok(r) = serde_json::from_slice::<WorkerRecord>(&kv.value) {
                    w.insert(kv.key, r);
                }
            }
            WatchEvent::Delete(k) => {
                w.remove(&k);
            }
        }
    }
}

/// List and watch the workers under `prefix` into `view` forever.
pub async fn follow(etcd: Etcd, prefix: String, view: Arc<View>) {
    loop {
        let rev = match etcd.get_prefix(&prefix).await {
            Ok((kvs, rev)) => {
                let all = kvs
                    .into_iter()
                    .filter_map(|kv| {
                        let r = serde_json::from_slice::<WorkerRecord>(&kv.value).ok()?;
                        Some((kv.key, r))
                    })
                    .collect();
                view.replace(all);
                view.resyncs
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                rev
            }
            Err(_) => {
                // Unreachable: serve from the last view, try again soon.
                tokio::time::sleep(Duration::from_millis(300)).await;
                continue;
            }
        };
        let v = view.clone();
        let _ = etcd
            .watch(&prefix, rev + 1, Duration::from_secs(3), move |e| {
                v.apply(e)
            })
            .await;
    }
}
