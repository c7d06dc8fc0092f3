//! One answer on every path: the same 8 greedy prompts, sent at once,
//! through every way this workspace serves SmolLM2, against the
//! single-process server (`p10_quant serve`, native weights; its f32
//! weights for the f32 path). Every text must be equal, token for token:
//!
//! ```text
//! reference                      p10_quant serve              (and --weights f32)
//! tensor parallel, native        p13_multi_gpu serve --tp 3
//! tensor parallel, f32           p13_multi_gpu serve --tp 3 --weights f32
//! pipeline parallel              p13_multi_gpu serve --pp 3
//! prefill/decode                 p14_distributed up --prefill 1 --decode 1
//!                                p14_distributed up --prefill 2 --decode 2
//! the platform, behind its router  a co-located and a split deployment
//! the gateway                    Project 12 before two servers, one SIGKILLed
//!                                while every stream is under way
//! ```
//!
//! The other projects' servers are their own binaries, next to this test
//! in the target directory: `cargo test --workspace` builds them (run just
//! this file with `cargo build --profile test --bins --workspace && cargo
//! test --workspace --test cross_path`). Needs etcd and NATS
//! (`apt-get install -y etcd-server nats-server`) and SmolLM2
//! (`bash scripts/fetch_assets.sh smollm2`).

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use p14_distributed::cluster::{free_port, spawn, Proc};
use support::{ready, router_sees, Platform, KEY};

/// Held out from every other test's prompts.
const PROMPTS: [&str; 8] = [
    "The three primary colours are",
    "def fibonacci(n):",
    "A haiku about the sea:\n",
    "Water boils at a temperature of",
    "The best way to learn a new language is",
    "Translate to French: good morning, my friend.",
    "Once upon a time, in a small village,",
    "List three uses of a paperclip:\n1.",
];
const MAX_TOKENS: u32 = 40;
const NAME: &str = "SmolLM2-135M-Instruct";
const MIN: Duration = Duration::from_secs(60);

/// Another package's binary, beside this test's in the target directory.
fn sibling(bin: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("this test's path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps");
    let p = dir.join(bin);
    assert!(
        p.is_file(),
        "{} is not built: run `cargo build --profile test --bins --workspace` \
         (`cargo test --workspace` builds it)",
        p.display()
    );
    p
}

/// A server process and its base URL.
struct Server {
    proc: Proc,
    url: String,
}

/// Start `bin args` with `--port P` on a free port and wait (up to five
/// minutes) for its `/health` to answer 200.
fn start(bin: &str, args: &[&str]) -> Server {
    let port = free_port("127.0.0.1").unwrap();
    let mut cmd = Command::new(sibling(bin));
    cmd.args(args).args(["--port", &port.to_string()]);
    let mut proc = spawn(bin, cmd, None).unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let t0 = Instant::now();
    let rt = runtime();
    loop {
        let health = reqwest::Client::new()
            .get(format!("{url}/health"))
            .timeout(Duration::from_secs(2));
        let ok = rt
            .block_on(async { health.send().await })
            .is_ok_and(|r| r.status().is_success());
        if ok {
            return Server { proc, url };
        }
        if let Ok(Some(status)) = proc.child.try_wait() {
            panic!("{bin} {args:?} exited ({status}) before it was healthy");
        }
        assert!(
            t0.elapsed() < 5 * MIN,
            "{bin} {args:?} not healthy within 5 minutes"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn body(model: &str, prompt: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
        "temperature": 0.0, "stream": stream,
    })
}

/// The 8 prompts sent at once to `url` as `model`; their texts in order.
fn answers(url: &str, model: &str) -> Vec<String> {
    runtime().block_on(async {
        let http = reqwest::Client::new();
        let asks = PROMPTS.iter().map(|p| {
            let req = http
                .post(format!("{url}/v1/completions"))
                .bearer_auth(KEY)
                .json(&body(model, p, false))
                .timeout(3 * MIN);
            async move {
                let r = req.send().await.unwrap_or_else(|e| panic!("{url}: {e}"));
                let status = r.status();
                let text = r.text().await.unwrap_or_default();
                assert!(status.is_success(), "{url} {model}: {status} {text}");
                let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                v["choices"][0]["text"]
                    .as_str()
                    .unwrap_or_else(|| panic!("no text: {text}"))
                    .to_string()
            }
        });
        futures_util::future::join_all(asks).await
    })
}

/// The single-process server's answers, native or f32 (computed once).
fn reference(f32: bool) -> &'static [String] {
    static NATIVE: OnceLock<Vec<String>> = OnceLock::new();
    static F32: OnceLock<Vec<String>> = OnceLock::new();
    let cell = if f32 { &F32 } else { &NATIVE };
    cell.get_or_init(|| {
        let weights = if f32 { "f32" } else { "native" };
        let s = start(
            "p10_quant",
            &["serve", "--model", "smollm2", "--weights", weights],
        );
        let texts = answers(&s.url, NAME);
        assert!(
            texts.iter().all(|t| !t.is_empty()),
            "an empty reference: {texts:?}"
        );
        texts
    })
}

fn assert_same(path: &str, got: &[String], want: &[String]) {
    let differ: Vec<usize> = (0..want.len()).filter(|&i| got[i] != want[i]).collect();
    for &i in &differ {
        eprintln!(
            "{path}, prompt {i}:\n  got  {:?}\n  want {:?}",
            got[i], want[i]
        );
    }
    assert!(
        differ.is_empty(),
        "{path}: {} of {} texts differ from the single-process server's",
        differ.len(),
        want.len()
    );
    eprintln!("{path}: {} of {} texts equal", want.len(), want.len());
}

#[test]
fn tensor_and_pipeline_parallel_servers_answer_as_the_single_server() {
    for (path, args, f32) in [
        ("TP = 3, native", &["--tp", "3"][..], false),
        ("TP = 3, f32", &["--tp", "3", "--weights", "f32"][..], true),
        ("PP = 3, native", &["--pp", "3"][..], false),
    ] {
        let want = reference(f32);
        let mut all = vec!["serve", "--model", "smollm2"];
        all.extend_from_slice(args);
        let s = start("p13_multi_gpu", &all);
        assert_same(path, &answers(&s.url, NAME), want);
    }
}

#[test]
fn prefill_decode_clusters_answer_as_the_single_server() {
    let want = reference(false);
    for (p, d) in [("1", "1"), ("2", "2")] {
        let s = start(
            "p14_distributed",
            &[
                "up",
                "--prefill",
                p,
                "--decode",
                d,
                "--kv-cache-mib",
                "64",
                "--worker-wait-s",
                "120",
            ],
        );
        assert_same(&format!("up {p}P{d}D"), &answers(&s.url, NAME), want);
    }
}

#[test]
fn colocated_and_split_deployments_behind_the_router_answer_as_the_single_server() {
    let want = reference(false);
    let mut p = Platform::start();
    p.agent("n1", 2);
    p.agent("n2", 2);
    p.controller("c1");
    let url = p.router(&["co", "pd"], 60_000);
    p.apply(&support::deployment("co", ""));
    p.apply(&support::deployment("pd", "roles: {prefill: 1, decode: 1}"));
    let s = p.wait_for("both deployments ready", 3 * MIN, |s| {
        ready(s, "co").len() == 1 && ready(s, "pd").len() == 1
    });
    router_sees(&p, &url, "co", &s);
    router_sees(&p, &url, "pd", &s);
    assert_same("platform, co-located", &answers(&url, "co"), want);
    assert_same("platform, prefill/decode", &answers(&url, "pd"), want);
}

/// The text of a completion stream's events.
fn stream_text(bytes: &[u8]) -> (String, bool) {
    let text = String::from_utf8_lossy(bytes);
    let mut out = String::new();
    let mut done = false;
    for data in text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}"));
        assert!(v.get("error").is_none(), "an error event: {data}");
        out += v
            .pointer("/choices/0/text")
            .and_then(|t| t.as_str())
            .unwrap_or("");
    }
    (out, done)
}

#[test]
fn the_gateway_continues_streams_whose_server_is_killed_with_the_single_servers_text() {
    let want = reference(false);
    let args = ["serve", "--model", "smollm2"];
    let (a, b) = (start("p10_quant", &args), start("p10_quant", &args));
    let rt = runtime();
    let (url, g) = rt.block_on(async {
        let text = format!(
            "[health]\ninterval_ms = 500\n[[tenants]]\nname = \"t\"\nmodels = [\"{NAME}\"]\n\
             [[keys]]\nname = \"k\"\ntenant = \"t\"\nsha256 = \"{}\"\n\
             [[models]]\nname = \"{NAME}\"\nbackends = [\"{}\", \"{}\"]\nrouting = \"round-robin\"\n\
             tokenizer = \"smollm2\"\n",
            p12_gateway::auth::hash_key(KEY),
            a.url,
            b.url
        );
        let cfg = p12_gateway::Config::parse(&text, "cross-path").unwrap();
        let clock = Arc::new(p12_gateway::clock::SystemClock::default());
        let g = Arc::new(p12_gateway::build(cfg, clock).unwrap());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(p12_gateway::health::run(g.clone()));
        tokio::spawn(p12_gateway::score::run(g.clone()));
        let app = p12_gateway::router(g.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (url, g)
    });
    // Every stream under way (4 events each), then one server killed:
    // round-robin gave it half of them.
    let events: Arc<Vec<AtomicUsize>> = Arc::new(PROMPTS.iter().map(|_| 0.into()).collect());
    let http = reqwest::Client::new();
    let streams: Vec<_> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let req = http
                .post(format!("{url}/v1/completions"))
                .bearer_auth(KEY)
                .json(&body(NAME, p, true))
                .timeout(3 * MIN);
            let events = events.clone();
            rt.spawn(async move {
                let mut r = req.send().await.expect("the gateway answers");
                assert_eq!(r.status(), 200);
                let mut bytes = Vec::new();
                while let Some(c) = r.chunk().await.expect("the stream is not cut") {
                    bytes.extend_from_slice(&c);
                    events[i].store(
                        bytes.windows(2).filter(|w| w == b"\n\n").count(),
                        Ordering::SeqCst,
                    );
                }
                events[i].store(usize::MAX, Ordering::SeqCst); // finished
                bytes
            })
        })
        .collect();
    let t0 = Instant::now();
    while !events.iter().all(|e| e.load(Ordering::SeqCst) >= 4) {
        assert!(t0.elapsed() < 3 * MIN, "the streams never got under way");
        std::thread::sleep(Duration::from_millis(2));
    }
    a.proc.signal(libc::SIGKILL);
    let got: Vec<String> = streams
        .into_iter()
        .map(|s| {
            let (text, done) = stream_text(&rt.block_on(s).unwrap());
            assert!(done, "a stream without [DONE]: {text:?}");
            text
        })
        .collect();
    let page = g.metrics.render(&g.backends());
    let resumed: f64 = page
        .lines()
        .filter(|l| l.starts_with("gateway_stream_resumes_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        resumed >= 1.0,
        "the kill cut no stream: the test would prove nothing\n{page}"
    );
    eprintln!("{resumed} streams continued on the other server");
    assert_same("gateway, a server killed mid-stream", &got, want);
    drop(b);
}
