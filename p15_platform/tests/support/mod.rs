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
        Platform::with_etcd(1)
    }

    /// A platform whose etcd has `members` members.
    pub fn with_etcd(members: usize) -> Platform {
        let mut local = Local::start(EXE.as_ref(), members, false).expect("etcd");
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

/// A GET with a deadline (2 s): a server that accepts and never answers
/// fails the wait's own bound instead of hanging it.
pub async fn short_get(url: &str) -> reqwest::Result<reqwest::Response> {
    reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(2))
        .send()
        .await
}

/// The base URLs published for `deployment`'s ready servers.
pub fn ready_urls(s: &Snapshot, deployment: &str) -> Vec<String> {
    s.endpoints.get(deployment).map_or(Vec::new(), |v| {
        v.iter()
            .map(|(_, u)| u.trim_end_matches('/').to_string())
            .collect()
    })
}

/// Wait until the router at `router` routes `deployment` to exactly the
/// endpoints published in `s`, all healthy (from its `/metrics`); routers
/// read the endpoints every 200 ms, later on a loaded machine.
pub fn router_sees(p: &Platform, router: &str, deployment: &str, s: &Snapshot) {
    let mut want = ready_urls(s, deployment);
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
        "model": model, "prompt": PROMPT,
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

/// What [`load`] asks: one prompt, greedy; 32 tokens streamed (so that a
/// kill finds some mid-way), 8 whole.
pub const PROMPT: &str = "The capital of France is";
pub fn load_tokens(stream: bool) -> u32 {
    if stream {
        32
    } else {
        8
    }
}

/// The single-process server's answers to [`load`]'s two requests, one
/// pair per weight format a test's deployment runs: every answer through
/// the platform must be one of them.
#[derive(Clone, Debug)]
pub struct Answers(Vec<(u32, String)>);

impl Answers {
    fn check(&self, max_tokens: u32, text: &str) -> Result<(), String> {
        let want: Vec<&String> = self
            .0
            .iter()
            .filter(|a| a.0 == max_tokens)
            .map(|a| &a.1)
            .collect();
        match want.iter().any(|w| *w == text) {
            true => Ok(()),
            false => Err(format!(
                "answered {text:?}; the single-process server answers {want:?}"
            )),
        }
    }
}

#[derive(clap::Parser)]
struct ReferenceCli {
    #[command(flatten)]
    serve: p10_quant::serve::ServeArgs,
}

/// `p10_quant serve --weights W` in this process, one per format in
/// `weights` (the README's server), asked [`load`]'s requests once each.
pub fn answers(p: &Platform, weights: &[&str]) -> Arc<Answers> {
    use clap::Parser;
    let mut out = Vec::new();
    for w in weights {
        let port = p14_distributed::cluster::free_port("127.0.0.1")
            .unwrap()
            .to_string();
        let cli = ReferenceCli::parse_from([
            "reference",
            "--port",
            &port,
            "--weights",
            w,
            "--served-model-name",
            "reference",
        ]);
        let server = p.rt.spawn(p10_quant::serve::serve(cli.serve));
        let url = format!("http://127.0.0.1:{port}");
        let t0 = Instant::now();
        loop {
            let up = p.rt.block_on(async {
                let r = short_get(&format!("{url}/health")).await;
                r.is_ok_and(|r| r.status().is_success())
            });
            if up {
                break;
            }
            assert!(!server.is_finished(), "the reference server ({w}) stopped");
            assert!(
                t0.elapsed() < Duration::from_secs(300),
                "the reference server ({w}) was not ready in 300 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        for stream in [false, true] {
            let n = load_tokens(stream);
            let (code, body, _) = complete(&p.rt, &url, "reference", n);
            assert_eq!(code, 200, "the reference server: {body}");
            out.push((n, completion_text(&body).expect("a completion")));
        }
        server.abort();
    }
    Arc::new(Answers(out))
}

/// `choices[0].text` of a completion's body.
pub fn completion_text(body: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    Some(v.pointer("/choices/0/text")?.as_str()?.to_string())
}

/// Requests in a loop through the router until stopped, streamed or not
/// ([`load_tokens`]), each answer checked against `want`; (ok, failed:
/// what went wrong).
pub fn load(
    p: &Arc<Platform>,
    url: String,
    model: &'static str,
    stop: Arc<AtomicBool>,
    stream: bool,
    want: &Arc<Answers>,
) -> std::thread::JoinHandle<(u32, Vec<String>)> {
    let want = want.clone();
    let p = p.clone();
    std::thread::spawn(move || {
        let mut ok = 0;
        let mut failed = Vec::new();
        let t0 = Instant::now();
        let http = reqwest::Client::new();
        while !stop.load(Ordering::Relaxed) {
            let n = load_tokens(stream);
            let outcome = if stream {
                let r = p.rt.block_on(p15_platform::clients::one(
                    &http, &url, model, KEY, PROMPT, n, t0,
                ));
                match (r.ok, r.cut) {
                    (true, _) => want.check(n, &r.text),
                    (false, true) => Err(format!("a stream cut: {}", r.error)),
                    (false, false) => Err(r.error),
                }
            } else {
                match complete(&p.rt, &url, model, n) {
                    (200, body, _) => match completion_text(&body) {
                        Some(t) => want.check(n, &t),
                        None => Err(format!("200 without a text: {body}")),
                    },
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

/// Every ready server of `deployment` holds nothing (no sequence running
/// or waiting, no K/V block held by a sequence) within `within`, or the
/// test fails naming what is still held.
pub fn nothing_held(p: &Platform, deployment: &str, within: Duration) {
    let urls = ready_urls(&p.snapshot(), deployment);
    assert!(!urls.is_empty(), "no ready server of {deployment}");
    let t0 = Instant::now();
    loop {
        let held: Vec<String> = urls
            .iter()
            .flat_map(|u| {
                let page = p.rt.block_on(async {
                    let r = short_get(&format!("{u}/metrics")).await.ok()?;
                    r.text().await.ok()
                });
                let Some(page) = page else {
                    return vec![format!("{u}: no /metrics")];
                };
                let r = p12_gateway::score::parse_report(&page, Instant::now());
                [
                    ("running", r.running),
                    ("waiting", r.waiting),
                    ("kv usage", r.kv_usage),
                ]
                .into_iter()
                .filter(|(_, v)| *v != 0.0)
                .map(|(m, v)| format!("{u} {m} {v}"))
                .collect()
            })
            .collect();
        if held.is_empty() {
            return;
        }
        assert!(
            t0.elapsed() < within,
            "held {:?} after the load: {held:?}",
            t0.elapsed()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
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
