//! `bench-itl`: decode streams' inter-token latency under a mixed load
//! (short prompts decoding steadily, long prompts arriving now and then),
//! disaggregated 1P1D with each worker pinned to one core, against the
//! co-located engine (Project 10's weights on Project 09's paged K/V,
//! both cores) in the same run, through the same `Engine` seam.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use common::engine::{Engine, EngineEvent, EngineRequest, PromptInput, SamplingParams};
use common::numbers::{command_line, Recorder, Row};
use common::stats::percentile_sorted;

use crate::cluster::{EtcdCluster, Nats};
use crate::proxy_serve;
use crate::registry::Role;
use crate::wire::LoadFailurePolicy;
use p10_quant::serve::LoadArgs;
use p10_quant::Weights;

#[derive(Clone, Debug, Args)]
pub struct ItlArgs {
    /// Seconds of load per configuration.
    #[arg(long, default_value_t = 20)]
    pub seconds: u64,
    /// Short streams, closed loop.
    #[arg(long, default_value_t = 4)]
    pub streams: usize,
    /// Tokens per short stream's prompt and output.
    #[arg(long, default_value_t = 32)]
    pub short_prompt: usize,
    #[arg(long, default_value_t = 64)]
    pub short_output: usize,
    /// Long prompts' tokens, and one arriving every this many ms.
    #[arg(long, default_value_t = 1024)]
    pub long_prompt: usize,
    #[arg(long, default_value_t = 2000)]
    pub long_every_ms: u64,
    /// Measure without appending to numbers.md.
    #[arg(long)]
    pub no_record: bool,
}

/// Distinct token ids (no prefix-cache hit between requests).
pub(crate) fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            1000 + ((x >> 33) % 40_000) as u32
        })
        .collect()
}

fn request(id: u64, prompt: Vec<u32>, max_tokens: usize) -> EngineRequest {
    let mut r = EngineRequest::new(format!("cmpl-itl-{id}"), PromptInput::Tokens(prompt));
    r.max_tokens = Some(max_tokens);
    r.sampling = SamplingParams::greedy();
    r.ignore_eos = true;
    r
}

/// What a load run saw: every gap between two tokens of a short stream,
/// and the long prompts' times to first token (seconds).
#[derive(Debug, Default)]
struct Seen {
    gaps: Vec<f64>,
    long_ttft: Vec<f64>,
    errors: usize,
}

fn drive(engine: Arc<dyn Engine>, a: &ItlArgs) -> Seen {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for s in 0..a.streams {
        let (engine, seen, stop, a) = (engine.clone(), seen.clone(), stop.clone(), a.clone());
        threads.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                let id = (s as u64) << 32 | n;
                let req = request(id, tokens(id, a.short_prompt), a.short_output);
                let Ok(mut rx) = engine.submit(req) else {
                    continue;
                };
                let mut last: Option<Instant> = None;
                let mut gaps = Vec::new();
                let mut ok = true;
                while let Some(ev) = rx.blocking_recv() {
                    match ev {
                        EngineEvent::Token(_) => {
                            let now = Instant::now();
                            if let Some(t) = last {
                                gaps.push((now - t).as_secs_f64());
                            }
                            last = Some(now);
                        }
                        EngineEvent::Done { .. } => break,
                        EngineEvent::Error(_) => {
                            ok = false;
                            break;
                        }
                    }
                }
                let mut s = seen.lock().unwrap_or_else(|e| e.into_inner());
                s.gaps.extend(gaps);
                s.errors += !ok as usize;
            }
        }));
    }
    let t0 = Instant::now();
    let mut k = 0u64;
    let mut longs = Vec::new();
    while t0.elapsed() < Duration::from_secs(a.seconds) {
        k += 1;
        let (engine, seen) = (engine.clone(), seen.clone());
        let req = request(1 << 48 | k, tokens(1 << 48 | k, a.long_prompt), 8);
        longs.push(std::thread::spawn(move || {
            let t = Instant::now();
            let Ok(mut rx) = engine.submit(req) else {
                return;
            };
            let mut first = None;
            while let Some(ev) = rx.blocking_recv() {
                match ev {
                    EngineEvent::Token(_) => {
                        first.get_or_insert(t.elapsed().as_secs_f64());
                    }
                    _ => break,
                }
            }
            if let Some(f) = first {
                seen.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .long_ttft
                    .push(f);
            }
        }));
        std::thread::sleep(Duration::from_millis(a.long_every_ms));
    }
    stop.store(true, Ordering::SeqCst);
    for t in threads.into_iter().chain(longs) {
        let _ = t.join();
    }
    let s = std::mem::take(&mut *seen.lock().unwrap_or_else(|e| e.into_inner()));
    s
}

/// Disaggregated: etcd, NATS, a prefill worker on CPU 0, a decode worker
/// on CPU 1 whose pulls run at `nice` and land in `land_in`, the proxy here.
fn disaggregated(a: &ItlArgs, nice: i32, land_in: &str) -> Result<Seen> {
    let etcd = EtcdCluster::start(1, "127.0.0.1")?;
    let nats = Nats::start("127.0.0.1")?;
    let spec: Vec<_> = [(Role::Prefill, 0), (Role::Decode, 1)]
        .into_iter()
        .map(|(role, cpu)| {
            let mut args = vec!["--cpu".to_string(), cpu.to_string()];
            if role == Role::Decode {
                args.extend(["--pull-nice".to_string(), nice.to_string()]);
                args.extend(["--land-in".to_string(), land_in.to_string()]);
            }
            (role, role.as_str().to_string(), args)
        })
        .collect();
    let workers = (&etcd.urls[..], nats.url.as_str());
    let _procs = proxy_serve::start_workers(
        "smollm2",
        LoadArgs::of(Weights::Native),
        workers,
        256,
        &spec,
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let proxy = proxy_serve::ready_proxy(workers, LoadFailurePolicy::Fail, (1, 1), rt.handle())?;
    Ok(drive(Arc::new(proxy), a))
}

pub fn run(a: &ItlArgs) -> Result<()> {
    let path = p06_server::load::resolve_model("smollm2")?;
    let plain = disaggregated(a, 0, "blocks")?;
    let copied = disaggregated(a, 0, "buffer")?;
    let niced = disaggregated(a, 10, "blocks")?;
    let colo: Arc<dyn Engine> = Arc::new(crate::worker_serve::colocated(
        &path,
        Weights::Native,
        256 << 20,
    )?);
    let colo = drive(colo, a);
    let mut rows = Vec::new();
    let what = format!(
        "{} streams of {}+{} tokens, a {}-token prompt every {} ms, {} s",
        a.streams, a.short_prompt, a.short_output, a.long_prompt, a.long_every_ms, a.seconds
    );
    let mut p99s = Vec::new();
    for (name, s, predict) in [
        (
            "disaggregated 1P1D (one core each), pulls into reserved blocks at nice 0",
            &plain,
            ("12", "24"),
        ),
        (
            "disaggregated 1P1D (one core each), pulls into a buffer copied at the import, nice 0",
            &copied,
            ("12", "29"),
        ),
        (
            "disaggregated 1P1D (one core each), pulls into reserved blocks at nice 10",
            &niced,
            ("12", "22"),
        ),
        ("co-located (both cores)", &colo, ("14", "24")),
    ] {
        let mut g = s.gaps.clone();
        g.sort_by(f64::total_cmp);
        anyhow::ensure!(g.len() >= 5, "{name}: only {} gaps", g.len());
        let (p50, p99) = (
            percentile_sorted(&g, 50.0) * 1e3,
            percentile_sorted(&g, 99.0) * 1e3,
        );
        let mut t = s.long_ttft.clone();
        t.sort_by(f64::total_cmp);
        println!(
            "{name}: ITL p50 {p50:.1} ms, p99 {p99:.1} ms over {} gaps; long-prompt TTFT median {:.0} ms over {}; errors {}",
            g.len(),
            percentile_sorted(&t, 50.0) * 1e3,
            t.len(),
            s.errors
        );
        rows.push(
            Row::new(
                format!("p14 decode ITL, {name}, {what}, p50 of {}", g.len()),
                p50,
                "ms",
            )
            .predicted(predict.0),
        );
        rows.push(
            Row::new(
                format!("p14 decode ITL, {name}, {what}, p99 of {}", g.len()),
                p99,
                "ms",
            )
            .predicted(predict.1),
        );
        if t.len() >= 5 {
            rows.extend(Row::median_p95(
                format!("p14 long-prompt TTFT, {name}, {what}"),
                percentile_sorted(&t, 50.0) * 1e3,
                percentile_sorted(&t, 95.0) * 1e3,
                "ms",
                "",
            ));
        }
        p99s.push(p99);
    }
    let colo_p99 = p99s[3];
    for (i, how, guess) in [
        (0, "into reserved blocks at nice 0", "0.8"),
        (1, "into a buffer at nice 0", "0.95"),
        (2, "into reserved blocks at nice 10", "0.75 (target ≤ 0.5)"),
    ] {
        rows.push(
            Row::new(
                format!(
                    "p14 decode ITL p99, disaggregated (pulls {how}) / co-located, {what}, ratio"
                ),
                p99s[i] / colo_p99,
                "x",
            )
            .predicted(guess),
        );
    }
    anyhow::ensure!(
        [&plain, &copied, &niced, &colo]
            .iter()
            .all(|s| s.errors == 0),
        "requests failed"
    );
    if !a.no_record {
        Recorder::for_workspace(command_line("p14_distributed")).append(&rows)?;
    }
    Ok(())
}
