//! `bench-migrate`: what a client sees when the decode worker streaming
//! its answer is SIGKILLed. 1P2D under `up`'s supervisor, the proxy here;
//! each run streams one request, kills its decode worker after `k`
//! tokens, and times the **pause**: the longest wait between two tokens
//! the client gets from the kill on (the proxy notices the reset, prefills the prompt and the
//! k tokens again, prefix-cached on the prefill worker, and the other
//! decode worker pulls the K/V and continues). Beside it, in the same
//! run, the time to **recompute** that request from nothing: the time to
//! first token of a fresh prompt as long as prompt + k, cached nowhere.
//! Every migrated stream is checked against an uncut run of the same
//! request: lost or changed requests are counted (and must be 0).

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
    /// Measure without appending to numbers.md.
    #[arg(long)]
    pub no_record: bool,
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

/// The decode worker with a sequence running, from the workers' stats.
fn serving(rt: &tokio::runtime::Runtime, decode: &[WorkerRecord]) -> Option<WorkerRecord> {
    let http = reqwest::Client::new();
    decode.iter().find_map(|w| {
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
        (s["running"].as_u64() >= Some(1)).then(|| w.clone())
    })
}

/// One run: (the pause the client saw in seconds, whether the stream
/// equals `want`).
fn killed_run(
    proxy: &Proxy,
    rt: &tokio::runtime::Runtime,
    view: &crate::registry::View,
    req: EngineRequest,
    kill_after: usize,
    want: &[EngineEvent],
) -> Result<(f64, bool)> {
    let mut rx = proxy.submit(req)?;
    let mut got = Vec::new();
    // The client's view: when each token arrived, from the kill on (the
    // tokens already on their way when it came arrive first).
    let (mut killed, mut arrivals) = (None::<Instant>, Vec::new());
    while let Some(ev) = rx.blocking_recv() {
        let end = !matches!(ev, EngineEvent::Token(_));
        got.push(ev);
        if let Some(t) = killed {
            arrivals.push(t.elapsed().as_secs_f64());
        }
        if got.len() == kill_after {
            let w = serving(rt, &view.workers(Role::Decode)).context("no decode worker runs it")?;
            // SAFETY: kill(2) on a worker's pid (from its registry record).
            unsafe { libc::kill(w.pid as i32, libc::SIGKILL) };
            killed = Some(Instant::now());
            arrivals.push(0.0);
        }
        if end {
            break;
        }
    }
    // The pause: the longest wait between two tokens from the kill on.
    let pause = arrivals
        .windows(2)
        .map(|w| w[1] - w[0])
        .fold(None, |m: Option<f64>, g| Some(m.map_or(g, |m| m.max(g))));
    Ok((pause.context("no token after the kill")?, got == want))
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

/// Until the view holds `n` decode workers (the supervisor's replacement).
fn wait_decode(view: &crate::registry::View, n: usize) -> Result<()> {
    let t0 = Instant::now();
    while view.workers(Role::Decode).len() != n {
        ensure!(
            t0.elapsed() < Duration::from_secs(60),
            "{n} decode workers not back in 60 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
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
    wait_decode(&view, 2)?;
    let (mut pauses, mut recomputes, mut changed) = (Vec::new(), Vec::new(), 0);
    for i in 0..a.runs {
        wait_decode(&view, 2)?;
        let prompt = tokens(i as u64, a.prompt);
        // The uncut run first: the reference, and the prompt cached on
        // the prefill worker as it would be for a request under way.
        let want = events(
            &proxy,
            request(format!("cmpl-mig-ref-{i}"), prompt.clone(), a.output),
        )?;
        let req = request(format!("cmpl-mig-{i}"), prompt, a.output);
        let (pause, same) = killed_run(&proxy, &rt, &view, req, a.kill_after, &want)?;
        changed += (!same) as usize;
        // From nothing: prompt + k tokens nobody has cached.
        let fresh = tokens(1_000 + i as u64, a.prompt + a.kill_after);
        let recompute = ttft(&proxy, request(format!("cmpl-mig-fresh-{i}"), fresh, 1))?;
        println!(
            "run {i}: pause {:.0} ms (recompute from nothing {:.0} ms){}",
            pause * 1e3,
            recompute * 1e3,
            if same { "" } else { "; CHANGED" }
        );
        pauses.push(pause * 1e3);
        recomputes.push(recompute * 1e3);
    }
    pauses.sort_by(f64::total_cmp);
    recomputes.sort_by(f64::total_cmp);
    let what = format!(
        "1P2D native, {}-token prompt, decode worker SIGKILLed after {} of {} tokens, {} runs",
        a.prompt, a.kill_after, a.output, a.runs
    );
    let (pm, rm) = (
        percentile_sorted(&pauses, 50.0),
        percentile_sorted(&recomputes, 50.0),
    );
    let mut rows = Vec::new();
    rows.extend(Row::median_p95(
        format!("p14 migration pause (longest gap between tokens from the kill on), {what}"),
        pm,
        percentile_sorted(&pauses, 95.0),
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
            changed as f64,
            "requests",
        )
        .predicted("0"),
    );
    ensure!(
        changed == 0,
        "{changed} migrated streams differ from the uncut run"
    );
    if !a.no_record {
        Recorder::for_workspace(command_line("p14_distributed")).append(&rows)?;
    }
    Ok(())
}
