//! `p15_platform route-bench`: routing quality. Three model servers, the
//! router (Project 12's gateway) in front of them with each policy in
//! turn, the same skewed shared-prefix load through each:
//!
//! ```text
//! load      8 closed-loop streaming clients; each request is one of 16
//!           system prompts (160 tokens; prompt k drawn with weight
//!           1/(k+1), a Zipf law: a few hot tenants, a long tail) plus a
//!           short question, 8 tokens generated
//! servers   2 x `p15_platform server` (native weights, one thread each,
//!           a K/V pool of --kv-mib: room for about half the prompts)
//! policies  round-robin | least-outstanding | prefix-affinity | scored
//!           (A B C D, A B C D, ...; fresh system prompts each time, so
//!           every policy starts from caches that hold none of them)
//! measured  prefix-cache hit rate (hit / looked-up prompt tokens, from
//!           the servers' counters); queue imbalance (every 100 ms:
//!           busiest minus idlest server's running + waiting); TTFT;
//!           goodput (requests per second whose TTFT met the SLO)
//! ```

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use common::numbers::{command_line, Recorder, Row};
use common::rng::Rng;
use common::stats::percentile_sorted;
use p12_gateway::clock::SystemClock;
use p12_gateway::score::metric_sum;

use crate::clients::{one, Record};

const MODEL: &str = "smollm2";
const KEY: &str = "sk-route";
const POLICIES: [&str; 4] = [
    "round-robin",
    "least-outstanding",
    "prefix-affinity",
    "scored",
];

#[derive(Clone, Debug, clap::Args)]
pub struct RouteBenchArgs {
    /// Rounds of all four policies.
    #[arg(long, default_value_t = 2)]
    pub runs: usize,
    /// Seconds of load per policy and round.
    #[arg(long, default_value_t = 20.0)]
    pub seconds: f64,
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Model servers, one thread each (no more than this machine's cores,
    /// or they take turns on one and idling one costs nothing).
    #[arg(long, default_value_t = 2)]
    pub servers: usize,
    #[arg(long, default_value_t = 16)]
    pub prefixes: usize,
    #[arg(long, default_value_t = 160)]
    pub prefix_tokens: usize,
    /// Each server's K/V pool, MiB (SmolLM2: 45 KiB per position, so 96
    /// MiB is 136 blocks of 16: the running requests' and about half the
    /// system prompts').
    #[arg(long, default_value_t = 96)]
    pub kv_mib: usize,
    /// The TTFT SLO that goodput counts against, seconds.
    #[arg(long, default_value_t = 1.0)]
    pub slo_s: f64,
    /// Print only; append nothing to numbers.md.
    #[arg(long)]
    pub no_rows: bool,
}

struct Server {
    child: Child,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

async fn start_servers(a: &RouteBenchArgs, http: &reqwest::Client) -> anyhow::Result<Vec<Server>> {
    let exe = std::env::current_exe()?;
    let mut servers = Vec::new();
    for _ in 0..a.servers {
        let port = free_port()?;
        let child = Command::new(&exe)
            .args(["server", "--model", MODEL, "--served-model-name", MODEL])
            .args(["--port", &port.to_string()])
            .args(["--kv-cache-mib", &a.kv_mib.to_string()])
            .env("RAYON_NUM_THREADS", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {} server", exe.display()))?;
        servers.push(Server {
            child,
            url: format!("http://127.0.0.1:{port}"),
        });
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    for s in &servers {
        loop {
            let ok = http
                .get(format!("{}/health", s.url))
                .timeout(Duration::from_secs(1))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "{} not healthy in 120 s (is the model fetched? bash scripts/fetch_assets.sh)",
                    s.url
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(servers)
}

/// The router for `policy` over `urls`, in this process: its URL and its
/// tasks (aborted when the segment ends, so that a finished router's
/// health checks and scrapes do not load the next one's servers).
async fn start_router(
    urls: &[String],
    policy: &str,
) -> anyhow::Result<(String, Vec<tokio::task::JoinHandle<()>>)> {
    let list: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    let text = format!(
        "[health]\ninterval_ms = 500\n[[tenants]]\nname = \"t\"\nmodels = [\"{MODEL}\"]\n\
         [[keys]]\nname = \"k\"\ntenant = \"t\"\nsha256 = \"{}\"\n\
         [[models]]\nname = \"{MODEL}\"\nbackends = [{}]\nrouting = \"{policy}\"\n\
         tokenizer = \"{MODEL}\"\n",
        p12_gateway::auth::hash_key(KEY),
        list.join(", ")
    );
    let cfg = p12_gateway::Config::parse(&text, "route-bench")?;
    let g = Arc::new(p12_gateway::build(cfg, Arc::new(SystemClock::default()))?);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let tasks = vec![
        tokio::spawn(p12_gateway::health::run(g.clone())),
        tokio::spawn(p12_gateway::score::run(g.clone())),
        tokio::spawn(async move {
            let _ = axum::serve(listener, p12_gateway::router(g)).await;
        }),
    ];
    Ok((url, tasks))
}

async fn counters(http: &reqwest::Client, servers: &[Server]) -> anyhow::Result<(f64, f64)> {
    let (mut hits, mut queries) = (0.0, 0.0);
    for s in servers {
        let text = http
            .get(format!("{}/metrics", s.url))
            .timeout(Duration::from_secs(5))
            .send()
            .await?
            .text()
            .await?;
        hits += metric_sum(&text, "vllm:prefix_cache_hits");
        queries += metric_sum(&text, "vllm:prefix_cache_queries");
    }
    Ok((hits, queries))
}

/// One policy's measurements in one round.
#[derive(Debug, Default)]
struct Segment {
    hits: f64,
    queries: f64,
    imbalance: Vec<f64>,
    records: Vec<Record>,
    seconds: f64,
}

async fn segment(
    a: &RouteBenchArgs,
    servers: &[Server],
    policy: &str,
    seed: u64,
) -> anyhow::Result<Segment> {
    let http = reqwest::Client::new();
    let urls: Vec<String> = servers.iter().map(|s| s.url.clone()).collect();
    let (router, router_tasks) = start_router(&urls, policy).await?;
    let tok = p06_server::bench::load_tokenizer(MODEL)?;
    let mut rng = Rng::new(seed);
    let systems: Vec<String> = (0..a.prefixes)
        .map(|_| p06_server::bench::random_prompt(&tok, a.prefix_tokens, &mut rng).map(|(t, _)| t))
        .collect::<anyhow::Result<_>>()?;
    let weights: Vec<f64> = (0..a.prefixes).map(|k| 1.0 / (k + 1) as f64).collect();
    let (h0, q0) = counters(&http, servers).await?;
    let t0 = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let records = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for c in 0..a.clients {
        let (stop, records, http) = (stop.clone(), records.clone(), http.clone());
        let (router, systems, weights) = (router.clone(), systems.clone(), weights.clone());
        let mut rng = Rng::new(seed * 1000 + c as u64);
        tasks.push(tokio::spawn(async move {
            let total: f64 = weights.iter().sum();
            while !stop.load(Ordering::Relaxed) {
                let mut x = rng.next_f64() * total;
                let k = weights
                    .iter()
                    .position(|w| {
                        x -= w;
                        x < 0.0
                    })
                    .unwrap_or(0);
                let prompt = format!("{}\nQuestion {}: why?", systems[k], rng.below(1000));
                let r = one(&http, &router, MODEL, KEY, &prompt, 8, t0).await;
                if !r.ok {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                records.lock().unwrap_or_else(|p| p.into_inner()).push(r);
            }
        }));
    }
    let mut imbalance = Vec::new();
    while t0.elapsed().as_secs_f64() < a.seconds {
        let mut q = Vec::new();
        for s in servers {
            let r = http
                .get(format!("{}/metrics", s.url))
                .timeout(Duration::from_secs(1))
                .send()
                .await;
            if let Ok(r) = r {
                let text = r.text().await.unwrap_or_default();
                q.push(
                    metric_sum(&text, "vllm:num_requests_running")
                        + metric_sum(&text, "vllm:num_requests_waiting"),
                );
            }
        }
        if q.len() == servers.len() {
            let max = q.iter().copied().fold(f64::MIN, f64::max);
            let min = q.iter().copied().fold(f64::MAX, f64::min);
            imbalance.push(max - min);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await?;
    }
    let seconds = t0.elapsed().as_secs_f64();
    for t in router_tasks {
        t.abort();
    }
    let (h1, q1) = counters(&http, servers).await?;
    let records = std::mem::take(&mut *records.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(Segment {
        hits: h1 - h0,
        queries: q1 - q0,
        imbalance,
        records,
        seconds,
    })
}

fn pct(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        percentile_sorted(&v, q)
    }
}

/// One policy's figures over its segments.
struct Figures {
    hit_rate: f64,
    imbalance: Vec<f64>,
    ttft: Vec<f64>,
    goodput: f64,
    failed: usize,
    requests: usize,
}

fn figures(segs: &[&Segment], slo: f64) -> Figures {
    let recs: Vec<&Record> = segs.iter().flat_map(|s| &s.records).collect();
    let ttft: Vec<f64> = recs
        .iter()
        .filter(|r| r.ok)
        .filter_map(|r| r.ttft)
        .collect();
    let good = recs
        .iter()
        .filter(|r| r.ok && r.ttft.is_some_and(|t| t <= slo))
        .count();
    Figures {
        hit_rate: segs.iter().map(|s| s.hits).sum::<f64>()
            / segs.iter().map(|s| s.queries).sum::<f64>().max(1.0),
        imbalance: segs.iter().flat_map(|s| s.imbalance.clone()).collect(),
        ttft,
        goodput: good as f64 / segs.iter().map(|s| s.seconds).sum::<f64>().max(1e-9),
        failed: recs.iter().filter(|r| !r.ok).count(),
        requests: recs.len(),
    }
}

const PREDICTED: [(&str, &str, &str); 4] = [
    ("round-robin", "lowest: each server sees all prompts", "low"),
    ("least-outstanding", "as round-robin", "lowest"),
    (
        "prefix-affinity",
        "highest: each prompt on one server",
        "highest: the hot prompts' server queues",
    ),
    ("scored", "near prefix-affinity", "near least-outstanding"),
];

pub fn run(a: &RouteBenchArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let http = reqwest::Client::new();
        let servers = start_servers(a, &http).await?;
        println!(
            "{} servers (K/V pool {} MiB each), {} clients, {} system prompts of {} tokens (Zipf)",
            a.servers,
            a.kv_mib, a.clients, a.prefixes, a.prefix_tokens
        );
        let mut segs: Vec<(&str, Segment)> = Vec::new();
        for run in 0..a.runs.max(1) {
            for (i, policy) in POLICIES.iter().enumerate() {
                let seed = 7000 + (run * POLICIES.len() + i) as u64;
                let s = segment(a, &servers, policy, seed).await?;
                println!(
                    "round {} {policy:>17}: {} requests, hit rate {:.1}%, imbalance mean {:.2}, TTFT p50 {:.3} s",
                    run + 1,
                    s.records.len(),
                    100.0 * s.hits / s.queries.max(1.0),
                    s.imbalance.iter().sum::<f64>() / s.imbalance.len().max(1) as f64,
                    pct(s.records.iter().filter_map(|r| r.ttft).collect(), 50.0),
                );
                segs.push((policy, s));
            }
        }
        if let Some(e) = segs.iter().flat_map(|s| &s.1.records).find(|r| !r.ok) {
            println!("a failed request: {}", e.error);
        }
        let mut rows = Vec::new();
        let n = a.runs.max(1);
        println!("\npolicy              hit rate  imbalance mean  TTFT p50  TTFT p99  goodput/s  failed");
        for (policy, hit_pred, imb_pred) in PREDICTED {
            let mine: Vec<&Segment> = segs.iter().filter(|s| s.0 == policy).map(|s| &s.1).collect();
            let f = figures(&mine, a.slo_s);
            let mean_imb = f.imbalance.iter().sum::<f64>() / f.imbalance.len().max(1) as f64;
            println!(
                "{policy:<18} {:>8.1}% {:>15.2} {:>9.3} {:>9.3} {:>10.2} {:>7}",
                100.0 * f.hit_rate,
                mean_imb,
                pct(f.ttft.clone(), 50.0),
                pct(f.ttft.clone(), 99.0),
                f.goodput,
                f.failed
            );
            let m = format!(
                "p15 routing, {} servers, {} clients, {} Zipf prompts, {policy}",
                a.servers,
                a.clients, a.prefixes
            );
            rows.push(
                Row::new(
                    format!("{m}: prefix-cache hit rate (tokens), {n} x {} s", a.seconds),
                    100.0 * f.hit_rate,
                    "%",
                )
                .predicted(hit_pred),
            );
            rows.push(
                Row::new(
                    format!("{m}: queue imbalance (busiest - idlest running+waiting), mean of {} samples", f.imbalance.len()),
                    mean_imb,
                    "requests",
                )
                .predicted(imb_pred),
            );
            rows.extend(Row::median_p95(
                format!("{m}: TTFT of {}", f.ttft.len()),
                pct(f.ttft.clone(), 50.0),
                pct(f.ttft.clone(), 95.0),
                "s",
                "",
            ));
            rows.push(Row::new(
                format!(
                    "{m}: goodput (TTFT <= {} s), whole run of {n} x {} s",
                    a.slo_s, a.seconds
                ),
                f.goodput,
                "req/s",
            ));
            rows.push(Row::new(
                format!("{m}: requests failed, of {}", f.requests),
                f.failed as f64,
                "requests",
            ).predicted("0"));
        }
        if !a.no_rows {
            Recorder::for_workspace(command_line("p15_platform"))
                .append(&rows)
                .context("appending to numbers.md")?;
            println!("rows appended to numbers.md");
        }
        drop(servers);
        Ok(())
    })
}
