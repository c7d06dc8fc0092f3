//! A cluster for the tests: etcd and NATS as children (the test fails
//! with the install command when they are missing), workers as child
//! processes of this crate's binary, the proxy in this process (it is an
//! `Engine`, so its events compare directly with a co-located engine's).

#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::engine::{Engine, EngineEvent, EngineRequest, PromptInput, SamplingParams};
use p08_continuous::ContinuousEngine;
use p10_quant::Weights;
use p14_distributed::cluster::{self, EtcdCluster, Nats, Proc};
use p14_distributed::proxy::Proxy;
use p14_distributed::registry::{Role, View};
use p14_distributed::wire::LoadFailurePolicy;
use serde_json::Value;

pub const PROMPTS: [&str; 4] = [
    "What is the capital of France?",
    "Write a haiku about the sea in winter.",
    "The old lighthouse keeper opened his log and wrote:",
    "Once upon a time, in a village at the edge of a great forest, there lived a miller who",
];

pub struct Worker {
    pub proc: Proc,
    pub url: String,
    pub role: Role,
}

pub struct Rig {
    /// One cluster at a time per test binary: timing-based checks (leases,
    /// stale reports) are not starved by another test's workers.
    _serial: std::sync::MutexGuard<'static, ()>,
    pub etcd: EtcdCluster,
    pub nats: Option<Nats>,
    pub workers: Vec<Worker>,
    pub rt: tokio::runtime::Runtime,
    pub proxy: Arc<Proxy>,
    pub view: Arc<View>,
    pub http: reqwest::Client,
}

pub fn model_path() -> std::path::PathBuf {
    p06_server::load::resolve_model("smollm2")
        .expect("the SmolLM2 model: run `bash scripts/fetch_assets.sh smollm2`")
}

/// Worker arguments every test uses, then `extra`.
pub fn worker_args(
    weights: &str,
    etcd: &str,
    nats: Option<&str>,
    id: &str,
    extra: &[&str],
) -> Vec<String> {
    let mut a: Vec<String> = [
        "--model",
        "smollm2",
        "--weights",
        weights,
        "--etcd",
        etcd,
        "--id",
        id,
        "--kv-cache-mib",
        "48",
        "--lease-ttl-s",
        "2",
        "--transfer-lease-ms",
        "5000",
        "--pull-timeout-s",
        "5",
    ]
    .chunks(2)
    // A flag given in `extra` replaces its default here.
    .filter(|kv| !extra.contains(&kv[0]))
    .flatten()
    .map(|s| s.to_string())
    .collect();
    if let Some(n) = nats {
        a.extend(["--nats".to_string(), n.to_string()]);
    }
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

pub fn start_worker(role: Role, args: &[String]) -> Worker {
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_p14_distributed"));
    let (proc, url) = cluster::start_worker(exe, role.as_str(), args).expect("starting a worker");
    Worker { proc, url, role }
}

/// etcd (`members` of them), NATS, the workers (`prefill` and `decode`:
/// extra arguments of each), and the proxy.
pub fn rig(
    weights: &str,
    members: usize,
    prefill: &[&[&str]],
    decode: &[&[&str]],
    policy: LoadFailurePolicy,
) -> Rig {
    rig_with(weights, members, prefill, decode, policy, false)
}

/// [`rig`], its proxy streaming K/V layer by layer or not.
pub fn rig_with(
    weights: &str,
    members: usize,
    prefill: &[&[&str]],
    decode: &[&[&str]],
    policy: LoadFailurePolicy,
    layerwise: bool,
) -> Rig {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let etcd = EtcdCluster::start(members, "127.0.0.1")
        .expect("etcd (install it: apt-get install -y etcd-server)");
    let nats = Nats::start("127.0.0.1").expect("NATS (install it: apt-get install -y nats-server)");
    let urls = etcd.urls.join(",");
    let mut workers = Vec::new();
    for (role, list) in [(Role::Prefill, prefill), (Role::Decode, decode)] {
        for (i, extra) in list.iter().enumerate() {
            let id = format!("{}-{i}", role.as_str());
            let args = worker_args(weights, &urls, Some(&nats.url), &id, extra);
            workers.push(start_worker(role, &args));
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (proxy, view) = p14_distributed::proxy_serve::in_process(
        "smollm2",
        p06_server::load::served_name("smollm2"),
        (etcd.urls.clone(), None),
        Some(nats.url.clone()),
        policy,
        rt.handle(),
    )
    .unwrap();
    let proxy = Arc::new(proxy.layerwise(layerwise));
    let rig = Rig {
        _serial: serial,
        etcd,
        nats: Some(nats),
        workers,
        rt,
        proxy,
        view,
        http: reqwest::Client::new(),
    };
    rig.wait_view(prefill.len(), decode.len(), Duration::from_secs(30));
    rig
}

impl Rig {
    /// Until the proxy sees exactly this many workers of each role.
    pub fn wait_view(&self, prefill: usize, decode: usize, timeout: Duration) {
        let t0 = Instant::now();
        loop {
            let (p, d) = (
                self.view.workers(Role::Prefill).len(),
                self.view.workers(Role::Decode).len(),
            );
            if (p, d) == (prefill, decode) {
                return;
            }
            assert!(
                t0.elapsed() < timeout,
                "the proxy sees {p} prefill and {d} decode workers after {timeout:?}; want {prefill} and {decode}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn stats(&self, w: &Worker) -> Value {
        let url = format!("{}/stats", w.url);
        let http = self.http.clone();
        self.rt.block_on(async move {
            http.get(url)
                .timeout(Duration::from_secs(5))
                .send()
                .await
                .expect("worker stats")
                .json::<Value>()
                .await
                .expect("worker stats JSON")
        })
    }

    pub fn run(&self, req: EngineRequest) -> Vec<EngineEvent> {
        collect(&*self.proxy, req)
    }
}

/// Until the worker's stat `key` reads `want` (counters settle after the
/// last event: an ack is read after the stream ended).
/// Nothing is held on any live worker: no sequence running or waiting,
/// no reservation, no K/V block in use, no transfer or its bytes.
pub fn nothing_held(rig: &Rig) {
    for w in &rig.workers {
        let key = match w.role {
            Role::Prefill => "transfers_held",
            Role::Decode => "running",
        };
        let s = wait_stat(rig, w, key, 0);
        let s = match s["kv_used_blocks"].as_u64() {
            Some(0) => s,
            _ => wait_stat(rig, w, "kv_used_blocks", 0),
        };
        let mut keys = vec!["running", "waiting", "reserved", "kv_used_blocks"];
        if w.role == Role::Prefill {
            keys.extend(["transfers_held", "transfer_bytes_held"]);
        }
        for k in keys {
            assert_eq!(s[k], 0, "{} {} holds {k}: {s}", w.role.as_str(), w.url);
        }
    }
}

pub fn wait_stat(rig: &Rig, w: &Worker, key: &str, want: u64) -> Value {
    let t0 = Instant::now();
    loop {
        let s = rig.stats(w);
        if s[key].as_u64() == Some(want) || t0.elapsed() > Duration::from_secs(10) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn request(i: usize, text: &str, max_tokens: usize) -> EngineRequest {
    let mut r = EngineRequest::new(format!("cmpl-test-{i}"), PromptInput::Text(text.into()));
    r.max_tokens = Some(max_tokens);
    r.sampling = SamplingParams::greedy();
    r.ignore_eos = true;
    r.logprobs = Some(3);
    r
}

/// Every event of one request, to its end.
pub fn collect(engine: &dyn Engine, req: EngineRequest) -> Vec<EngineEvent> {
    drain(engine.submit(req).expect("submitted"))
}

/// Every event of a stream, to its end.
pub fn drain(mut rx: common::engine::EngineStream) -> Vec<EngineEvent> {
    let mut out = Vec::new();
    let t0 = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(ev) => {
                let end = !matches!(ev, EngineEvent::Token(_));
                out.push(ev);
                if end {
                    return out;
                }
            }
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {
                assert!(
                    t0.elapsed() < Duration::from_secs(120),
                    "no end after 120 s: {out:?}"
                );
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => panic!("the stream closed without an end ({e}): {out:?}"),
        }
    }
}

/// The co-located engine: the same weights and paged K/V in one process.
pub fn colocated(weights: &str) -> ContinuousEngine {
    let w = match weights {
        "native" => Weights::Native,
        _ => Weights::F32,
    };
    p14_distributed::worker_serve::colocated(&model_path(), w, 48 << 20).unwrap()
}

/// Tokens of a run, in order.
pub fn tokens(events: &[EngineEvent]) -> usize {
    events
        .iter()
        .filter(|e| matches!(e, EngineEvent::Token(_)))
        .count()
}

/// 2 · n_layer · n_kv_head · head_dim · T · 4 bytes (f32), the model's
/// sizes read from its file.
pub fn kv_bytes(positions: usize) -> u64 {
    let f = p04_transformer::model_file::GgufFile::open(model_path()).unwrap();
    let h = &f.header;
    let u = |k: &str| h.get_u64(k).unwrap();
    let head_dim = u("llama.embedding_length") / u("llama.attention.head_count");
    2 * u("llama.block_count")
        * u("llama.attention.head_count_kv")
        * head_dim
        * 4
        * positions as u64
}

/// The prompt tokens a run's `Done` reports.
pub fn prompt_tokens(events: &[EngineEvent]) -> usize {
    match events.last() {
        Some(EngineEvent::Done { prompt_tokens, .. }) => *prompt_tokens,
        e => panic!("the run did not end with Done: {e:?}"),
    }
}
