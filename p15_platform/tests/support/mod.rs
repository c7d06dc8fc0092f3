//! A platform on loopback for the tests: a real etcd (a child process
//! with a temporary data directory; `apt-get install -y etcd-server` if it
//! is missing), node agents, controllers and a router as child processes
//! of this crate's binary, and the model servers the agents start
//! (SmolLM2, fetched by `bash scripts/fetch_assets.sh smollm2` on first
//! use).

#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use p14_distributed::etcd::Etcd;
use p15_platform::local::Local;
use p15_platform::spec::ModelDeployment;
use p15_platform::state::Snapshot;

pub const EXE: &str = env!("CARGO_BIN_EXE_p15_platform");
pub const KEY: &str = "sk-platform-test";

/// The platform's processes and a runtime to talk to them from tests.
pub struct Platform {
    pub local: Local,
    pub rt: tokio::runtime::Runtime,
}

/// A deployment of SmolLM2 named `name` (a YAML fragment overrides the
/// defaults line by line: `replicas: {min: 0, max: 1}`).
pub fn deployment(name: &str, extra: &str) -> ModelDeployment {
    let mut fields = vec![
        ("name", name.to_string()),
        ("model", "smollm2".into()),
        ("weights", "native".into()),
        ("replicas", "{min: 1, max: 1}".into()),
        ("autoscaling", "{metric: concurrency, target: 4, stable_window: 6s, panic_window: 2s, scale_to_zero_grace: 0s}".into()),
        ("rollout", "{max_surge: 1, max_unavailable: 0}".into()),
    ];
    for line in extra.lines().filter(|l| !l.trim().is_empty()) {
        let (k, v) = line.split_once(':').expect("key: value");
        let k = k.trim();
        match fields.iter_mut().find(|(f, _)| *f == k) {
            Some(f) => f.1 = v.trim().to_string(),
            None => fields.push((
                Box::leak(k.to_string().into_boxed_str()),
                v.trim().to_string(),
            )),
        }
    }
    let yaml: String = fields.iter().map(|(k, v)| format!("{k}: {v}\n")).collect();
    ModelDeployment::from_yaml(&yaml, "test").expect("a valid test deployment")
}

impl Platform {
    pub fn start() -> Platform {
        let mut local = Local::start(EXE.as_ref(), 1, false).expect("etcd");
        local.quiet = false; // a failing test shows its processes' errors
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        Platform { local, rt }
    }

    pub fn agent(&mut self, node: &str, capacity: u32) {
        self.local.agent(node, capacity).unwrap();
    }

    pub fn controller(&mut self, id: &str) {
        self.local.controller(id).unwrap();
    }

    /// The router in front of `models`, holding requests `hold_ms` for a
    /// first backend; its base URL.
    pub fn router(&mut self, models: &[&str], hold_ms: u64) -> String {
        self.local.router(models, KEY, hold_ms).unwrap()
    }

    pub fn etcd_client(&self) -> Etcd {
        self.local.etcd_client()
    }

    pub fn apply(&self, d: &ModelDeployment) {
        self.rt.block_on(self.local.apply(d)).unwrap();
    }

    pub fn snapshot(&self) -> Snapshot {
        self.rt.block_on(self.local.snapshot()).unwrap()
    }

    /// Poll the state until `ok` holds; the snapshot that made it hold.
    pub fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        ok: impl Fn(&Snapshot) -> bool,
    ) -> Snapshot {
        match self.rt.block_on(self.local.wait_for(what, timeout, ok)) {
            Ok(s) => s,
            Err(e) => panic!("{e:#}"),
        }
    }

    /// Send `sig` to a process of the platform by id (agent or controller).
    pub fn signal(&self, id: &str, sig: i32) {
        let l = &self.local;
        let m = l.agents.iter().chain(&l.controllers).find(|m| m.id == id);
        m.unwrap_or_else(|| panic!("no process {id}"))
            .proc
            .signal(sig);
    }
}

/// The servers of `deployment` that the controller has published as
/// endpoints (what routers route to), in a snapshot.
pub fn ready(s: &Snapshot, deployment: &str) -> Vec<String> {
    s.endpoints
        .get(deployment)
        .map(|v| v.iter().map(|(id, _)| id.clone()).collect())
        .unwrap_or_default()
}

/// Wait until the router at `router` routes `deployment` to exactly the
/// endpoints published in `s`, all healthy (from its `/metrics`); routers
/// read the endpoints every 200 ms, later on a loaded machine.
pub fn router_sees(p: &Platform, router: &str, deployment: &str, s: &Snapshot) {
    let mut want: Vec<String> = s.endpoints.get(deployment).map_or(Vec::new(), |v| {
        v.iter()
            .map(|(_, u)| u.trim_end_matches('/').to_string())
            .collect()
    });
    want.sort();
    let prefix = format!("gateway_backend_healthy{{model=\"{deployment}\",backend=\"");
    let http = reqwest::Client::new();
    let t0 = std::time::Instant::now();
    let mut seen = Vec::new();
    while t0.elapsed() < Duration::from_secs(20) {
        let page = p.rt.block_on(async {
            let r = http
                .get(format!("{router}/metrics"))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .ok()?;
            r.text().await.ok()
        });
        if let Some(page) = page {
            seen = page
                .lines()
                .filter_map(|l| l.strip_prefix(&prefix))
                .filter_map(|l| l.strip_suffix("\"} 1"))
                .map(str::to_string)
                .collect();
            seen.sort();
            if seen == want {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the router never routed {deployment} to {want:?}; it had {seen:?}");
}

/// One completion through `url` (a fresh client: no connection reuse
/// across a server's restart); (HTTP status, body, Retry-After).
pub fn complete(
    rt: &tokio::runtime::Runtime,
    url: &str,
    model: &str,
    max_tokens: u32,
) -> (u16, String, Option<String>) {
    let body = serde_json::json!({
        "model": model, "prompt": "The capital of France is",
        "max_tokens": max_tokens, "temperature": 0.0,
    });
    rt.block_on(async {
        let r = reqwest::Client::new()
            .post(format!("{url}/v1/completions"))
            .bearer_auth(KEY)
            .json(&body)
            .timeout(Duration::from_secs(120))
            .send()
            .await;
        match r {
            Ok(r) => {
                let status = r.status().as_u16();
                let retry = r
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string);
                (status, r.text().await.unwrap_or_default(), retry)
            }
            Err(e) => (0, e.to_string(), None),
        }
    })
}

/// Requests in a loop through the router until stopped, streamed (32
/// tokens each, so that a kill finds some mid-way) or not; (ok, failed:
/// what went wrong).
pub fn load(
    p: &Arc<Platform>,
    url: String,
    model: &'static str,
    stop: Arc<AtomicBool>,
    stream: bool,
) -> std::thread::JoinHandle<(u32, Vec<String>)> {
    let p = p.clone();
    std::thread::spawn(move || {
        let mut ok = 0;
        let mut failed = Vec::new();
        let t0 = Instant::now();
        let http = reqwest::Client::new();
        while !stop.load(Ordering::Relaxed) {
            let outcome = if stream {
                let prompt = "The capital of France is";
                let r = p.rt.block_on(p15_platform::clients::one(
                    &http, &url, model, KEY, prompt, 32, t0,
                ));
                match (r.ok, r.cut) {
                    (true, _) => Ok(()),
                    (false, true) => Err(format!("a stream cut: {}", r.error)),
                    (false, false) => Err(r.error),
                }
            } else {
                match complete(&p.rt, &url, model, 8) {
                    (200, _, _) => Ok(()),
                    (code, body, _) => Err(format!("{code} {body}")),
                }
            };
            match outcome {
                Ok(()) => ok += 1,
                Err(e) => {
                    failed.push(format!("at {:?}: {e}", t0.elapsed()));
                    if failed.len() >= 5 {
                        break; // enough to show what failed
                    }
                }
            }
        }
        (ok, failed)
    })
}

/// Stop the load threads; every request must have been answered.
pub fn finish(loads: Vec<std::thread::JoinHandle<(u32, Vec<String>)>>, stop: &AtomicBool) {
    stop.store(true, Ordering::Relaxed);
    let mut ok = 0;
    let mut failed = Vec::new();
    for l in loads {
        let (o, f) = l.join().unwrap();
        ok += o;
        failed.extend(f);
    }
    eprintln!("{ok} requests answered, {} failed", failed.len());
    assert!(ok > 4, "only {ok} requests completed");
    assert!(
        failed.is_empty(),
        "{} of {} requests failed: {:?}",
        failed.len(),
        ok as usize + failed.len(),
        failed
    );
}
