//! Load and K/V events through NATS (`async-nats`). Every worker
//! publishes its load five times a second on `inference-lab.p14.load.<id>`
//! and, after each prefill, the chained hashes of the prompt's full blocks
//! (Project 09's prefix-cache keys) on `inference-lab.p14.kv.<id>`. The
//! proxy subscribes to both. NATS is a hint, not a dependency: a worker
//! whose NATS is down keeps serving, and a proxy whose reports go stale
//! routes by the load it sees itself.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};

use crate::routing::Board;
use crate::worker::WorkerLoad;

pub const LOAD_SUBJECT: &str = "inference-lab.p14.load";
pub const KV_SUBJECT: &str = "inference-lab.p14.kv";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    pub id: String,
    pub running: usize,
    pub waiting: usize,
    pub kv_used_blocks: usize,
    pub kv_total_blocks: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvEvent {
    pub id: String,
    /// Block hashes now cached on the worker, prefix order.
    pub stored: Vec<u64>,
}

async fn connect(url: &str) -> Option<async_nats::Client> {
    async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(2))
        .retry_on_initial_connect()
        .connect(url)
        .await
        .ok()
}

/// Publish `load` (and queued K/V events) for worker `id` forever.
pub async fn publish(url: String, id: String, load: Arc<WorkerLoad>) {
    let Some(client) = connect(&url).await else {
        eprintln!("events: no NATS at {url}; not publishing load");
        return;
    };
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tick.tick().await;
        let report = LoadReport {
            id: id.clone(),
            running: load.running.load(Ordering::SeqCst),
            waiting: load.waiting.load(Ordering::SeqCst),
            kv_used_blocks: load.kv_used_blocks.load(Ordering::SeqCst),
            kv_total_blocks: load.kv_total_blocks.load(Ordering::SeqCst),
        };
        let body = serde_json::to_vec(&report).unwrap_or_default();
        // Errors (NATS down) are dropped: the client reconnects by itself.
        let _ = client
            .publish(format!("{LOAD_SUBJECT}.{id}"), body.into())
            .await;
        let stored = std::mem::take(&mut *load.stored.lock().unwrap_or_else(|e| e.into_inner()));
        if !stored.is_empty() {
            let ev = KvEvent {
                id: id.clone(),
                stored,
            };
            let body = serde_json::to_vec(&ev).unwrap_or_default();
            let _ = client
                .publish(format!("{KV_SUBJECT}.{id}"), body.into())
                .await;
        }
    }
}

/// Feed every load report and K/V event into `board` forever.
pub async fn subscribe(url: String, board: Arc<Board>) {
    loop {
        let Some(client) = connect(&url).await else {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        let (Ok(mut loads), Ok(mut kvs)) = (
            client.subscribe(format!("{LOAD_SUBJECT}.>")).await,
            client.subscribe(format!("{KV_SUBJECT}.>")).await,
        ) else {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        loop {
            tokio::select! {
                m = loads.next() => match m {
                    Some(m) => if let Ok(r) = serde_json::from_slice::<LoadReport>(&m.payload) {
                        board.report(r);
                    },
                    None => break,
                },
                m = kvs.next() => match m {
                    Some(m) => if let Ok(e) = serde_json::from_slice::<KvEvent>(&m.payload) {
                        board.stored(&e.id, &e.stored);
                    },
                    None => break,
                },
            }
        }
    }
}
