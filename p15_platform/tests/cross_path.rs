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
//! Through the prefill/decode proxy and the platform's router, requests
//! using every field the API accepts (sampling, seeds, n, stops, logprobs,
//! token prompts, streaming with usage, chat continuation) must also give
//! the single server's answer, body for body and event for event.
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

/// The single-process server's answers to the 8 prompts, native or f32,
/// and (native) to [`every_field`]: each server started once.
fn references(f32: bool) -> &'static (Vec<String>, Vec<Vec<serde_json::Value>>) {
    static NATIVE: OnceLock<(Vec<String>, Vec<Vec<serde_json::Value>>)> = OnceLock::new();
    static F32: OnceLock<(Vec<String>, Vec<Vec<serde_json::Value>>)> = OnceLock::new();
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
        let fields = match f32 {
            true => Vec::new(),
            false => every_field_answers(&s.url, NAME),
        };
        (texts, fields)
    })
}

fn reference(f32: bool) -> &'static [String] {
    &references(f32).0
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

/// Every field the API accepts, on both endpoints, streamed and not:
/// each must reach the engine that serves it, through every hop.
fn every_field(model: &str) -> Vec<(&'static str, serde_json::Value)> {
    use serde_json::json;
    vec![
        (
            "/v1/completions",
            json!({
                "model": model, "prompt": "The capital of Japan is", "max_tokens": 16,
                "temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
                "repetition_penalty": 1.1, "seed": 7, "n": 1, "logprobs": 3,
                "stop": ["\n\n"], "min_tokens": 4, "ignore_eos": false, "echo": false,
                "user": "u1", "cache_salt": "salt-1", "best_of": 1,
                "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {},
            }),
        ),
        (
            "/v1/completions",
            json!({
                "model": model, "prompt": [504, 3458, 282, 4219], "max_tokens": 12,
                "ignore_eos": true, "temperature": 0.7, "seed": 3, "stream": true,
                "stream_options": {"include_usage": true},
            }),
        ),
        (
            "/v1/chat/completions",
            json!({
                "model": model,
                "messages": [
                    {"role": "system", "content": "You answer in one line."},
                    {"role": "user", "content": [{"type": "text", "text": "Name a fruit and its colour."}]},
                ],
                "max_completion_tokens": 16, "logprobs": true, "top_logprobs": 2,
                "temperature": 0.6, "seed": 11, "stop": ".",
            }),
        ),
        (
            "/v1/completions",
            json!({
                "model": model, "prompt": "Three birds:", "max_tokens": 12, "n": 3,
                "temperature": 0.9, "seed": 5,
            }),
        ),
        (
            "/v1/chat/completions",
            json!({
                "model": model,
                "messages": [
                    {"role": "user", "content": "Count to ten."},
                    {"role": "assistant", "content": "One, two, three,"},
                ],
                "add_generation_prompt": false, "continue_final_message": true,
                "max_tokens": 10, "temperature": 0.0, "stream": true,
                "stream_options": {"include_usage": true},
            }),
        ),
    ]
}

/// A response without what names the request rather than answers it
/// (id, creation time, the model's name as the client gave it): the
/// body, or each event of a stream.
fn answer_of(text: &str) -> Vec<serde_json::Value> {
    let strip = |mut v: serde_json::Value| {
        if let Some(o) = v.as_object_mut() {
            for k in ["id", "created", "model", "system_fingerprint"] {
                o.remove(k);
            }
        }
        v
    };
    let events: Vec<&str> = text
        .split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .collect();
    if events.is_empty() {
        return vec![strip(
            serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}")),
        )];
    }
    events
        .into_iter()
        .map(|d| match d {
            "[DONE]" => serde_json::Value::String(d.into()),
            _ => strip(serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}"))),
        })
        .collect()
}

/// The [`every_field`] requests' answers from `url` as `model`, one at a time.
fn every_field_answers(url: &str, model: &str) -> Vec<Vec<serde_json::Value>> {
    runtime().block_on(async {
        let http = reqwest::Client::new();
        let mut out = Vec::new();
        for (path, body) in every_field(model) {
            let r = http
                .post(format!("{url}{path}"))
                .bearer_auth(KEY)
                .json(&body)
                .timeout(3 * MIN)
                .send()
                .await
                .unwrap_or_else(|e| panic!("{url}{path}: {e}"));
            let status = r.status().as_u16();
            let text = r.text().await.unwrap_or_default();
            let answer = match status {
                200 => answer_of(&text),
                _ => vec![serde_json::json!({"status": status, "body": text})],
            };
            out.push(answer);
        }
        out
    })
}

/// The single-process server's answers to [`every_field`].
fn every_field_reference() -> &'static [Vec<serde_json::Value>] {
    &references(false).1
}

/// `path` answers every request of [`every_field`] as the single server
/// does (`n` > 1 included: the prefill/decode proxy sends each choice as
/// its own request, seeded as the single server seeds it).
fn assert_every_field(path: &str, url: &str, model: &str) {
    let want = every_field_reference();
    assert!(
        want.iter().all(|w| w[0].get("status").is_none()),
        "the single server refused a request: {want:?}"
    );
    let got = every_field_answers(url, model);
    let bodies = every_field(model);
    for (i, ((endpoint, body), (g, w))) in bodies.iter().zip(got.iter().zip(want)).enumerate() {
        assert_eq!(
            g, w,
            "{path}: request {i} ({endpoint} {body}) answered otherwise than the single server"
        );
    }
    eprintln!(
        "{path}: every field answered as the single server ({} requests)",
        want.len()
    );
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
        if p == "1" {
            assert_every_field("up 1P1D", &s.url, NAME);
        }
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
    assert_every_field("platform, co-located", &url, "co");
    assert_every_field("platform, prefill/decode", &url, "pd");
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
