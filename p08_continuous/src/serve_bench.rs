//! `p08_continuous bench-serve`: the serving engines under one load
//! generator (p06's), one system at a time so they never share the cores:
//! p06's serial engine, p07's dynamic batcher, p08's continuous batcher
//! (in process, on one loaded model) and llama.cpp's own `llama-server`
//! (`--parallel 16`, continuous batching, same GGUF, same thread count;
//! started from `scripts/run_llamacpp_native.sh` when it has been built).
//!
//! 0. agreement: greedy tokens of p08 and llama.cpp on a few prompts,
//!    before anything is timed (llama.cpp's Q4_1 path quantises
//!    activations to 8 bits, so the two leave each other after a while; the
//!    timed runs use fixed output lengths with `ignore_eos`, so both do the
//!    same work);
//! 1. closed loop at each concurrency (256-token prompts, 64–256 outputs);
//! 2. Poisson arrivals at rising rates: the throughput–latency curve;
//! 3. a 2,048-token prompt arriving while 4 streams decode: their ITL
//!    over time, steady state vs during its prefill;
//! 4. a mixed workload (short and 1,024-token prompts): output tok/s, p50
//!    TTFT, and Jain's fairness index of per-request TPOT.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use common::engine::Engine;
use common::loadgen::{Arrival, LoadRequest, Report, RequestRecord};
use common::numbers::{command_line, Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use common::rng::Rng;
use p06_server::bench::spawn_server;
use p07_batching::serve_bench::{load, requests, Engines};
use p07_batching::BatchConfig;

use crate::bench_cmd::{load_model, plots_dir};
use crate::{ContinuousConfig, ContinuousEngine};

#[derive(Clone, Debug, Args)]
pub struct ServeArgs {
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Systems to run, in order: serial, p07, p08, llama.cpp.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "serial,p07,p08,p08-budget,llama.cpp"
    )]
    pub systems: Vec<String>,
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub concurrency: Vec<usize>,
    /// Closed loop: requests per client (at least 4 requests in all).
    #[arg(long, default_value_t = 1)]
    pub requests_per_client: usize,
    /// Poisson rates (req/s); empty skips them.
    #[arg(long, value_delimiter = ',', default_value = "0.5,1,2")]
    pub rates: Vec<f64>,
    #[arg(long, default_value_t = 12)]
    pub poisson_requests: usize,
    #[arg(long, default_value_t = 256)]
    pub input_len: usize,
    #[arg(long, default_value_t = 64)]
    pub output_min: usize,
    #[arg(long, default_value_t = 256)]
    pub output_max: usize,
    /// The long prompt of the arrival test (0 skips the test).
    #[arg(long, default_value_t = 2048)]
    pub long_prompt: usize,
    /// Requests of the mixed short/long workload (0 skips it).
    #[arg(long, default_value_t = 16)]
    pub mixed_requests: usize,
    /// llama-server's port and slots.
    #[arg(long, default_value_t = 8091)]
    pub peer_port: u16,
    #[arg(long, default_value_t = 16)]
    pub peer_parallel: usize,
    /// Workloads to run: closed, poisson, long, mixed.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "closed,poisson,long,mixed"
    )]
    pub workloads: Vec<String>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[arg(long)]
    pub no_record: bool,
}

/// A running system under load: where it listens, and its process when
/// it is a child (killed and reaped on drop). Project 10's bench uses it too.
#[derive(Debug)]
pub struct System {
    pub url: String,
    pub peer: Option<Child>,
}

impl System {
    /// Wait until `GET {url}/health` answers 200, for at most 120 s
    /// (`what` names the system in the error).
    pub async fn healthy(&self, what: &str) -> Result<()> {
        let t0 = Instant::now();
        let http = reqwest::Client::new();
        loop {
            let probe = http
                .get(format!("{}/health", self.url))
                .timeout(Duration::from_secs(2));
            if let Ok(r) = probe.send().await {
                if r.status().is_success() {
                    return Ok(());
                }
            }
            if t0.elapsed() > Duration::from_secs(120) {
                bail!("{what} did not become healthy in 120 s");
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

impl Drop for System {
    fn drop(&mut self) {
        if let Some(c) = &mut self.peer {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

async fn start(e: &Engines, name: &str, a: &ServeArgs) -> Result<System> {
    let engine: Arc<dyn Engine> = match name {
        "serial" => e.serial()?,
        "p07" => e.batching(BatchConfig::default())?,
        "p08" | "p08-budget" => {
            // p08-budget: the same scheduler without the ITL cap (the token budget only).
            let defaults = ContinuousConfig::default();
            let config = ContinuousConfig {
                step_cost: defaults.step_cost.filter(|_| name == "p08"),
                ..defaults
            };
            Arc::new(
                ContinuousEngine::start(e.model.clone(), e.tok.clone(), &e.name, config)
                    .map_err(anyhow::Error::msg)?,
            )
        }
        "llama.cpp" => return start_peer(a).await,
        other => bail!("unknown system {other:?} (serial, p07, p08, p08-budget, llama.cpp)"),
    };
    Ok(System {
        url: spawn_server(engine).await?,
        peer: None,
    })
}

async fn start_peer(a: &ServeArgs) -> Result<System> {
    let root = common::assets::workspace_root();
    let script = root.join("scripts/run_llamacpp_native.sh");
    let log_path = root.join("target/llamacpp_server.log");
    let log = std::fs::File::create(&log_path).with_context(|| log_path.display().to_string())?;
    let child = Command::new("bash")
        .arg(&script)
        .arg(a.peer_port.to_string())
        .arg(a.peer_parallel.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .with_context(|| format!("starting {}", script.display()))?;
    let sys = System {
        url: format!("http://127.0.0.1:{}", a.peer_port),
        peer: Some(child),
    };
    sys.healthy("llama-server (build it: bash scripts/build_llamacpp.sh)")
        .await?;
    Ok(sys)
}

/// Jain's fairness index: (Σx)² / (n Σx²), 1 when all equal, 1/n at worst.
pub fn jain(xs: &[f64]) -> f64 {
    let s: f64 = xs.iter().sum();
    let s2: f64 = xs.iter().map(|x| x * x).sum();
    if s2 == 0.0 {
        return 1.0;
    }
    s * s / (xs.len() as f64 * s2)
}

/// Seconds (from the run's start) at which each token of a request arrived.
fn token_times(r: &RequestRecord) -> Vec<f64> {
    let mut t = r.start + r.ttft;
    let mut out = vec![t];
    for d in &r.itl {
        t += d;
        out.push(t);
    }
    out
}

fn outputs(n: usize, a: &ServeArgs, rng: &mut Rng) -> Vec<usize> {
    let span = (a.output_max.saturating_sub(a.output_min) + 1) as u64;
    (0..n)
        .map(|_| a.output_min + rng.below(span) as usize)
        .collect()
}

/// A result line: the table row and numbers.md rows.
fn report_rows(sys: &str, what: &str, r: &Report, rows: &mut Vec<Row>) {
    println!(
        "{sys:>10} {what:<18} {:>9.1} {:>9.0} {:>9.0} {:>9.0} {:>8.1} {:>8.1} {:>8.1}",
        r.output_throughput,
        r.ttft.median,
        r.ttft.p95,
        r.ttft.p99,
        r.itl.median,
        r.itl.p95,
        r.itl.p99
    );
    rows.push(Row::new(
        format!("p08 serve {what} output tok/s, whole run [{sys}]"),
        r.output_throughput,
        "tok/s",
    ));
    for (name, m) in [("TTFT", r.ttft), ("ITL", r.itl)] {
        rows.push(Row::new(
            format!("p08 serve {what} {name} p50 [{sys}]"),
            m.median,
            "ms",
        ));
        rows.push(Row::new(
            format!("p08 serve {what} {name} p95 [{sys}]"),
            m.p95,
            "ms",
        ));
        rows.push(Row::new(
            format!("p08 serve {what} {name} p99 [{sys}]"),
            m.p99,
            "ms",
        ));
    }
}

pub async fn serve(a: &ServeArgs) -> Result<()> {
    let (model, tok) = load_model(&a.model)?;
    let e = Engines {
        model: Arc::new(model),
        tok: Arc::new(tok),
        name: "SmolLM2-135M-Instruct".into(),
    };
    let mut rng = Rng::new(a.seed);
    let mut rows = Vec::new();
    let warm = requests(&e.tok, 16, &[4], a.seed + 100)?;
    // The same requests for every system.
    let closed: Vec<(usize, Vec<LoadRequest>)> = a
        .concurrency
        .iter()
        .map(|&c| {
            let n = (c * a.requests_per_client).max(4);
            Ok((
                c,
                requests(
                    &e.tok,
                    a.input_len,
                    &outputs(n, a, &mut rng),
                    a.seed + c as u64,
                )?,
            ))
        })
        .collect::<Result<_>>()?;
    let poisson: Vec<(f64, Vec<LoadRequest>)> = a
        .rates
        .iter()
        .enumerate()
        .map(|(i, &rate)| {
            let outs = outputs(a.poisson_requests, a, &mut rng);
            Ok((
                rate,
                requests(&e.tok, a.input_len, &outs, a.seed + 50 + i as u64)?,
            ))
        })
        .collect::<Result<_>>()?;
    let streams = requests(&e.tok, 64, &[256; 4], a.seed + 70)?;
    let long = requests(&e.tok, a.long_prompt.max(1), &[16], a.seed + 71)?;
    let mixed: Vec<LoadRequest> = {
        let outs = outputs(a.mixed_requests, a, &mut rng);
        let short = requests(&e.tok, 64, &outs[..outs.len() / 2], a.seed + 80)?;
        let longs = requests(&e.tok, 1024, &outs[outs.len() / 2..], a.seed + 81)?;
        // Interleaved: short, long, short, long, ...
        short
            .into_iter()
            .zip(longs)
            .flat_map(|(s, l)| [s, l])
            .collect()
    };
    let agree_prompts = requests(&e.tok, 32, &[64; 3], a.seed + 90)?;

    let mut p08_texts: Vec<String> = Vec::new();
    let mut curves: Vec<Curve> = Vec::new();
    let mut itl_series = Vec::new();
    println!(
        "{:>10} {:<18} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8}",
        "system", "workload", "out tok/s", "TTFT p50", "p95", "p99", "ITL p50", "p95", "p99"
    );
    for name in &a.systems {
        let sys = start(&e, name, a).await?;
        let url = &sys.url;
        let n = &e.name;
        load(url, n, Arrival::Closed { concurrency: 1 }, &[], &warm).await?;
        // 0. Agreement with p08's greedy tokens.
        if name == "p08" || name == "llama.cpp" {
            let (_, recs) = load(
                url,
                n,
                Arrival::Closed { concurrency: 1 },
                &[],
                &agree_prompts,
            )
            .await?;
            let texts: Vec<String> = recs.iter().map(|r| r.generated_text.clone()).collect();
            if name == "p08" {
                p08_texts = texts;
            } else if !p08_texts.is_empty() {
                for (i, (ours, theirs)) in p08_texts.iter().zip(&texts).enumerate() {
                    let common: usize = ours
                        .chars()
                        .zip(theirs.chars())
                        .take_while(|(x, y)| x == y)
                        .map(|(x, _)| x.len_utf8())
                        .sum();
                    let agree = e.tok.encode(&ours[..common]).len();
                    println!("agreement, prompt {i}: the first {agree} of 64 greedy tokens equal (p08 vs llama.cpp)");
                    rows.push(Row::new(
                        format!("p08 vs llama.cpp greedy tokens equal before the first difference, prompt {i}"),
                        agree as f64,
                        "tokens of 64",
                    ));
                }
            }
        }
        let wants = |w: &str| a.workloads.iter().any(|x| x == w);
        // 1. Closed loop.
        for (c, reqs) in closed.iter().filter(|_| wants("closed")) {
            let (r, _) = load(url, n, Arrival::Closed { concurrency: *c }, &[], reqs).await?;
            report_rows(name, &format!("closed c={c}"), &r, &mut rows);
        }
        // 2. Poisson.
        let mut tput = Vec::new();
        let mut ttft = Vec::new();
        for (i, (rate, reqs)) in poisson.iter().enumerate().filter(|_| wants("poisson")) {
            let arrival = Arrival::Poisson {
                rate: *rate,
                seed: a.seed + i as u64,
            };
            let (r, _) = load(url, n, arrival, &[], reqs).await?;
            report_rows(name, &format!("poisson {rate} req/s"), &r, &mut rows);
            tput.push((*rate, r.output_throughput));
            ttft.push((*rate, r.ttft.p99));
        }
        curves.push((name.clone(), tput, ttft));
        // 3. A long prompt arrives while 4 streams decode (not for the serial engine: it queues).
        if a.long_prompt > 0 && name != "serial" && wants("long") {
            let all = Arrival::Poisson {
                rate: f64::INFINITY,
                seed: a.seed,
            };
            let delay = 3.0;
            let first = load(url, n, all, &[], &streams);
            let second = async {
                tokio::time::sleep(Duration::from_secs_f64(delay)).await;
                load(url, n, all, &[], &long).await
            };
            let (first, second) = tokio::join!(first, second);
            let (_, recs) = first?;
            let (long_report, _) = second?;
            let long_end = delay + long_report.ttft.median / 1e3;
            let mut steady = Vec::new();
            let mut during = Vec::new();
            let mut pts = Vec::new();
            for r in &recs {
                let times = token_times(r);
                for w in times.windows(2).skip(2) {
                    let itl = (w[1] - w[0]) * 1e3;
                    pts.push((w[1] - delay, itl));
                    if w[1] < delay {
                        steady.push(itl);
                    } else if w[0] <= long_end + 0.05 {
                        during.push(itl);
                    }
                }
            }
            pts.sort_by(|x, y| x.0.total_cmp(&y.0));
            let s = common::stats::summarize(&steady);
            let d = common::stats::summarize(&during);
            let (p99_steady, p99_during) = (percentile(&steady, 99.0), percentile(&during, 99.0));
            println!(
                "{name:>10} long-prompt arrival: steady ITL p50 {:.1} p95 {:.1} p99 {p99_steady:.1} ms; during its prefill p50 {:.1} p95 {:.1} max {:.1} p99 {p99_during:.1} ms ({:.2}x steady p50, {:.2}x steady p99); its TTFT {:.0} ms",
                s.median,
                s.p95,
                d.median,
                d.p95,
                d.max,
                p99_during / s.median,
                p99_during / p99_steady,
                long_report.ttft.median
            );
            let tag = format!("[{name}]");
            rows.extend(Row::median_p95(
                format!("p08 long-prompt arrival: steady ITL {tag}"),
                s.median,
                s.p95,
                "ms",
                "",
            ));
            rows.extend(Row::median_p95(
                format!("p08 long-prompt arrival: ITL during prefill {tag}"),
                d.median,
                d.p95,
                "ms",
                "",
            ));
            rows.push(Row::new(
                format!("p08 long-prompt arrival: ITL maximum during prefill {tag}"),
                d.max,
                "ms",
            ));
            rows.push(
                Row::new(
                    format!("p08 long-prompt arrival: ITL p99 during prefill / steady p50 {tag}"),
                    p99_during / s.median,
                    "x",
                )
                .predicted("<= 2 (target, p08)"),
            );
            rows.push(Row::new(
                format!("p08 long-prompt arrival: ITL p99 during prefill / steady p99 {tag}"),
                p99_during / p99_steady,
                "x",
            ));
            rows.push(Row::new(
                format!("p08 long-prompt arrival: its TTFT, median {tag}"),
                long_report.ttft.median,
                "ms",
            ));
            itl_series.push(Series::new(name.clone(), pts));
        }
        // 4. Mixed short/long workload.
        if a.mixed_requests > 0 && name != "serial" && wants("mixed") {
            let (r, recs) = load(url, n, Arrival::Closed { concurrency: 8 }, &[], &mixed).await?;
            let tpots: Vec<f64> = recs.iter().filter_map(common::loadgen::tpot).collect();
            let j = jain(&tpots);
            report_rows(name, "mixed c=8", &r, &mut rows);
            println!("{name:>10} mixed c=8: Jain's fairness of per-request TPOT {j:.3}");
            rows.push(Row::new(
                format!("p08 serve mixed c=8 Jain fairness of TPOT [{name}]"),
                j,
                "index",
            ));
        }
        drop(sys);
    }
    draw(&curves, &itl_series)?;
    if !a.no_record {
        Recorder::for_workspace(command_line("p08_continuous")).append(&rows)?;
    }
    Ok(())
}

fn percentile(xs: &[f64], q: f64) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    common::stats::percentile_sorted(&v, q)
}

/// One system's Poisson points: (rate, output tok/s) and (rate, p99 TTFT ms).
type Curve = (String, Vec<(f64, f64)>, Vec<(f64, f64)>);

fn draw(curves: &[Curve], itl: &[Series]) -> Result<()> {
    let dir = plots_dir();
    if curves.iter().any(|c| !c.1.is_empty()) {
        let tput: Vec<Series> = curves
            .iter()
            .map(|c| Series::new(c.0.clone(), c.1.clone()))
            .collect();
        line_chart(
            &dir.join("throughput_vs_rate.png"),
            Labels {
                title: "Output tok/s vs offered load (Poisson)",
                x: "request rate (req/s)",
                y: "output tokens / s",
            },
            &tput,
            Scale::Linear,
        )
        .map_err(anyhow::Error::msg)?;
        let ttft: Vec<Series> = curves
            .iter()
            .map(|c| Series::new(c.0.clone(), c.2.clone()))
            .collect();
        line_chart(
            &dir.join("ttft_p99_vs_rate.png"),
            Labels {
                title: "p99 TTFT vs offered load (Poisson): the knee",
                x: "request rate (req/s)",
                y: "p99 TTFT (ms)",
            },
            &ttft,
            Scale::LogLog,
        )
        .map_err(anyhow::Error::msg)?;
    }
    if !itl.is_empty() {
        line_chart(
            &dir.join("itl_during_long_prompt.png"),
            Labels {
                title: "ITL of 4 decoding streams; a 2,048-token prompt arrives at t = 0",
                x: "time since the long prompt arrived (s)",
                y: "inter-token latency (ms)",
            },
            itl,
            Scale::Linear,
        )
        .map_err(anyhow::Error::msg)?;
    }
    Ok(())
}
