//! `p12_gateway bench`: what the gateway costs and what it buys.
//!
//! 1. Added latency: the same requests direct to a backend and through the
//!    gateway, interleaved A B A B, closed loop (1 and 4 clients) and
//!    Poisson. The backend is a scripted one with a fixed service time, so
//!    the difference is the gateway's (authentication, counting the prompt
//!    with the real tokenizer, admission, routing, one more local hop).
//! 2. Prefix affinity vs round-robin: two of our paged servers (Project 09,
//!    one thread each, separate processes), many tenants' system prompts
//!    each used several times: TTFT and the backends' prefix-cache hit rate.
//! 3. A backend killed under load: errors the clients saw, retries, and how
//!    long until the breaker and the health checks took it out.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use axum::routing::{get, post};
use common::numbers::{command_line, Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use common::rng::Rng;
use common::stats::percentile_sorted;
use serde_json::{json, Value};

use crate::auth::hash_key;
use crate::clock::SystemClock;
use crate::config::Config;
use crate::count::Counter;
use crate::state::Gateway;

const MODEL: &str = "SmolLM2-135M-Instruct";
const KEY: &str = "sk-bench";

#[derive(Clone, Debug, clap::Args)]
pub struct BenchArgs {
    /// Requests per side at each load of the added-latency part.
    #[arg(long, default_value_t = 400)]
    pub requests: usize,
    /// The scripted backend's service time, ms.
    #[arg(long, default_value_t = 5.0)]
    pub service_ms: f64,
    /// Poisson arrival rate of the added-latency part, requests/s.
    #[arg(long, default_value_t = 100.0)]
    pub rate: f64,
    /// Our paged server's binary (default: `p09_kv_manager` beside this one).
    #[arg(long)]
    pub backend_bin: Option<PathBuf>,
    /// Shared-prefix workload: distinct system prompts, and uses of each.
    #[arg(long, default_value_t = 12)]
    pub prefixes: usize,
    #[arg(long, default_value_t = 3)]
    pub uses: usize,
    /// Only the added-latency part (no real backends).
    #[arg(long)]
    pub overhead_only: bool,
    /// Do not append to numbers.md.
    #[arg(long)]
    pub no_record: bool,
}

/// The shared-prefix runs: (label, routing, the affinity's imbalance guard).
const VARIANTS: [(&str, &str, usize); 3] = [
    ("round-robin", "round-robin", 8),
    ("prefix-affinity", "prefix-affinity", 8),
    ("prefix-affinity, give way at 1", "prefix-affinity", 1),
];

fn config_text(backends: &[String], routing: &str, extra: &str) -> String {
    config_text_guard(backends, routing, 8, extra)
}

fn config_text_guard(backends: &[String], routing: &str, guard: usize, extra: &str) -> String {
    let list: Vec<String> = backends.iter().map(|b| format!("\"{b}\"")).collect();
    format!(
        "{extra}\n[[tenants]]\nname = \"bench\"\nmodels = [\"{MODEL}\"]\n\
         [[keys]]\nname = \"bench\"\ntenant = \"bench\"\nsha256 = \"{}\"\n\
         requests_per_minute = 100000000\ntokens_per_minute = 100000000000\n\
         [[models]]\nname = \"{MODEL}\"\nbackends = [{}]\nrouting = \"{routing}\"\n\
         affinity_max_imbalance = {guard}\n",
        hash_key(KEY),
        list.join(", ")
    )
}

/// The gateway on a free port, counting with SmolLM2's tokenizer.
async fn start_gateway(text: &str, counter: Counter) -> Result<(String, Arc<Gateway>)> {
    let cfg = Config::parse(text, "bench config")?;
    let mut counters = std::collections::HashMap::new();
    counters.insert(MODEL.to_string(), counter);
    let g = Arc::new(Gateway::new(
        cfg,
        Arc::new(SystemClock::default()),
        counters,
    )?);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let app = crate::router(g.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok((url, g))
}

fn counter() -> Result<Counter> {
    Counter::from_gguf("smollm2", None, MODEL)
}

/// A scripted backend answering every completion after `service`.
async fn scripted(service: Duration) -> Result<String> {
    let answer = move || async move {
        tokio::time::sleep(service).await;
        (
            [("content-type", "application/json")],
            r#"{"id":"x","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"length"}],"usage":{"prompt_tokens":100,"completion_tokens":1,"total_tokens":101}}"#,
        )
    };
    let app = axum::Router::new()
        .route("/v1/completions", post(answer))
        .route("/health", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(url)
}

#[derive(Clone, Copy, Debug)]
enum Load {
    Closed(usize),
    Poisson(f64),
}

/// Latencies (ms) of `n` non-streaming completions against `url` (`key`: through the gateway).
async fn drive(
    http: &reqwest::Client,
    url: &str,
    key: bool,
    body: &Value,
    n: usize,
    load: Load,
    seed: u64,
) -> Result<Vec<f64>> {
    let one = |http: reqwest::Client, url: String, body: Value| async move {
        let mut r = http.post(format!("{url}/v1/completions")).json(&body);
        if key {
            r = r.bearer_auth(KEY);
        }
        let t0 = Instant::now();
        let resp = r.send().await?;
        let ok = resp.status().is_success();
        resp.bytes().await?;
        anyhow::ensure!(ok, "a bench request failed");
        Ok::<f64, anyhow::Error>(t0.elapsed().as_secs_f64() * 1e3)
    };
    let mut out = Vec::with_capacity(n);
    match load {
        Load::Closed(c) => {
            let per = n.div_ceil(c);
            let clients = (0..c).map(|_| {
                let (http, url, body) = (http.clone(), url.to_string(), body.clone());
                async move {
                    let mut v = Vec::with_capacity(per);
                    for _ in 0..per {
                        v.push(one(http.clone(), url.clone(), body.clone()).await?);
                    }
                    Ok::<Vec<f64>, anyhow::Error>(v)
                }
            });
            for v in futures_util::future::join_all(clients).await {
                out.extend(v?);
            }
        }
        Load::Poisson(rate) => {
            let mut rng = Rng::new(seed);
            let start = Instant::now();
            let mut at = 0.0f64;
            let mut tasks = Vec::with_capacity(n);
            for _ in 0..n {
                at += -(1.0 - rng.next_f64()).ln() / rate;
                let due = start + Duration::from_secs_f64(at);
                tokio::time::sleep_until(due.into()).await;
                tasks.push(tokio::spawn(one(
                    http.clone(),
                    url.to_string(),
                    body.clone(),
                )));
            }
            for t in tasks {
                out.push(t.await??);
            }
        }
    }
    Ok(out)
}

fn pct(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    percentile_sorted(&s, q)
}

/// Part 1: the latency the gateway adds.
async fn overhead(a: &BenchArgs, rows: &mut Vec<Row>) -> Result<()> {
    let backend = scripted(Duration::from_secs_f64(a.service_ms / 1e3)).await?;
    let (gw, _g) = start_gateway(
        &config_text(std::slice::from_ref(&backend), "round-robin", ""),
        counter()?,
    )
    .await?;
    let http = reqwest::Client::new();
    // ~100 tokens of prompt, counted by the gateway with SmolLM2's tokenizer.
    let prompt =
        "The gateway counts this prompt with the model's own tokenizer before it admits it. "
            .repeat(6);
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
    // Warm both paths (connections, tokenizer caches).
    drive(&http, &backend, false, &body, 20, Load::Closed(2), 1).await?;
    drive(&http, &gw, true, &body, 20, Load::Closed(2), 1).await?;
    println!(
        "added latency (scripted backend, {} ms service time):",
        a.service_ms
    );
    println!(
        "{:>14} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "load", "direct p50", "gw p50", "added p50", "direct p99", "gw p99", "added p99"
    );
    let mut curves = Vec::new();
    for (name, load) in [
        ("closed c=1", Load::Closed(1)),
        ("closed c=4", Load::Closed(4)),
        (&*format!("Poisson {} req/s", a.rate), Load::Poisson(a.rate)),
    ] {
        let (mut direct, mut via) = (Vec::new(), Vec::new());
        // A B A B: each side twice, half the requests each time.
        for round in 0..2u64 {
            direct.extend(
                drive(
                    &http,
                    &backend,
                    false,
                    &body,
                    a.requests / 2,
                    load,
                    10 + round,
                )
                .await?,
            );
            via.extend(drive(&http, &gw, true, &body, a.requests / 2, load, 10 + round).await?);
        }
        let (d50, g50, d95, g95, d99, g99) = (
            pct(&direct, 50.0),
            pct(&via, 50.0),
            pct(&direct, 95.0),
            pct(&via, 95.0),
            pct(&direct, 99.0),
            pct(&via, 99.0),
        );
        println!(
            "{name:>14} {d50:>10.3} {g50:>10.3} {:>10.3} {d99:>10.3} {g99:>10.3} {:>10.3}",
            g50 - d50,
            g99 - d99
        );
        let m = format!("p12 added latency, {name}, {} ms backend", a.service_ms);
        rows.extend(Row::median_p95(format!("{m}: direct"), d50, d95, "ms", ""));
        rows.push(Row::new(format!("{m}: direct, p99"), d99, "ms"));
        rows.extend(Row::median_p95(
            format!("{m}: through the gateway"),
            g50,
            g95,
            "ms",
            "",
        ));
        rows.push(Row::new(
            format!("{m}: through the gateway, p99"),
            g99,
            "ms",
        ));
        rows.push(
            Row::new(format!("{m}: added at the median"), g50 - d50, "ms")
                .predicted("0.3 ms (target < 1 ms)"),
        );
        rows.push(
            Row::new(format!("{m}: added at p99"), g99 - d99, "ms")
                .predicted("1 ms (target < 5 ms)"),
        );
        let cdf = |v: &[f64]| -> Vec<(f64, f64)> {
            (1..=99).map(|q| (pct(v, q as f64), q as f64)).collect()
        };
        curves.push(Series::new(format!("{name}: direct"), cdf(&direct)));
        curves.push(Series::new(format!("{name}: gateway"), cdf(&via)));
    }
    let dir = crate_dir().join("plots");
    line_chart(
        &dir.join("added_latency.png"),
        Labels {
            title: "Latency direct vs through the gateway (scripted backend)",
            x: "latency, ms",
            y: "percentile",
        },
        &curves,
        Scale::LogX,
    )?;
    Ok(())
}

fn crate_dir() -> PathBuf {
    common::assets::workspace_root().join("p12_gateway")
}

/// One of our paged servers as a child process, one thread.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start(bin: &PathBuf, port: u16) -> Result<Server> {
        let child = Command::new(bin)
            .args(["--model", "smollm2", "--port", &port.to_string()])
            .env("RAYON_NUM_THREADS", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        Ok(Server {
            child,
            url: format!("http://127.0.0.1:{port}"),
        })
    }

    async fn ready(&self, http: &reqwest::Client) -> Result<()> {
        for _ in 0..600 {
            if let Ok(r) = http.get(format!("{}/health", self.url)).send().await {
                if r.status().is_success() {
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("{} did not become healthy in 60 s", self.url)
    }

    async fn metric(&self, http: &reqwest::Client, name: &str) -> Result<f64> {
        let page = http
            .get(format!("{}/metrics", self.url))
            .send()
            .await?
            .text()
            .await?;
        Ok(crate::score::metric_sum(&page, name))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// TTFT (ms) of a streamed chat request through the gateway.
async fn ttft(http: &reqwest::Client, gw: &str, system: &str, user: &str) -> Result<f64> {
    let body = json!({"model": MODEL, "stream": true, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]});
    let t0 = Instant::now();
    let mut r = http
        .post(format!("{gw}/v1/chat/completions"))
        .bearer_auth(KEY)
        .json(&body)
        .send()
        .await?;
    anyhow::ensure!(r.status().is_success(), "status {}", r.status());
    let mut first = None;
    while let Some(c) = r.chunk().await? {
        if first.is_none() && c.starts_with(b"data: ") {
            first = Some(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    first.context("no event")
}

/// Part 2: prefix affinity against round-robin on two of our servers.
async fn affinity(a: &BenchArgs, servers: &[Server], rows: &mut Vec<Row>) -> Result<()> {
    let http = reqwest::Client::new();
    let tok = p06_server::bench::load_tokenizer("smollm2")?;
    let urls: Vec<String> = servers.iter().map(|s| s.url.clone()).collect();
    println!(
        "prefix affinity vs round-robin: {} system prompts x {} uses, 2 clients:",
        a.prefixes, a.uses
    );
    // A B A B, each run on fresh system prompts (cold caches for both).
    let mut results: Vec<(&str, Vec<f64>, f64, f64)> = Vec::new();
    for (run, (policy, routing, guard)) in VARIANTS.iter().chain(&VARIANTS).copied().enumerate() {
        let text = config_text_guard(&urls, routing, guard, "");
        let (gw, _g) = start_gateway(&text, counter()?).await?;
        let mut rng = Rng::new(1000 + run as u64);
        let systems: Vec<String> = (0..a.prefixes)
            .map(|_| p06_server::bench::random_prompt(&tok, 192, &mut rng).map(|(t, _)| t))
            .collect::<Result<_>>()?;
        // Every (prompt, use) pair in a seeded random order: in a fixed
        // p0 p1 ... p0 p1 ... order, round-robin over an even number of
        // prompts would send each prompt to the same backend every round.
        let mut work: Vec<(usize, usize)> = (0..a.uses)
            .flat_map(|u| (0..a.prefixes).map(move |p| (p, u)))
            .collect();
        for i in (1..work.len()).rev() {
            work.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let (mut h0, mut q0) = (0.0, 0.0);
        for s in servers {
            h0 += s.metric(&http, "vllm:prefix_cache_hits").await?;
            q0 += s.metric(&http, "vllm:prefix_cache_queries").await?;
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        let client = || async {
            let mut v = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&(p, u)) = work.get(i) else { break };
                v.push(
                    ttft(
                        &http,
                        &gw,
                        &systems[p],
                        &format!("Question {u}: what is {p} + {u}?"),
                    )
                    .await?,
                );
            }
            Ok::<Vec<f64>, anyhow::Error>(v)
        };
        let (x, y) = tokio::join!(client(), client());
        let mut t = x?;
        t.extend(y?);
        let (mut h1, mut q1) = (0.0, 0.0);
        for s in servers {
            h1 += s.metric(&http, "vllm:prefix_cache_hits").await?;
            q1 += s.metric(&http, "vllm:prefix_cache_queries").await?;
        }
        let hit = (h1 - h0) / (q1 - q0).max(1.0);
        println!(
            "  {policy:>16}: TTFT p50 {:.1} ms, p95 {:.1} ms, prefix-cache hit rate {:.1}%",
            pct(&t, 50.0),
            pct(&t, 95.0),
            hit * 100.0
        );
        results.push((policy, t, hit, q1 - q0));
    }
    for (policy, _, _) in VARIANTS {
        let runs: Vec<&(&str, Vec<f64>, f64, f64)> =
            results.iter().filter(|r| r.0 == policy).collect();
        let t: Vec<f64> = runs.iter().flat_map(|r| r.1.iter().copied()).collect();
        let hit = runs.iter().map(|r| r.2).sum::<f64>() / runs.len() as f64;
        let m = format!(
            "p12 {} system prompts x {} uses on 2 backends, {policy}",
            a.prefixes, a.uses
        );
        let pred = match policy {
            "round-robin" => "",
            "prefix-affinity" => "TTFT median below round-robin's",
            _ => "hit rate between the two, TTFT p95 closer to round-robin's",
        };
        rows.extend(Row::median_p95(
            format!("{m}: TTFT"),
            pct(&t, 50.0),
            pct(&t, 95.0),
            "ms",
            pred,
        ));
        let hit_pred = match policy {
            "round-robin" => "a use hits if an earlier use went to the same backend: (0.5 + 0.75) / 3 of the system-prompt tokens at 3 uses, ~37%",
            "prefix-affinity" => "(uses-1)/uses of the system-prompt tokens (each prefix cold once): ~60% at 3 uses",
            _ => "",
        };
        rows.push(
            Row::new(
                format!("{m}: prefix-cache hit rate (tokens)"),
                hit * 100.0,
                "%",
            )
            .predicted(hit_pred),
        );
    }
    Ok(())
}

/// Part 3: kill one of two backends under Poisson load.
async fn kill(servers: &mut [Server], rows: &mut Vec<Row>) -> Result<()> {
    let http = reqwest::Client::new();
    let urls: Vec<String> = servers.iter().map(|s| s.url.clone()).collect();
    let extra = "[health]\ninterval_ms = 1000\ntimeout_ms = 250\nfailures_to_eject = 2\n\
                 [breaker]\nfailures_to_open = 3\ncooldown_ms = 5000\nsuccesses_to_close = 2";
    let (gw, g) = start_gateway(&config_text(&urls, "round-robin", extra), counter()?).await?;
    tokio::spawn(crate::health::run(g.clone()));
    tokio::spawn(crate::score::run(g.clone()));
    let (rate, secs, kill_at) = (8.0, 10.0, 3.0);
    let n = (rate * secs) as usize;
    let mut rng = Rng::new(7);
    let start = Instant::now();
    let mut at = 0.0;
    let mut tasks = Vec::new();
    let mut killed: Option<Instant> = None;
    let (mut ejected, mut opened) = (None, None);
    let victim = urls[1].clone();
    for i in 0..n {
        at += -(1.0 - rng.next_f64()).ln() / rate;
        let due = start + Duration::from_secs_f64(at);
        while Instant::now() < due {
            if killed.is_none() && start.elapsed().as_secs_f64() >= kill_at {
                servers[1].child.kill()?;
                killed = Some(Instant::now());
            }
            if let Some(k) = killed {
                for (_, url, state, healthy, _) in g.backends() {
                    if url == victim {
                        if !healthy && ejected.is_none() {
                            ejected = Some(k.elapsed());
                        }
                        if state == 1 && opened.is_none() {
                            opened = Some(k.elapsed());
                        }
                    }
                }
            }
            tokio::time::sleep(
                Duration::from_millis(5).min(due.saturating_duration_since(Instant::now())),
            )
            .await;
        }
        let body = json!({"model": MODEL, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": format!("Say {i}.")}]});
        let (http, gw) = (http.clone(), gw.clone());
        tasks.push(tokio::spawn(async move {
            let r = http
                .post(format!("{gw}/v1/chat/completions"))
                .bearer_auth(KEY)
                .json(&body)
                .send()
                .await;
            match r {
                Ok(r) => r.status().as_u16(),
                Err(_) => 0,
            }
        }));
    }
    let mut failed = 0;
    for t in tasks {
        if t.await? != 200 {
            failed += 1;
        }
    }
    let retries = g.metrics.retries_total();
    let ms = |d: Option<Duration>| d.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3);
    println!(
        "backend killed at {kill_at} s of {secs} s, {rate} req/s: {failed} of {n} requests failed, {retries} retries, \
         breaker open after {:.0} ms, ejected after {:.0} ms",
        ms(opened),
        ms(ejected)
    );
    let m = format!("p12 one of 2 backends killed under {rate} req/s");
    rows.push(
        Row::new(
            format!("{m}: client-visible failures (non-streaming)"),
            failed as f64,
            "requests",
        )
        .predicted("0 (target 0)"),
    );
    rows.push(Row::new(format!("{m}: retries"), retries as f64, "retries"));
    rows.push(
        Row::new(
            format!("{m}: kill to breaker open (one run)"),
            ms(opened),
            "ms",
        )
        .predicted("the next 3 requests to it"),
    );
    rows.push(
        Row::new(
            format!("{m}: kill to ejected by health checks (one run)"),
            ms(ejected),
            "ms",
        )
        .predicted("1-2 s (2 failed checks 1 s apart)"),
    );
    Ok(())
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut rows = Vec::new();
        overhead(a, &mut rows).await?;
        if !a.overhead_only {
            let bin = match &a.backend_bin {
                Some(b) => b.clone(),
                None => std::env::current_exe()?.with_file_name("p09_kv_manager"),
            };
            if !bin.exists() {
                bail!(
                    "{} is missing: build it with `cargo build --release -p p09_kv_manager`",
                    bin.display()
                );
            }
            let http = reqwest::Client::new();
            let mut servers = vec![
                Server::start(&bin, free_port()?)?,
                Server::start(&bin, free_port()?)?,
            ];
            for s in &servers {
                s.ready(&http).await?;
            }
            affinity(a, &servers, &mut rows).await?;
            kill(&mut servers, &mut rows).await?;
        }
        if !a.no_record {
            Recorder::for_workspace(command_line("p12_gateway")).append(&rows)?;
        }
        Ok(())
    })
}
