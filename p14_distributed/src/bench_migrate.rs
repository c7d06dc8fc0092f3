//! `bench-migrate`: what a client sees when a worker serving its request
//! fails, one fault-matrix cell per kind of fault. 1P2D under `up`'s
//! supervisor, the proxy here; each run streams one request per cell and
//! times the **pause**: the longest wait between two tokens the client
//! gets from the fault on.
//!
//! ```text
//! decode-kill    the decode worker SIGKILLed after k tokens: the proxy sees the reset,
//!                prefills prompt + k tokens again (prefix-cached on the prefill
//!                worker), the other decode worker pulls the K/V and continues
//! decode-stop    the decode worker SIGSTOPped after k tokens, inside its lease: the
//!                proxy waits for the lease to run out and 3 s of silence, then the
//!                same; resumed (SIGCONT), the worker frees the stream and registers again
//! prefill-kill   the prefill worker SIGKILLed while it prefills: the proxy finds no
//!                other, and the decode worker computes the prompt itself
//! ```
//!
//! Beside the decode kill, in the same run, the time to **recompute** that
//! request from nothing: the time to first token of a fresh prompt as long
//! as prompt + k, cached nowhere. Every faulted stream is checked against
//! an unfaulted run of the same request: lost or changed requests are
//! counted (and must be 0).

use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use clap::Args;
use common::engine::{Engine, EngineEvent, EngineRequest, PromptInput, SamplingParams};
use common::numbers::{command_line, Recorder, Row};
use common::stats::percentile_sorted;

use crate::bench_itl::tokens;
use crate::cluster::{EtcdCluster, Nats};
use crate::proxy::Proxy;
use crate::proxy_serve;
use crate::registry::{Role, WorkerRecord};
use crate::supervise::Supervisor;
use crate::wire::LoadFailurePolicy;
use p10_quant::serve::LoadArgs;
use p10_quant::Weights;

#[derive(Clone, Debug, Args)]
pub struct MigrateArgs {
    /// Kills (one request each).
    #[arg(long, default_value_t = 7)]
    pub runs: usize,
    /// Prompt tokens.
    #[arg(long, default_value_t = 256)]
    pub prompt: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 64)]
    pub output: usize,
    /// Tokens streamed before the kill.
    #[arg(long, default_value_t = 24)]
    pub kill_after: usize,
    /// The cells, in this order each run.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "decode-kill,decode-stop,prefill-kill"
    )]
    pub faults: Vec<Fault>,
    /// Measure without appending to numbers.md.
    #[arg(long)]
    pub no_record: bool,
}

/// A cell of the fault matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Fault {
    DecodeKill,
    DecodeStop,
    PrefillKill,
}

impl Fault {
    /// What is done, for the rows.
    fn what(self) -> &'static str {
        match self {
            Fault::DecodeKill => "a decode worker SIGKILLed mid-stream",
            Fault::DecodeStop => "a decode worker SIGSTOPped mid-stream, inside its 2 s lease",
            Fault::PrefillKill => "the prefill worker SIGKILLed mid-prefill",
        }
    }

    /// The pause predicted before the first run.
    fn predicted(self) -> &'static str {
        match self {
            Fault::DecodeKill => "80 (the migration)",
            Fault::DecodeStop => "4000-5000 (lease out 1-2 s + 3 s silent + the migration)",
            Fault::PrefillKill => "300-600 (the whole prompt again, on the decode worker)",
        }
    }

    fn role(self) -> Role {
        match self {
            Fault::PrefillKill => Role::Prefill,
            _ => Role::Decode,
        }
    }
}

fn request(id: String, prompt: Vec<u32>, max_tokens: usize) -> EngineRequest {
    let mut r = EngineRequest::new(id, PromptInput::Tokens(prompt));
    r.max_tokens = Some(max_tokens);
    r.sampling = SamplingParams::greedy();
    r.ignore_eos = true;
    r.logprobs = Some(1);
    r
}

/// Every event of a request, to its end (120 s at most).
fn events(proxy: &Proxy, req: EngineRequest) -> Result<Vec<EngineEvent>> {
    let mut rx = proxy.submit(req)?;
    let mut out = Vec::new();
    let t0 = Instant::now();
    while let Some(ev) = rx.blocking_recv() {
        let end = !matches!(ev, EngineEvent::Token(_));
        out.push(ev);
        ensure!(t0.elapsed() < Duration::from_secs(120), "no end in 120 s");
        if end {
            break;
        }
    }
    Ok(out)
}

/// The worker of `workers` with a sequence admitted, from its stats.
fn serving(rt: &tokio::runtime::Runtime, workers: &[WorkerRecord]) -> Option<WorkerRecord> {
    let http = reqwest::Client::new();
    workers.iter().find_map(|w| {
        let url = format!("{}/stats", w.http);
        let s: serde_json::Value = rt
            .block_on(async {
                http.get(url)
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await?
                    .json()
                    .await
            })
            .ok()?;
        let admitted = s["running"].as_u64().unwrap_or(0) + s["waiting"].as_u64().unwrap_or(0);
        (admitted >= 1).then(|| w.clone())
    })
}

fn signal(w: &WorkerRecord, sig: i32) {
    // SAFETY: kill(2) on a worker's pid (from its registry record).
    unsafe { libc::kill(w.pid as i32, sig) };
}

/// One run of a cell: (the pause the client saw in seconds, the stream's
/// events, the worker struck).
fn faulted_run(
    proxy: &Proxy,
    rt: &tokio::runtime::Runtime,
    view: &crate::registry::View,
    req: EngineRequest,
    fault: Fault,
    kill_after: usize,
) -> Result<(f64, Vec<EngineEvent>, WorkerRecord)> {
    let mut rx = proxy.submit(req)?;
    // The client's view: when each token arrived, from the fault on (the
    // tokens already on their way when it came arrive first).
    let (mut at, mut arrivals, mut struck) = (None::<Instant>, Vec::new(), None);
    let mut strike = |arrivals: &mut Vec<f64>| -> Result<Instant> {
        let t0 = Instant::now();
        let w = loop {
            if let Some(w) = serving(rt, &view.workers(fault.role())) {
                break w;
            }
            ensure!(
                t0.elapsed() < Duration::from_secs(30),
                "no {:?} worker runs it",
                fault.role()
            );
            std::thread::sleep(Duration::from_millis(2));
        };
        match fault {
            Fault::DecodeStop => signal(&w, libc::SIGSTOP),
            Fault::DecodeKill | Fault::PrefillKill => signal(&w, libc::SIGKILL),
        }
        struck = Some(w);
        arrivals.push(0.0);
        Ok(Instant::now())
    };
    if fault == Fault::PrefillKill {
        at = Some(strike(&mut arrivals)?);
    }
    let mut got = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        let end = !matches!(ev, EngineEvent::Token(_));
        got.push(ev);
        if let Some(t) = at {
            arrivals.push(t.elapsed().as_secs_f64());
        }
        if at.is_none() && got.len() == kill_after {
            at = Some(strike(&mut arrivals)?);
        }
        if end {
            break;
        }
    }
    // The pause: the longest wait between two tokens from the fault on.
    let pause = arrivals
        .windows(2)
        .map(|w| w[1] - w[0])
        .fold(None, |m: Option<f64>, g| Some(m.map_or(g, |m| m.max(g))));
    let struck = struck.context("no fault: the stream ended first")?;
    Ok((pause.context("no token after the fault")?, got, struck))
}

/// Seconds to the first token of `req`.
fn ttft(proxy: &Proxy, req: EngineRequest) -> Result<f64> {
    let t0 = Instant::now();
    let mut rx = proxy.submit(req)?;
    let first = rx.blocking_recv();
    ensure!(matches!(first, Some(EngineEvent::Token(_))), "{first:?}");
    let t = t0.elapsed().as_secs_f64();
    while rx.blocking_recv().is_some() {}
    Ok(t)
}

/// Until the view holds 1 prefill and 2 decode workers (a resumed worker
/// registered again), none of them the instance `gone` (a killed one's
/// record stays until its lease runs out; the supervisor's replacement
/// registers under its id).
fn wait_all(view: &crate::registry::View, gone: Option<&WorkerRecord>) -> Result<()> {
    let t0 = Instant::now();
    let stale =
        |ws: &[WorkerRecord]| gone.is_some_and(|g| ws.iter().any(|w| w.instance() == g.instance()));
    loop {
        let (p, d) = (view.workers(Role::Prefill), view.workers(Role::Decode));
        if p.len() == 1 && d.len() == 2 && !stale(&p) && !stale(&d) {
            return Ok(());
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(60),
            "the workers not all back in 60 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn run(a: &MigrateArgs) -> Result<()> {
    ensure!(a.runs >= 5, "--runs: at least 5 (a median and a p95)");
    ensure!(
        a.kill_after >= 1 && a.kill_after < a.output,
        "--kill-after: from 1 to --output − 1"
    );
    let etcd = EtcdCluster::start(1, "127.0.0.1")?;
    let nats = Nats::start("127.0.0.1")?;
    let urls = (&etcd.urls[..], nats.url.as_str());
    let spec: Vec<_> = [
        (Role::Prefill, "prefill-0"),
        (Role::Decode, "decode-0"),
        (Role::Decode, "decode-1"),
    ]
    .into_iter()
    .map(|(role, id)| {
        (
            role,
            id.to_string(),
            vec!["--lease-ttl-s".to_string(), "2".to_string()],
        )
    })
    .collect();
    let specs =
        proxy_serve::worker_specs("smollm2", LoadArgs::of(Weights::Native), urls, 256, &spec);
    let _workers = Supervisor::start(std::env::current_exe()?, specs)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let (proxy, view) = proxy_serve::in_process(
        "smollm2",
        p06_server::load::served_name("smollm2"),
        (etcd.urls.clone(), None),
        Some(nats.url.clone()),
        LoadFailurePolicy::Recompute,
        rt.handle(),
    )?;
    let proxy = proxy.worker_wait(Duration::from_secs(30));
    wait_all(&view, None)?;
    // The worker killed last: its replacement must be in the view.
    let mut gone: Option<WorkerRecord> = None;
    // Per cell: its pauses (ms), and its streams lost or changed.
    let mut cells: Vec<(Fault, Vec<f64>, usize)> =
        a.faults.iter().map(|&f| (f, Vec::new(), 0)).collect();
    let mut recomputes = Vec::new();
    for i in 0..a.runs {
        for (c, (fault, pauses, bad)) in cells.iter_mut().enumerate() {
            wait_all(&view, gone.as_ref())?;
            let seed = match fault {
                Fault::DecodeKill => i as u64,
                _ => 2_000 + 8 * i as u64 + c as u64,
            };
            let prompt = tokens(seed, a.prompt);
            let reference = request(format!("cmpl-mig-ref-{i}-{c}"), prompt.clone(), a.output);
            let req = request(format!("cmpl-mig-{i}-{c}"), prompt, a.output);
            let (pause, got, want) = match fault {
                // The prompt must be prefilled when its worker dies: the
                // unfaulted run comes after, on the replacement.
                Fault::PrefillKill => {
                    let (pause, got, struck) =
                        faulted_run(&proxy, &rt, &view, req, *fault, a.kill_after)?;
                    wait_all(&view, Some(&struck))?;
                    gone = Some(struck);
                    (pause, got, events(&proxy, reference)?)
                }
                // The unfaulted run first: the reference, and the prompt
                // cached on the prefill worker as for a request under way.
                Fault::DecodeKill | Fault::DecodeStop => {
                    let want = events(&proxy, reference)?;
                    let (pause, got, struck) =
                        faulted_run(&proxy, &rt, &view, req, *fault, a.kill_after)?;
                    gone = match fault {
                        Fault::DecodeStop => {
                            signal(&struck, libc::SIGCONT);
                            None
                        }
                        _ => Some(struck),
                    };
                    (pause, got, want)
                }
            };
            let same = got == want;
            *bad += (!same) as usize;
            pauses.push(pause * 1e3);
            let mut line = format!("run {i}, {}: pause {:.0} ms", fault.what(), pause * 1e3);
            if *fault == Fault::DecodeKill {
                // From nothing: prompt + k tokens nobody has cached.
                let fresh = tokens(1_000 + i as u64, a.prompt + a.kill_after);
                let r = ttft(&proxy, request(format!("cmpl-mig-fresh-{i}"), fresh, 1))?;
                line += &format!(" (recompute from nothing {:.0} ms)", r * 1e3);
                recomputes.push(r * 1e3);
            }
            println!("{line}{}", if same { "" } else { "; CHANGED" });
        }
    }
    let mut rows = Vec::new();
    let setup = format!(
        "1P2D native, {}-token prompt, {} tokens, decode faults after {}, {} runs",
        a.prompt, a.output, a.kill_after, a.runs
    );
    for (fault, pauses, bad) in &mut cells {
        pauses.sort_by(f64::total_cmp);
        let name = format!("p14 fault matrix: {}", fault.what());
        rows.push(Row::new(
            format!("{name}: requests, {setup}"),
            pauses.len() as f64,
            "requests",
        ));
        rows.push(
            Row::new(
                format!("{name}: lost or changed against the unfaulted run, {setup}"),
                *bad as f64,
                "requests",
            )
            .predicted("0"),
        );
        rows.extend(Row::median_p95(
            format!("{name}: pause (longest gap between tokens from the fault on), {setup}"),
            percentile_sorted(pauses, 50.0),
            percentile_sorted(pauses, 95.0),
            "ms",
            fault.predicted(),
        ));
    }
    // The decode kill against recomputing the request from nothing.
    if let Some((_, pauses, bad)) = cells.iter().find(|c| c.0 == Fault::DecodeKill) {
        recomputes.sort_by(f64::total_cmp);
        let what = format!(
            "1P2D native, {}-token prompt, decode worker SIGKILLed after {} of {} tokens, {} runs",
            a.prompt, a.kill_after, a.output, a.runs
        );
        let (pm, rm) = (
            percentile_sorted(pauses, 50.0),
            percentile_sorted(&recomputes, 50.0),
        );
        rows.extend(Row::median_p95(
            format!("p14 migration pause (longest gap between tokens from the kill on), {what}"),
            pm,
            percentile_sorted(pauses, 95.0),
            "ms",
            "80",
        ));
        rows.extend(Row::median_p95(
            format!(
                "p14 time to first token of {} uncached tokens (recomputing the request from nothing), {what}",
                a.prompt + a.kill_after
            ),
            rm,
            percentile_sorted(&recomputes, 95.0),
            "ms",
            "250",
        ));
        rows.push(
            Row::new(
                format!("p14 migration pause / recompute from nothing, {what}, ratio of medians"),
                pm / rm,
                "x",
            )
            .predicted("0.3 (target ≤ 2)"),
        );
        rows.push(
            Row::new(
                format!("p14 migrated requests lost or changed against the uncut run, {what}"),
                *bad as f64,
                "requests",
            )
            .predicted("0"),
        );
    }
    let bad: usize = cells.iter().map(|c| c.2).sum();
    ensure!(
        bad == 0,
        "{bad} faulted streams differ from their unfaulted runs"
    );
    if !a.no_record {
        Recorder::for_workspace(command_line("p14_distributed")).append(&rows)?;
    }
    Ok(())
}
