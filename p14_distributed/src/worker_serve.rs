//! A prefill or decode worker as a process: load the model, start the
//! model thread (and, for prefill, the K/V server), register in etcd,
//! publish load to NATS, and answer the proxy on a small HTTP control
//! API:
//!
//! ```text
//! POST /prefill   WirePrepared  → PrefillReply (JSON)
//! POST /prefill_stream WirePrepared → PrefillReply::Started (JSON) at once:
//!                 the K/V streams while the prefill runs
//! POST /decode    DecodeOrder   → WireEvent per line (NDJSON), first Admitted
//! POST /cancel    {"transfer_id"} → {"cancelled": bool}: the request's
//!                 client left; its K/V is freed (a streamed prefill stops)
//! GET  /stats     counters (JSON): K/V held, sent, acknowledged, expired,
//!                 imports, recomputes, blocks in use
//! GET  /health    200 once the model is loaded
//! ```

use std::net::TcpListener as StdListener;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::body::Body;
use axum::extract::State;
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Args;
use common::batch::BatchModel;
use futures_util::StreamExt;
use p08_continuous::cli::SchedArgs;
use p08_continuous::kv_transfer::KvLayout;
use p09_kv_manager::PagedKv;
use serde_json::json;
use tokio::sync::{mpsc, oneshot};
use xxhash_rust::xxh3::xxh3_64;

use p10_quant::serve::LoadArgs;
use p10_quant::Weights;

use crate::etcd::Etcd;
use crate::kv_server::{Faults, KvServer};
use crate::registry::{self, Role, WorkerRecord};
use crate::wire::{DecodeOrder, PrefillReply, WireEvent, WirePrepared};
use crate::worker::{self, Job, WorkerHandle};
use crate::worker_pull::pull_then_submit;
pub use crate::worker_pull::LandIn;

#[derive(Clone, Debug, Args)]
pub struct WorkerArgs {
    /// `smollm2` (fetched on first run) or a .gguf file.
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Project 10's flags: the weights and the kernels.
    #[command(flatten)]
    pub load: LoadArgs,
    /// etcd client URLs, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub etcd: Vec<String>,
    /// NATS URL (`nats://host:port`); none: no load reports.
    #[arg(long)]
    pub nats: Option<String>,
    /// Address to listen on and to advertise.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Control port (0: any free port).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// K/V server port, prefill workers (0: any free port).
    #[arg(long, default_value_t = 0)]
    pub kv_port: u16,
    /// Registered id (default: role-host-port).
    #[arg(long)]
    pub id: Option<String>,
    /// Register in this namespace (a proxy with the same `--namespace`
    /// sees it); none: the shared pool.
    #[arg(long, value_parser = registry::parse_namespace)]
    pub namespace: Option<String>,
    /// Seconds the requests in flight get to finish after SIGTERM/SIGINT
    /// (the worker leaves the registry first, so no new ones come).
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_s: u64,
    /// Seconds of the etcd lease a worker's record lives under.
    #[arg(long, default_value_t = 3)]
    pub lease_ttl_s: i64,
    /// Milliseconds a prefill worker holds a prompt's K/V for its decode
    /// worker before freeing it unacknowledged.
    #[arg(long, default_value_t = 10_000)]
    pub transfer_lease_ms: u64,
    /// Positions per K/V block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Decode workers: seconds a pull may go without progress.
    #[arg(long, default_value_t = 10)]
    pub pull_timeout_s: u64,
    /// Decode workers: the pull threads' nice value (0 to 19). Above 0,
    /// the model thread wins the core when both are ready: a pull's copies
    /// wait, the running streams' steps do not (bench-itl measures both).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i32).range(0..=19))]
    pub pull_nice: i32,
    /// Decode workers: where a pull's frames land: `blocks`, the worker's
    /// own K/V blocks reserved before the pull (a kept buffer when none
    /// are free then), or always `buffer`, copied into blocks on the model
    /// thread at the import (the reference path; bench-itl compares both).
    #[arg(long, value_enum, default_value_t = LandIn::Blocks)]
    pub land_in: LandIn,
    /// Pin the worker to this CPU (benchmarks: one core per role).
    #[arg(long)]
    pub cpu: Option<usize>,
    #[command(flatten)]
    pub sched: SchedArgs,
    /// Fault tests: flip a bit in this layer's frame (prefill workers).
    #[arg(long, hide = true)]
    pub fault_corrupt_layer: Option<usize>,
    /// Fault tests: exit after sending this many layers (prefill workers).
    #[arg(long, hide = true)]
    pub fault_die_after_layers: Option<usize>,
}

/// Identity of a model file and weight format: its size and an XXH3 of
/// its bytes, with the format.
pub fn model_id(path: &Path, weights: Weights) -> anyhow::Result<u64> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: the model file is read-only for the life of the map; a file
    // changed under a running server is outside what this serves.
    let map =
        unsafe { memmap2::Mmap::map(&f) }.with_context(|| format!("mapping {}", path.display()))?;
    let tag = weights.as_str().as_bytes();
    Ok(xxh3_64(&map) ^ xxh3_64(tag).rotate_left(1) ^ map.len() as u64)
}

pub fn layout_hash(l: &KvLayout) -> u64 {
    let s = format!(
        "{}/{}/{}/{}/{}/{:?}",
        l.n_layer, l.n_kv_head, l.head_start, l.head_dim, l.block_size, l.dtype
    );
    xxh3_64(s.as_bytes())
}

#[derive(Clone)]
pub(crate) struct Ctx {
    pub(crate) handle: WorkerHandle,
    pub(crate) server: Option<Arc<KvServer>>,
    pub(crate) layout: KvLayout,
    pub(crate) model_id: u64,
    pub(crate) capacity: usize,
    pub(crate) pull_timeout: Duration,
    pub(crate) pull_nice: i32,
    pub(crate) land_in: LandIn,
}

/// The co-located engine the disaggregated one is measured and tested
/// against: the same weights on Project 09's paged K/V (blocks of 16,
/// prefix caching) under Project 08's continuous batching, in this
/// process.
pub fn colocated(
    path: &Path,
    weights: Weights,
    kv_cache_bytes: usize,
) -> anyhow::Result<p08_continuous::ContinuousEngine> {
    let (engine, tok) = p06_server::load::with_tokenizer(path, LoadArgs::of(weights).load(path)?)?;
    let config = p08_continuous::ContinuousConfig {
        kv_cache_bytes,
        ..Default::default()
    };
    let kv = PagedKv::new(engine.kv_shape(), 16, kv_cache_bytes, true)?;
    let name = p06_server::load::served_name("smollm2");
    Ok(p08_continuous::ContinuousEngine::start_with_backend(
        Arc::new(engine),
        Arc::new(tok),
        &name,
        config,
        kv,
    )?)
}

/// Run a worker of `role` until the process is killed.
pub fn run(role: Role, a: WorkerArgs) -> anyhow::Result<()> {
    if let Some(cpu) = a.cpu {
        pin_to(cpu)?;
    }
    let path = p06_server::load::resolve_model(&a.model)?;
    let t0 = Instant::now();
    let loaded = a.load.load(&path)?;
    let (engine, tok) = p06_server::load::with_tokenizer(&path, loaded)?;
    let model_id = model_id(&path, a.load.weights)?;
    let config = a.sched.config();
    let kv = PagedKv::new(engine.kv_shape(), a.block_size, config.kv_cache_bytes, true)?;
    let layout = kv.manager().layout();
    let blocks = kv.manager().pool().num_blocks();
    let capacity = blocks * a.block_size;
    let context = common::Model::info(&engine).context_length;
    let served = p06_server::load::served_name(&a.model);
    let control = StdListener::bind((a.host.as_str(), a.port))
        .with_context(|| format!("binding {}:{}", a.host, a.port))?;
    let port = control.local_addr()?.port();
    let id =
        a.id.clone()
            .unwrap_or_else(|| format!("{}-{}-{port}", role.as_str(), a.host));
    let server = match role {
        Role::Prefill => {
            let l = StdListener::bind((a.host.as_str(), a.kv_port))
                .with_context(|| format!("binding {}:{}", a.host, a.kv_port))?;
            let advertise = format!("{}:{}", a.host, l.local_addr()?.port());
            let faults = Faults {
                corrupt_layer: a.fault_corrupt_layer,
                die_after_layers: a.fault_die_after_layers,
            };
            let lease = Duration::from_millis(a.transfer_lease_ms);
            Some(KvServer::start(
                l, advertise, model_id, layout, lease, faults,
            ))
        }
        Role::Decode => None,
    };
    let handle = worker::start(Arc::new(engine), Arc::new(tok), config, kv, server.clone())?;
    let record = WorkerRecord {
        id: id.clone(),
        role,
        model: served,
        model_id,
        http: format!("http://{}:{port}", a.host),
        kv_addr: server.as_ref().map(|s| s.addr.clone()),
        layout_hash: layout_hash(&layout),
        block_size: a.block_size,
        kv_blocks: blocks,
        context_length: context,
        pid: std::process::id(),
    };
    eprintln!(
        "{} worker {id}: loaded in {:.1} s; control {}, K/V {:?}",
        role.as_str(),
        t0.elapsed().as_secs_f64(),
        record.http,
        record.kv_addr
    );
    let ctx = Ctx {
        handle: handle.clone(),
        server,
        layout,
        model_id,
        capacity,
        pull_timeout: Duration::from_secs(a.pull_timeout_s),
        pull_nice: a.pull_nice,
        land_in: a.land_in,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let etcd = Etcd::new(a.etcd.clone(), Duration::from_secs(2));
        let prefix = registry::prefix(a.namespace.as_deref());
        let key = record.key_in(&prefix);
        tokio::spawn(registry::keep_registered(
            etcd.clone(),
            prefix,
            record,
            a.lease_ttl_s,
        ));
        if let Some(url) = a.nats.clone() {
            tokio::spawn(crate::events::publish(url, id.clone(), handle.load.clone()));
        }
        control.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(control)?;
        let app = Router::new()
            .route("/prefill", post(prefill))
            .route("/prefill_stream", post(prefill_stream))
            .route("/decode", post(decode))
            .route("/cancel", post(cancel))
            .route("/stats", get(stats))
            .route("/health", get(|| async { "ok" }))
            .with_state(ctx);
        println!("ready {port}");
        let _ = std::io::Write::flush(&mut std::io::stdout());
        let grace = Duration::from_secs(a.shutdown_grace_s);
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
            let _ = stop_rx.await;
        });
        let mut serve = std::pin::pin!(std::future::IntoFuture::into_future(serve));
        tokio::select! {
            r = &mut serve => return Ok(r?),
            _ = p06_server::server::shutdown_signal() => {}
        }
        // Drain: leave the registry (proxies stop choosing this worker),
        // refuse new connections, let the requests in flight finish.
        eprintln!(
            "{} worker {id}: draining for up to {} s",
            role.as_str(),
            grace.as_secs()
        );
        let _ = etcd.delete(&key).await;
        // The proxies' moment to see the key go (a watch event away).
        tokio::time::sleep(Duration::from_millis(500)).await;
        let _ = stop_tx.send(());
        if tokio::time::timeout(grace, serve).await.is_err() {
            eprintln!(
                "{} worker {id}: requests still in flight after {} s; stopping",
                role.as_str(),
                grace.as_secs()
            );
        }
        anyhow::Ok(())
    })
}

async fn prefill(State(ctx): State<Ctx>, Json(prep): Json<WirePrepared>) -> Json<PrefillReply> {
    let (tx, rx) = oneshot::channel();
    let job = Job::Prefill {
        prep,
        arrival: Instant::now(),
        reply: Ok(tx),
    };
    if ctx.handle.jobs.send(job).is_err() {
        return Json(PrefillReply::Error(crate::wire::WireError {
            kind: "unavailable".into(),
            message: "the model thread has stopped".into(),
            param: None,
            retry_after_s: None,
        }));
    }
    // Dropping this future (the proxy left) closes `rx`: the model thread
    // then drops the prefill.
    Json(rx.await.unwrap_or_else(|_| {
        PrefillReply::Error(crate::wire::WireError {
            kind: "internal".into(),
            message: "the prefill ended without an answer".into(),
            param: None,
            retry_after_s: None,
        })
    }))
}

/// A prefill streamed while it runs: the handle at once (before the
/// prefill starts), the K/V to the decode worker that pulls it, layer by
/// layer as the forward pass writes it.
async fn prefill_stream(
    State(ctx): State<Ctx>,
    Json(prep): Json<WirePrepared>,
) -> Json<PrefillReply> {
    let Some(server) = &ctx.server else {
        return Json(PrefillReply::Error(crate::wire::WireError {
            kind: "invalid_request".into(),
            message: "this worker holds no K/V for transfers (a decode worker)".into(),
            param: None,
            retry_after_s: None,
        }));
    };
    let tokens = prep.prompt.len();
    if tokens == 0 || tokens > ctx.capacity {
        // Checked before the transfer's buffer is allocated.
        return Json(PrefillReply::Error(crate::wire::WireError {
            kind: "invalid_request".into(),
            message: format!(
                "a prompt of {tokens} tokens: this worker streams 1 to {} positions",
                ctx.capacity
            ),
            param: Some("prompt".into()),
            retry_after_s: None,
        }));
    }
    let hash = crate::protocol::prompt_hash(&prep.prompt);
    let (transfer_id, live) = server.open_live(tokens, hash);
    let handle = crate::wire::TransferHandle {
        kv_addr: server.addr.clone(),
        transfer_id,
        prompt_hash: hash,
        tokens,
        lease_ms: server.lease.as_millis() as u64,
    };
    let job = Job::Prefill {
        prep,
        arrival: Instant::now(),
        reply: Err(live.clone()),
    };
    if ctx.handle.jobs.send(job).is_err() {
        live.fail("the model thread has stopped".into());
        return Json(PrefillReply::Error(crate::wire::WireError {
            kind: "unavailable".into(),
            message: "the model thread has stopped".into(),
            param: None,
            retry_after_s: None,
        }));
    }
    Json(PrefillReply::Started { handle })
}

#[derive(serde::Deserialize)]
struct Cancel {
    transfer_id: u64,
}

/// Free a transfer whose client left (a decode worker's `/cancel` holds
/// none: false).
async fn cancel(State(ctx): State<Ctx>, Json(c): Json<Cancel>) -> Json<serde_json::Value> {
    let cancelled = ctx.server.as_ref().is_some_and(|s| s.cancel(c.transfer_id));
    Json(json!({ "cancelled": cancelled }))
}

async fn decode(
    State(ctx): State<Ctx>,
    Json(order): Json<DecodeOrder>,
) -> axum::response::Response {
    let (tx, rx) = mpsc::unbounded_channel::<WireEvent>();
    let jobs = ctx.handle.jobs.clone();
    // The pull blocks on a socket: a thread of its own, never the model's.
    let spawned = std::thread::Builder::new()
        .name("kv-pull".into())
        .spawn(move || pull_then_submit(&ctx, order, tx, &jobs));
    if let Err(e) = spawned {
        return axum::response::IntoResponse::into_response((
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            e.to_string(),
        ));
    }
    let lines = tokio_stream_lines(rx);
    axum::response::Response::builder()
        .header("content-type", "application/x-ndjson")
        .body(Body::from_stream(lines))
        .unwrap_or_default()
}

/// How often a decode stream with nothing to say says so.
const KEEPALIVE: Duration = Duration::from_secs(1);

fn tokio_stream_lines(
    rx: mpsc::UnboundedReceiver<WireEvent>,
) -> impl futures_util::Stream<Item = Result<Vec<u8>, std::io::Error>> {
    futures_util::stream::unfold(rx, |mut rx| async move {
        // A blank line every second while nothing happens (a streamed
        // prefill still queued on the prefill worker): the proxy's deadline
        // on this stream is for a silent worker, not a slow prompt.
        let line = match tokio::time::timeout(KEEPALIVE, rx.recv()).await {
            Ok(ev) => {
                let mut line = serde_json::to_vec(&ev?).unwrap_or_default();
                line.push(b'\n');
                line
            }
            Err(_) => b"\n".to_vec(),
        };
        Some((Ok(line), rx))
    })
    .boxed()
}

async fn stats(State(ctx): State<Ctx>) -> Json<serde_json::Value> {
    let l = &ctx.handle.load;
    let mut v = json!({
        "running": l.running.load(Ordering::SeqCst),
        "waiting": l.waiting.load(Ordering::SeqCst),
        "reserved": l.reserved.load(Ordering::SeqCst),
        "kv_used_blocks": l.kv_used_blocks.load(Ordering::SeqCst),
        "kv_total_blocks": l.kv_total_blocks.load(Ordering::SeqCst),
        "imported": l.imported.load(Ordering::SeqCst),
        "imported_in_blocks": l.imported_in_blocks.load(Ordering::SeqCst),
        "recomputed": l.recomputed.load(Ordering::SeqCst),
        "prefilled": l.prefilled.load(Ordering::SeqCst),
    });
    if let Some(s) = &ctx.server {
        let st = &s.stats;
        v["transfers_held"] = json!(st.held.load(Ordering::SeqCst));
        v["transfer_bytes_held"] = json!(st.held_bytes.load(Ordering::SeqCst));
        v["transfer_bytes_sent"] = json!(st.sent_bytes.load(Ordering::SeqCst));
        v["transfers_acked"] = json!(st.acked.load(Ordering::SeqCst));
        v["transfers_expired"] = json!(st.expired.load(Ordering::SeqCst));
        v["transfers_cancelled"] = json!(st.cancelled.load(Ordering::SeqCst));
        v["transfers_refused"] = json!(st.refused.load(Ordering::SeqCst));
        v["kv_connections"] = json!(st.connections.load(Ordering::SeqCst));
        v["kv_connections_turned_away"] = json!(st.turned_away.load(Ordering::SeqCst));
    }
    Json(v)
}

/// Pin this process (its threads started after this) to one CPU.
pub fn pin_to(cpu: usize) -> anyhow::Result<()> {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes inside
    // it; sched_setaffinity reads it for this process (pid 0).
    let r = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if r != 0 {
        anyhow::bail!("pinning to CPU {cpu}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quiet_decode_stream_says_it_lives_then_carries_its_events() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (tx, rx) = mpsc::unbounded_channel();
            let mut lines = tokio_stream_lines(rx);
            let t0 = Instant::now();
            let first = lines.next().await.unwrap().unwrap();
            assert_eq!(first, b"\n", "a keepalive while nothing happens");
            assert!(t0.elapsed() >= KEEPALIVE);
            tx.send(WireEvent::Done {
                finish: "stop".into(),
                prompt_tokens: 1,
                completion_tokens: 2,
            })
            .unwrap();
            let ev = lines.next().await.unwrap().unwrap();
            let ev: WireEvent = serde_json::from_slice(&ev).unwrap();
            assert!(matches!(
                ev,
                WireEvent::Done {
                    completion_tokens: 2,
                    ..
                }
            ));
            drop(tx);
            assert!(lines.next().await.is_none(), "ends with its events");
        });
    }
}
