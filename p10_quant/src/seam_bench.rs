//! `p10_quant bench-seam`: what the model-runner seam costs, in one run.
//!
//! 1. In this process, native weights on paged K/V through the engine
//!    core: per decode step at batch 1 and 16, the plan's building
//!    (`StepTiming::plan_s`) plus its binary encoding and decoding (what a
//!    remote runner would add), beside the whole step.
//! 2. Through HTTP, this binary's server against another commit's
//!    (`--base-bin`) and against that binary again (the control: what two
//!    processes of one binary differ by), each a child process on the same
//!    flags, in turns (order rotating by round): decode tok/s at batch 1 (1 / ITL p50,
//!    concurrency 1) and at 16 (16 / ITL p50, concurrency 16), prefill
//!    tok/s of 256-token prompts (256 / TTFT p50, one output token), and
//!    closed-loop output tok/s at concurrency 16. Each metric's ratio
//!    (this / base) per round; the median and the spread over rounds.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use common::batch::BatchModel;
use common::loadgen::{Arrival, Report};
use common::numbers::{command_line, Recorder, Row};
use common::stats::summarize;
use p05_kv_cache::generate::GenerateParams;
use p08_continuous::runner::StepPlan;
use p08_continuous::serve_bench::System;
use p08_continuous::{ContinuousConfig, EngineCore};
use p09_kv_manager::PagedKv;

use crate::batch_bench::serve_child;
use crate::loader::load_native;
use crate::NativeWeights;

#[derive(Clone, Debug, Args)]
pub struct SeamArgs {
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// The `p10_quant` binary of the commit to compare with (built from a
    /// clean checkout of it).
    #[arg(long)]
    pub base_bin: Option<PathBuf>,
    /// Rounds of the HTTP comparison (each runs both servers).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Timed decode steps per batch size in part 1.
    #[arg(long, default_value_t = 64)]
    pub steps: usize,
    /// What part 2 measures: decode (batch 1 and 16, and the closed-loop
    /// output), prefill.
    #[arg(long, value_delimiter = ',', default_value = "decode,prefill")]
    pub http_parts: Vec<String>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[arg(long)]
    pub no_record: bool,
}

pub fn run(a: &SeamArgs) -> Result<()> {
    let mut rows = Vec::new();
    in_process(a, &mut rows)?;
    if let Some(base) = &a.base_bin {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("starting the tokio runtime")?;
        rt.block_on(through_http(a, base, &mut rows))?;
    } else {
        println!("(no --base-bin: part 2, the A/B through HTTP, skipped)");
    }
    if !a.no_record {
        Recorder::for_workspace(command_line("p10_quant"))
            .machine_note(&format!("kernels {}", NativeWeights::detect().dot.isa()))
            .append(&rows)?;
    }
    Ok(())
}

/// Part 1: the seam's cost per step, against the step.
fn in_process(a: &SeamArgs, rows: &mut Vec<Row>) -> Result<()> {
    let path = p06_server::load::resolve_model(&a.model)?;
    let loaded = load_native(&path, NativeWeights::detect())?;
    let tok = loaded.tokenizer.context("the model has no tokenizer")?;
    let engine = loaded.engine;
    println!("1. the seam per decode step (native, paged, through the engine core):");
    for batch in [1usize, 16] {
        let config = ContinuousConfig {
            step_cost: None,
            ..ContinuousConfig::default()
        };
        let kv = PagedKv::new(engine.kv_shape(), 16, 1 << 30, true)?;
        let mut core = EngineCore::with_backend(&engine, &tok, &config, kv)?;
        let mut p = GenerateParams::greedy(a.steps + 16);
        p.ignore_eos = true;
        for i in 0..batch {
            let prompt = tok.encode(&format!(
                "Story {i}: once upon a time, in a village at the edge of a great forest,"
            ));
            core.add(i as u64, &prompt, &p)?;
        }
        // Prefill every prompt; time decode steps only.
        for _ in 0..64 {
            let out = core.step();
            let decoding = out.schedule.seqs.iter().filter(|s| s.decode).count();
            if decoding == batch {
                break;
            }
        }
        let (mut seam, mut step) = (Vec::new(), Vec::new());
        let mut buf = Vec::new();
        for _ in 0..a.steps {
            let t0 = Instant::now();
            let out = core.step();
            let step_s = t0.elapsed().as_secs_f64();
            anyhow::ensure!(out.failed.is_empty(), "a step failed: {:?}", out.failed);
            let t1 = Instant::now();
            buf.clear();
            core.last_plan().encode_into(&mut buf)?;
            let back = StepPlan::decode(&buf)?;
            std::hint::black_box(&back);
            let codec_s = t1.elapsed().as_secs_f64();
            seam.push((out.timing.plan_s + codec_s) * 1e6);
            step.push((step_s + codec_s) * 1e3);
        }
        let (s, t) = (summarize(&seam), summarize(&step));
        let share = 100.0 * s.median / 1e3 / t.median;
        println!(
            "  batch {batch:>2}: plan + encode + decode {:.1} us median ({:.1} p95), {} bytes; step {:.2} ms median; seam {share:.3}% of the step",
            s.median,
            s.p95,
            buf.len(),
            t.median
        );
        rows.extend(Row::median_p95(
            format!("p10 seam per decode step, batch {batch}: plan build + encode + decode ({} samples)", seam.len()),
            s.median,
            s.p95,
            "us",
            "a few us: one small Vec per sequence, ~100 B encoded",
        ));
        rows.extend(Row::median_p95(
            format!(
                "p10 decode step through the engine core, batch {batch}, native ({} samples)",
                step.len()
            ),
            t.median,
            t.p95,
            "ms",
            "",
        ));
        rows.push(
            Row::new(
                format!(
                    "p10 seam share of a batch-{batch} decode step (median seam / median step)"
                ),
                share,
                "%",
            )
            .predicted("<= 1% (target); ~0.05%"),
        );
    }
    Ok(())
}

/// One server's figures for one round.
#[derive(Clone, Copy, Debug)]
struct Figures {
    decode1: f64,
    decode16: f64,
    prefill256: f64,
    out16: f64,
}

/// One of [`Figures`]' fields.
type Metric = fn(&Figures) -> f64;

const NAME: &str = "SmolLM2-135M-Instruct";

/// The figures of `sys`; the parts not asked for are NaN.
async fn measure(
    sys: &System,
    tok: &p04_transformer::Tokenizer,
    seed: u64,
    parts: &[String],
) -> Result<Figures> {
    use p07_batching::serve_bench::{load, requests};
    let closed = |c| Arrival::Closed { concurrency: c };
    let ok = |r: &Report, what: &str| -> Result<()> {
        anyhow::ensure!(
            r.failed == 0,
            "{what}: {} requests failed: {:?}",
            r.failed,
            r.errors
        );
        Ok(())
    };
    let wants = |p: &str| parts.iter().any(|x| x == p);
    let warm = requests(tok, 32, &[8; 4], seed + 100)?;
    load(&sys.url, NAME, closed(2), &[], &warm).await?;
    let mut f = Figures {
        decode1: f64::NAN,
        decode16: f64::NAN,
        prefill256: f64::NAN,
        out16: f64::NAN,
    };
    // The summaries are in milliseconds.
    if wants("decode") {
        let one = requests(tok, 64, &[96; 4], seed)?;
        let (r1, _) = load(&sys.url, NAME, closed(1), &[], &one).await?;
        ok(&r1, "batch 1")?;
        let many = requests(tok, 64, &[96; 32], seed + 1)?;
        let (r16, _) = load(&sys.url, NAME, closed(16), &[], &many).await?;
        ok(&r16, "batch 16")?;
        f.decode1 = 1e3 / r1.itl.median;
        f.decode16 = 16e3 / r16.itl.median;
        f.out16 = r16.output_throughput;
    }
    if wants("prefill") {
        let long = requests(tok, 256, &[1; 5], seed + 2)?;
        let (rp, _) = load(&sys.url, NAME, closed(1), &[], &long).await?;
        ok(&rp, "prefill")?;
        f.prefill256 = 256e3 / rp.ttft.median;
    }
    Ok(f)
}

/// Part 2: this commit's server against `base`'s, and `base` again (the
/// control), in turns.
async fn through_http(a: &SeamArgs, base: &std::path::Path, rows: &mut Vec<Row>) -> Result<()> {
    let ours = std::env::current_exe().context("this binary's path")?;
    let tok = p06_server::bench::load_tokenizer(&a.model)?;
    println!(
        "2. this commit's server vs {} twice (the second: two processes of one binary, the noise floor), order rotating:",
        base.display()
    );
    let names = ["this", "base", "base again"];
    let mut figs: [Vec<Figures>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    for round in 0..a.rounds.max(1) {
        for k in [round % 3, (round + 1) % 3, (round + 2) % 3] {
            let (bin, port, log) = match k {
                0 => (ours.as_path(), 8094, "p10_seam_server"),
                1 => (base, 8093, "p10_base_server"),
                _ => (base, 8095, "p10_base_server_again"),
            };
            let sys = serve_child(bin, &a.model, port, log).await?;
            let f = measure(&sys, &tok, a.seed + round as u64, &a.http_parts).await?;
            drop(sys);
            println!(
                "  round {round} {:>10}: decode b1 {:.1} tok/s, b16 {:.1} tok/s, prefill-256 {:.0} tok/s, c=16 output {:.1} tok/s",
                names[k], f.decode1, f.decode16, f.prefill256, f.out16
            );
            figs[k].push(f);
        }
    }
    let metrics: [(&str, Metric); 4] = [
        (
            "decode tok/s at batch 1 (1 / ITL p50, concurrency 1)",
            |f| f.decode1,
        ),
        (
            "decode tok/s at batch 16 (16 / ITL p50, concurrency 16)",
            |f| f.decode16,
        ),
        ("prefill tok/s, 256-token prompts (256 / TTFT p50)", |f| {
            f.prefill256
        }),
        (
            "closed-loop output tok/s at concurrency 16 (64-token prompts, 96 out)",
            |f| f.out16,
        ),
    ];
    let n = figs[0].len();
    for (label, get) in metrics {
        let col = |k: usize| -> Vec<f64> { figs[k].iter().map(get).collect() };
        let (this, was, again) = (col(0), col(1), col(2));
        if this.iter().any(|v| v.is_nan()) {
            continue; // not measured in this run
        }
        let ratio =
            |x: &[f64]| -> Vec<f64> { x.iter().zip(&was).map(|(x, y)| 100.0 * x / y).collect() };
        let (t, b) = (summarize(&this), summarize(&was));
        let (r, c) = (summarize(&ratio(&this)), summarize(&ratio(&again)));
        println!(
            "  {label}: this {:.1}, base {:.1} (medians of {n}); this / base {:.1}% median ({:.1}..{:.1}); base again / base {:.1}% median ({:.1}..{:.1})",
            t.median, b.median, r.median, r.min, r.max, c.median, c.min, c.max
        );
        let row =
            |what: String, v: f64, unit: &str| Row::new(format!("p10 {label}, {what}"), v, unit);
        rows.push(row(
            format!("this commit, median of {n} rounds"),
            t.median,
            "tok/s",
        ));
        rows.push(row(
            format!("base commit, median of {n} rounds"),
            b.median,
            "tok/s",
        ));
        rows.push(
            row(format!("this / base, median of {n} rounds"), r.median, "%")
                .predicted("within 3% (target); ~100%"),
        );
        rows.push(row(
            format!("this / base, lowest of {n} rounds"),
            r.min,
            "%",
        ));
        rows.push(row(
            format!("this / base, highest of {n} rounds"),
            r.max,
            "%",
        ));
        rows.push(
            row(
                format!(
                    "base again / base (control: one binary, two processes), median of {n} rounds"
                ),
                c.median,
                "%",
            )
            .predicted("~100%, spread as wide as this / base"),
        );
        rows.push(row(
            format!("base again / base, lowest of {n} rounds"),
            c.min,
            "%",
        ));
        rows.push(row(
            format!("base again / base, highest of {n} rounds"),
            c.max,
            "%",
        ));
    }
    Ok(())
}
