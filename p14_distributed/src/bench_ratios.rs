//! `bench-ratios`: goodput at a TTFT and TPOT SLO (DistServe's measure:
//! requests per second that meet both) for P:D ratios on this machine's
//! two cores, against the co-located engine on both, under one open-loop
//! Poisson load (the same arrival times and prompts for every
//! configuration) in the same run.
//!
//! ```text
//!   1P1D   prefill on CPU 0               decode on CPU 1
//!   2P1D   prefill on CPU 0 and CPU 1     decode on CPU 1 (shares it)
//!   1P2D   prefill on CPU 0               decode on CPU 1 and CPU 0 (shares it)
//!   co-located                            one engine, both cores
//! ```
//!
//! Two cores cannot add compute to either side: a ratio only moves a
//! core's time from one phase to the other. That is the trade it shows.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use common::engine::{Engine, EngineEvent, EngineRequest, PromptInput, SamplingParams};
use common::numbers::{command_line, Recorder, Row};
use common::rng::Rng;
use common::stats::summarize;

use crate::cluster::{EtcdCluster, Nats};
use crate::proxy_serve;
use crate::registry::Role;
use crate::wire::LoadFailurePolicy;
use p10_quant::serve::LoadArgs;
use p10_quant::Weights;

#[derive(Clone, Debug, Args)]
pub struct RatiosArgs {
    /// Seconds of arrivals per configuration.
    #[arg(long, default_value_t = 40)]
    pub seconds: u64,
    /// Mean arrivals per second (Poisson).
    #[arg(long, default_value_t = 0.8)]
    pub rate: f64,
    /// Prompt tokens and output tokens per request.
    #[arg(long, default_value_t = 512)]
    pub prompt: usize,
    #[arg(long, default_value_t = 64)]
    pub output: usize,
    /// The SLO: time to first token and time per output token, ms.
    #[arg(long, default_value_t = 2000.0)]
    pub ttft_slo_ms: f64,
    #[arg(long, default_value_t = 50.0)]
    pub tpot_slo_ms: f64,
    /// Measure without appending to numbers.md.
    #[arg(long)]
    pub no_record: bool,
}

/// One finished request: seconds to its first token and per token after.
#[derive(Clone, Copy, Debug)]
struct Outcome {
    ttft: f64,
    tpot: f64,
}

/// The schedule: (arrival offset s, prompt) per request, from one seed.
fn schedule(a: &RatiosArgs) -> Vec<(f64, Vec<u32>)> {
    let mut rng = Rng::new(14);
    let (mut t, mut out) = (0.0, Vec::new());
    loop {
        t += rng.next_exp(a.rate);
        if t >= a.seconds as f64 {
            return out;
        }
        let prompt = (0..a.prompt)
            .map(|_| 1000 + rng.below(40_000) as u32)
            .collect();
        out.push((t, prompt));
    }
}

/// Every request of the schedule at its time, each on a thread of its
/// own; the outcomes of those that finished, and the failures.
fn drive(engine: Arc<dyn Engine>, a: &RatiosArgs) -> (Vec<Outcome>, usize) {
    let seen = Arc::new(Mutex::new((Vec::new(), 0usize)));
    let t0 = Instant::now();
    let mut threads = Vec::new();
    for (i, (at, prompt)) in schedule(a).into_iter().enumerate() {
        let wait = Duration::from_secs_f64(at).saturating_sub(t0.elapsed());
        std::thread::sleep(wait);
        let (engine, seen, output) = (engine.clone(), seen.clone(), a.output);
        threads.push(std::thread::spawn(move || {
            let mut r = EngineRequest::new(format!("cmpl-ratio-{i}"), PromptInput::Tokens(prompt));
            r.max_tokens = Some(output);
            r.sampling = SamplingParams::greedy();
            r.ignore_eos = true;
            let start = Instant::now();
            let (mut first, mut last, mut n, mut ok) = (None, start, 0usize, false);
            if let Ok(mut rx) = engine.submit(r) {
                while let Some(ev) = rx.blocking_recv() {
                    match ev {
                        EngineEvent::Token(_) => {
                            last = Instant::now();
                            first.get_or_insert(last);
                            n += 1;
                        }
                        EngineEvent::Done { .. } => {
                            ok = n == output;
                            break;
                        }
                        EngineEvent::Error(_) => break,
                    }
                }
            }
            let mut s = seen.lock().unwrap_or_else(|e| e.into_inner());
            match (ok, first) {
                (true, Some(f)) => s.0.push(Outcome {
                    ttft: (f - start).as_secs_f64(),
                    tpot: (last - f).as_secs_f64() / (n.max(2) - 1) as f64,
                }),
                _ => s.1 += 1,
            }
        }));
    }
    for t in threads {
        let _ = t.join();
    }
    let s = std::mem::take(&mut *seen.lock().unwrap_or_else(|e| e.into_inner()));
    s
}

/// A disaggregated configuration: (name, prefill CPUs, decode CPUs).
type Config = (&'static str, &'static [usize], &'static [usize]);

const CONFIGS: [Config; 3] = [
    ("1P1D (P on CPU 0, D on CPU 1)", &[0], &[1]),
    ("2P1D (P on CPUs 0 and 1, D on CPU 1)", &[0, 1], &[1]),
    ("1P2D (P on CPU 0, D on CPUs 1 and 0)", &[0], &[1, 0]),
];

fn disaggregated(c: &Config, a: &RatiosArgs) -> Result<(Vec<Outcome>, usize)> {
    let (_, pc, dc) = *c;
    // Fresh etcd and NATS per configuration: no record of the last one's
    // workers lingers in the view.
    let etcd = EtcdCluster::start(1, "127.0.0.1")?;
    let nats = Nats::start("127.0.0.1")?;
    let mut spec = Vec::new();
    for (role, cpus) in [(Role::Prefill, pc), (Role::Decode, dc)] {
        for (i, cpu) in cpus.iter().enumerate() {
            let id = format!("{}-{i}", role.as_str());
            spec.push((role, id, vec!["--cpu".to_string(), cpu.to_string()]));
        }
    }
    let urls = (&etcd.urls[..], nats.url.as_str());
    let _procs =
        proxy_serve::start_workers("smollm2", LoadArgs::of(Weights::Native), urls, 256, &spec)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let counts = (pc.len(), dc.len());
    let proxy = proxy_serve::ready_proxy(urls, LoadFailurePolicy::Fail, counts, rt.handle())?;
    Ok(drive(Arc::new(proxy), a))
}

pub fn run(a: &RatiosArgs) -> Result<()> {
    let n = schedule(a).len();
    anyhow::ensure!(n >= 5, "only {n} arrivals: raise --seconds or --rate");
    let mut results = Vec::new();
    for c in &CONFIGS {
        results.push((c.0.to_string(), disaggregated(c, a)?));
    }
    let path = p06_server::load::resolve_model("smollm2")?;
    let colo: Arc<dyn Engine> = Arc::new(crate::worker_serve::colocated(
        &path,
        Weights::Native,
        256 << 20,
    )?);
    results.push(("co-located (both cores)".to_string(), drive(colo, a)));
    let what = format!(
        "{n} Poisson arrivals at {}/s over {} s, {}+{} tokens",
        a.rate, a.seconds, a.prompt, a.output
    );
    let slo = format!(
        "TTFT ≤ {} ms and TPOT ≤ {} ms",
        a.ttft_slo_ms, a.tpot_slo_ms
    );
    let mut rows = Vec::new();
    println!("{what}; SLO {slo}");
    println!(
        "{:>40} {:>9} {:>9} {:>9} {:>9} {:>7} {:>9}",
        "", "TTFT p50", "TTFT p95", "TPOT p50", "TPOT p95", "failed", "goodput/s"
    );
    for (i, (name, (outs, failed))) in results.iter().enumerate() {
        anyhow::ensure!(
            outs.len() >= 5,
            "{name}: only {} requests finished",
            outs.len()
        );
        let ttft = summarize(&outs.iter().map(|o| o.ttft * 1e3).collect::<Vec<_>>());
        let tpot = summarize(&outs.iter().map(|o| o.tpot * 1e3).collect::<Vec<_>>());
        let good = outs
            .iter()
            .filter(|o| o.ttft * 1e3 <= a.ttft_slo_ms && o.tpot * 1e3 <= a.tpot_slo_ms)
            .count();
        let goodput = good as f64 / a.seconds as f64;
        println!(
            "{name:>40} {:>9.0} {:>9.0} {:>9.1} {:>9.1} {failed:>7} {goodput:>9.3}",
            ttft.median, ttft.p95, tpot.median, tpot.p95
        );
        // Predictions (after a 10 s trial at 1/s): the load is
        // prefill-bound, so a second prefill core helps TTFT more than the
        // shared decode core costs TPOT; a second decode worker takes
        // prefill's core and queues the prompts.
        let guess = ["0.7", "0.75", "0.4", "0.7"][i];
        rows.extend(Row::median_p95(
            format!("p14 TTFT, {name}, {what}"),
            ttft.median,
            ttft.p95,
            "ms",
            "",
        ));
        rows.extend(Row::median_p95(
            format!("p14 TPOT, {name}, {what}"),
            tpot.median,
            tpot.p95,
            "ms",
            "",
        ));
        rows.push(
            Row::new(
                format!("p14 goodput at {slo}, {name}, {what}, whole run"),
                goodput,
                "req/s",
            )
            .predicted(guess),
        );
        rows.push(
            Row::new(
                format!("p14 requests failed, {name}, {what}, whole run"),
                *failed as f64,
                "requests",
            )
            .predicted("0"),
        );
    }
    if !a.no_record {
        Recorder::for_workspace(command_line("p14_distributed")).append(&rows)?;
    }
    Ok(())
}
