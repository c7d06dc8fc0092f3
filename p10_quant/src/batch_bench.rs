//! `p10_quant bench-batch`: batched native decode and serving at many
//! streams, beside llama.cpp, in one run.
//!
//! 1. Batched decode steps (one token for each of B sequences at one
//!    position; p07's `measure`): B = 1..64 at positions 64 and 512, for
//!    native weights on the integer tile kernels (batch-invariant, the
//!    default), native with the old f32 path for products of 16+ rows
//!    (not batch-invariant: what invariance costs), and f32 weights;
//!    beside llama.cpp's `llama-batched-bench` on the same GGUF and
//!    threads (its S_TG, generation tok/s, 5 runs).
//! 2. The tile kernel's multiply-adds per second (in cache, and inside the
//!    batch-16 decode step) against this machine's integer peak on the
//!    same instruction, measured here (`peak.rs`).
//! 3. Closed-loop serving through HTTP at concurrency 1, 4, 16, 32 (about
//!    170-token prompts, 64 output tokens, the same requests for every
//!    system): our server (native, paged, prefix caching), the same with
//!    the batch-variant f32 path, optionally the previous commit's binary
//!    (`--base-bin`), and llama.cpp's `llama-server --parallel N`; output
//!    tok/s, TTFT and ITL p50/p95/p99.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use common::batch::BatchModel;
use common::loadgen::{Arrival, LoadRequest, Report};
use common::numbers::{command_line, Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use p05_kv_cache::llama_engine::LlamaEngine;
use p08_continuous::serve_bench::System;

use crate::loader::{load, load_native};
use crate::NativeWeights;

#[derive(Clone, Debug, Args)]
pub struct BatchArgs {
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    pub batches: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "64,512")]
    pub positions: Vec<usize>,
    /// Timed steps per point and round (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    pub samples: usize,
    /// Rounds over the three weight paths in turn, per point.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,32")]
    pub concurrency: Vec<usize>,
    #[arg(long, default_value_t = 170)]
    pub input_len: usize,
    #[arg(long, default_value_t = 64)]
    pub output_len: usize,
    /// llama.cpp's tools (scripts/build_llamacpp.sh puts them here).
    #[arg(long, default_value = ".llamacpp/bin")]
    pub llamacpp: PathBuf,
    /// A `p10_quant` binary of another commit to serve beside ours.
    #[arg(long)]
    pub base_bin: Option<PathBuf>,
    /// Parts to run: decode, peak, serve.
    #[arg(long, value_delimiter = ',', default_value = "decode,peak,serve")]
    pub parts: Vec<String>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[arg(long)]
    pub no_record: bool,
}

/// One decode point's step time, in seconds: median and p95.
#[derive(Clone, Copy, Debug)]
struct Step {
    median: f64,
    p95: f64,
}

pub fn run(a: &BatchArgs) -> Result<()> {
    let path = p06_server::load::resolve_model(&a.model)?;
    let isa = NativeWeights::detect().dot.isa();
    let mut rows = Vec::new();
    let wants = |p: &str| a.parts.iter().any(|x| x == p);
    let native = load_native(&path, NativeWeights::detect())?;
    if wants("decode") {
        decode(a, &path, &native.engine, &mut rows)?;
    }
    if wants("peak") {
        peak(isa, &native.engine, &mut rows)?;
    }
    if wants("serve") {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        rt.block_on(serve(a, &path, native, &mut rows))?;
    }
    if !a.no_record {
        Recorder::for_workspace(command_line("p10_quant"))
            .machine_note(&format!("kernels {isa}"))
            .append(&rows)?;
    }
    Ok(())
}

fn step_of(s: &common::stats::Summary) -> Step {
    Step {
        median: s.median,
        p95: s.p95,
    }
}

/// Part 1, the decode sweep.
fn decode(a: &BatchArgs, path: &Path, native: &LlamaEngine, rows: &mut Vec<Row>) -> Result<()> {
    let variant = load_native(path, NativeWeights::batch_variant())?;
    let f32e = load(path, crate::Weights::F32)?;
    let systems: [(&str, &LlamaEngine); 3] = [
        ("native", native),
        ("native f32-threshold (batch-variant)", &variant.engine),
        ("f32", &f32e.engine),
    ];
    let threads = native.model.threads;
    let mut plot_dir_series: Vec<(usize, Vec<Series>)> = Vec::new();
    for &pos in &a.positions {
        println!("1. batched decode at position {pos}: tok/s (median step; p95 step in ms)");
        let mut curves: Vec<Vec<(f64, f64)>> = vec![Vec::new(); systems.len() + 1];
        let mut at: Vec<Vec<(usize, Step)>> = vec![Vec::new(); systems.len()];
        for &b in &a.batches {
            let mut line = format!("  batch {b:3}:");
            // Rounds of A, B, C in turn (rotated: B, C, A next): the
            // machine's drift lands on all three alike; each system's
            // samples are pooled over rounds.
            let mut samples: Vec<Vec<f64>> = vec![Vec::new(); systems.len()];
            for round in 0..a.rounds {
                // Each round starts with the next system, so no system is
                // always timed right after the same other one.
                for j in 0..systems.len() {
                    let k = (round + j) % systems.len();
                    samples[k].extend(steps(systems[k].1, b, pos, a.samples)?);
                    // Let the threads of the system just timed (rayon's
                    // and the pool's spin after their last job) go to
                    // sleep before the next is timed.
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            for (k, (name, _)) in systems.iter().enumerate() {
                let sum = common::stats::summarize(&samples[k]);
                let (s, n) = (step_of(&sum), samples[k].len());
                let tps = b as f64 / s.median;
                line += &format!(" {name} {tps:7.1} ({:.1} ms)", s.p95 * 1e3);
                let what = format!("p10 batch decode {name}, position {pos}, batch {b}");
                rows.push(Row::new(
                    format!("{what}: step, median of {n}"),
                    s.median * 1e3,
                    "ms",
                ));
                rows.push(Row::new(
                    format!("{what}: step, p95 of {n}"),
                    s.p95 * 1e3,
                    "ms",
                ));
                rows.push(Row::new(
                    format!("{what}: tok/s from the median step"),
                    tps,
                    "tok/s",
                ));
                curves[k].push((b as f64, tps));
                at[k].push((b, s));
            }
            println!("{line}");
        }
        // llama.cpp's batched bench on the same GGUF and threads.
        match llama_batched(&a.llamacpp, path, threads, pos, &a.batches) {
            Ok(peer) => {
                for (b, runs) in &peer {
                    let s = common::stats::summarize(runs);
                    let slow = p5(runs);
                    println!("  llama-batched-bench batch {b:3}: {:.1} tok/s (median of {} runs; slow p5 {slow:.1})", s.median, runs.len());
                    let what = format!("p10 batch decode llama.cpp (llama-batched-bench S_TG), position {pos}, batch {b}");
                    rows.push(Row::new(
                        format!("{what}: tok/s, median of {} runs", runs.len()),
                        s.median,
                        "tok/s",
                    ));
                    rows.push(Row::new(
                        format!("{what}: tok/s, p5 of {} runs (slow tail)", runs.len()),
                        slow,
                        "tok/s",
                    ));
                    curves[systems.len()].push((*b as f64, s.median));
                }
                if let (Some(ours), Some(theirs)) =
                    (rate(&at[0], 16), peer.iter().find(|p| p.0 == 16))
                {
                    let r = ours / common::stats::summarize(&theirs.1).median;
                    println!("  batch 16: native / llama.cpp {r:.2}x");
                    rows.push(Row::new(format!("p10 batch decode position {pos}, batch 16: native / llama.cpp (ratio of medians)"), r, "x"));
                }
            }
            Err(e) => println!("  llama-batched-bench skipped: {e:#}"),
        }
        if let (Some(one), Some(sixteen)) = (rate(&at[0], 1), rate(&at[0], 16)) {
            let r = sixteen / one;
            println!("  native batch 16 / batch 1: {r:.2}x (target >= 4x)");
            rows.push(
                Row::new(format!("p10 batch decode native position {pos}: batch 16 / batch 1 (ratio of medians)"), r, "x")
                    .predicted(">= 4x (target)"),
            );
        }
        for b in [1usize, 16] {
            if let (Some(inv), Some(var)) = (rate(&at[0], b), rate(&at[1], b)) {
                let cost = 1.0 - inv / var;
                println!("  batch {b}: invariance costs {:.1}% (invariant {inv:.1} vs batch-variant {var:.1} tok/s)", 100.0 * cost);
                rows.push(
                    Row::new(format!("p10 batch decode position {pos}, batch {b}: cost of invariance, 1 - invariant / batch-variant (ratio of medians)"), 100.0 * cost, "%")
                        .predicted(if b == 1 { "~0 (target)" } else { "<= 5% (target)" }),
                );
            }
        }
        let mut series: Vec<Series> = systems
            .iter()
            .zip(&curves)
            .map(|((n, _), c)| Series::new(*n, c.clone()))
            .collect();
        series.push(Series::new(
            "llama.cpp (llama-batched-bench)",
            curves[systems.len()].clone(),
        ));
        plot_dir_series.push((pos, series));
    }
    let dir = common::assets::workspace_root().join("p10_quant/plots");
    for (pos, series) in plot_dir_series {
        let title =
            format!("Batched decode at position {pos}: tok/s (median step) vs batch, 2 threads");
        line_chart(
            &dir.join(format!("batch_decode_pos{pos}.png")),
            Labels {
                title: &title,
                x: "sequences in the step (log)",
                y: "decode tok/s (all sequences)",
            },
            &series,
            Scale::LogX,
        )
        .map_err(anyhow::Error::msg)?;
    }
    Ok(())
}

/// `samples` timed batched decode steps (seconds each) of b sequences at
/// position pos, after one warm-up step.
fn steps(e: &LlamaEngine, b: usize, pos: usize, samples: usize) -> Result<Vec<f64>> {
    use common::batch::Batch;
    let mut ws = e.new_workspace();
    let mut kv = p07_batching::bench::decode_stores(e, b, pos);
    let mut batch = Batch::new();
    for i in 0..b {
        batch.push(&[100 + i as u32], pos)?;
    }
    let mut logits = vec![0.0f32; b * e.model.cfg.vocab_size];
    let mut out = Vec::with_capacity(samples);
    for i in 0..=samples {
        let mut refs: Vec<_> = kv.iter_mut().collect();
        let t = Instant::now();
        e.forward_batch(&batch, &mut refs, &mut ws, &mut logits)?;
        let dt = t.elapsed().as_secs_f64();
        for s in kv.iter_mut() {
            s.set_len(pos)?;
        }
        if i > 0 {
            out.push(dt);
        }
    }
    Ok(out)
}

/// The 5th percentile of rates: their slow tail.
fn p5(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    common::stats::percentile_sorted(&v, 5.0)
}

/// tok/s from the median step at batch b.
fn rate(points: &[(usize, Step)], b: usize) -> Option<f64> {
    points
        .iter()
        .find(|p| p.0 == b)
        .map(|p| b as f64 / p.1.median)
}

/// `llama-batched-bench` at one prompt length for the given batch sizes,
/// 5 runs: per batch, its generation tok/s (S_TG) of each run.
fn llama_batched(
    bin: &Path,
    model: &Path,
    threads: usize,
    pos: usize,
    batches: &[usize],
) -> Result<Vec<(usize, Vec<f64>)>> {
    let exe = bin.join("llama-batched-bench");
    let npl = batches
        .iter()
        .map(|b| b.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let max_b = batches.iter().copied().max().unwrap_or(1);
    let ctx = (pos + 64) * max_b + 64;
    let mut out: Vec<(usize, Vec<f64>)> = batches.iter().map(|&b| (b, Vec::new())).collect();
    for _ in 0..5 {
        let o = Command::new(&exe)
            .env("LD_LIBRARY_PATH", bin)
            .args([
                "-m",
                &model.display().to_string(),
                "-t",
                &threads.to_string(),
                "-tb",
                &threads.to_string(),
            ])
            .args(["-c", &ctx.to_string(), "-b", "2048", "-ub", "512", "-pps"])
            .args(["-npp", &pos.to_string(), "-ntg", "32", "-npl", &npl])
            .output()
            .with_context(|| {
                format!(
                    "running {} (build it: bash scripts/build_llamacpp.sh)",
                    exe.display()
                )
            })?;
        anyhow::ensure!(
            o.status.success(),
            "llama-batched-bench failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        // |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s | ...
        for line in String::from_utf8_lossy(&o.stdout).lines() {
            let cells: Vec<&str> = line
                .split('|')
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .collect();
            let (Some(b), Some(tg)) = (
                cells.get(2).and_then(|c| c.parse::<usize>().ok()),
                cells.get(7).and_then(|c| c.parse::<f64>().ok()),
            ) else {
                continue;
            };
            if let Some(slot) = out.iter_mut().find(|s| s.0 == b) {
                slot.1.push(tg);
            }
        }
    }
    anyhow::ensure!(
        out.iter().all(|s| !s.1.is_empty()),
        "llama-batched-bench printed no rows for some batch sizes"
    );
    Ok(out)
}

/// Part 2, multiply-adds per second: the peak, the kernel in cache, the
/// kernel inside a batch-16 decode step.
fn peak(isa: crate::Isa, native: &LlamaEngine, rows: &mut Vec<Row>) -> Result<()> {
    use crate::act::{ActFormat, QRow};
    use crate::formats::{quantize_row, BlockQ4_1, QK};
    use crate::panel::Panels;
    use crate::tile::OutRows;
    let threads = native.model.threads;
    println!("2. integer multiply-adds ({isa}):");
    let mut peaks = Vec::new();
    for _ in 0..5 {
        if let Some(p) = crate::peak::int_macs_per_s(isa, threads, 0.2) {
            peaks.push(p / 1e9);
        }
    }
    if peaks.is_empty() {
        println!("  no integer peak on the {isa} path");
        return Ok(());
    }
    let peak = common::stats::summarize(&peaks);
    println!(
        "  peak ({threads} threads): {:.0} GMAC/s (best of 5: {:.0})",
        peak.median, peak.max
    );
    rows.push(Row::new(
        format!("p10 integer multiply-add peak ({threads} threads), best of 5"),
        peak.max,
        "GMAC/s",
    ));
    // The kernel alone, in cache: 576 x 1536 Q4_1 (down's width), m = 16, on the pool.
    let (rows_w, cols, m) = (576usize, 1536usize, 16usize);
    let w: Vec<BlockQ4_1> = quantize_row(&common::testdata::uniform(rows_w * cols, 1))?;
    let p = Panels::from_q4_1(&w, rows_w, cols / QK);
    let dot = crate::Dot::detect();
    let mut xq = QRow::default();
    dot.quantize(
        &common::testdata::uniform(m * cols, 2),
        ActFormat::Q8_1,
        &mut xq,
    )?;
    let mut y = vec![0.0f32; m * rows_w];
    let reps = 50;
    let mut rates = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        for _ in 0..reps {
            let yp = y.as_mut_ptr() as usize;
            crate::Pool::global().for_ranges(p.groups(), threads, &|r| {
                let (c0, c1) = (r.start * 16, (r.end * 16).min(rows_w));
                // SAFETY: each range writes its own columns of y (m x rows_w).
                let o = unsafe { OutRows::from_raw((yp as *mut f32).add(c0), m, c1 - c0, rows_w) };
                dot.tiles(&p, r, xq.all(), o);
            });
        }
        rates.push((m * rows_w * cols * reps) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    let k = common::stats::summarize(&rates);
    let slow = p5(&rates);
    println!("  tile kernel in cache, m = 16 ({threads} threads): {:.0} GMAC/s median, {slow:.0} p5 = {:.0}% of the peak", k.median, 100.0 * k.median / peak.max);
    rows.push(Row::new(
        format!("p10 tile kernel in cache, m = 16, {threads} threads: median of 7"),
        k.median,
        "GMAC/s",
    ));
    rows.push(Row::new(
        format!("p10 tile kernel in cache, m = 16, {threads} threads: p5 of 7 (slow tail)"),
        slow,
        "GMAC/s",
    ));
    rows.push(Row::new(
        "p10 tile kernel in cache / integer peak (ratio of median to best)",
        100.0 * k.median / peak.max,
        "%",
    ));
    // Inside the model: a batch-16 step's multiply-adds over its time.
    let pt = p07_batching::bench::measure(native, 16, 64, 7)?;
    let macs = p07_batching::bench::matmul_params(native) as f64 * 16.0;
    let in_model = macs / pt.batched.median / 1e9;
    println!("  batch-16 decode step at position 64: {in_model:.0} GMAC/s of projections over the whole step = {:.0}% of the peak", 100.0 * in_model / peak.max);
    rows.push(Row::new(
        "p10 batch-16 decode step at position 64: projection multiply-adds / median step time",
        in_model,
        "GMAC/s",
    ));
    rows.push(Row::new(
        "p10 batch-16 decode step / integer peak (ratio of median to best)",
        100.0 * in_model / peak.max,
        "%",
    ));
    Ok(())
}

fn child(cmd: &mut Command, log: &str) -> Result<Child> {
    let path = common::assets::workspace_root().join(format!("target/{log}.log"));
    let file = std::fs::File::create(&path).with_context(|| path.display().to_string())?;
    cmd.stdout(Stdio::null())
        .stderr(Stdio::from(file))
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))
}

/// `bin serve --model MODEL --port PORT` as a child process (its stderr
/// in `target/LOG.log`), once it answers `/health`.
pub(crate) async fn serve_child(bin: &Path, model: &str, port: u16, log: &str) -> Result<System> {
    let mut cmd = Command::new(bin);
    cmd.args(["serve", "--model", model, "--port", &port.to_string()]);
    let sys = System {
        url: format!("http://127.0.0.1:{port}"),
        peer: Some(child(&mut cmd, log)?),
    };
    sys.healthy(&format!("{} serve", bin.display())).await?;
    Ok(sys)
}

/// Start `name` for concurrency `c`.
async fn start(
    name: &str,
    c: usize,
    a: &BatchArgs,
    native: &Arc<LlamaEngine>,
    variant: &Arc<LlamaEngine>,
    tok: &Arc<p04_transformer::Tokenizer>,
) -> Result<System> {
    let root = common::assets::workspace_root();
    match name {
        "p10" | "p10 batch-variant" => {
            let model = if name == "p10" { native } else { variant };
            let config = p08_continuous::ContinuousConfig::default();
            let kv =
                p09_kv_manager::PagedKv::new(model.kv_shape(), 16, config.kv_cache_bytes, true)?;
            let engine = p08_continuous::ContinuousEngine::start_with_backend(
                model.clone(),
                tok.clone(),
                "SmolLM2-135M-Instruct",
                config,
                kv,
            )?;
            let url = p06_server::bench::spawn_server(Arc::new(engine)).await?;
            Ok(System { url, peer: None })
        }
        "p10 previous commit" => {
            let bin = a.base_bin.as_ref().context("no --base-bin")?;
            serve_child(bin, &a.model, 8093, "p10_base_server").await
        }
        "llama.cpp" => {
            let port = 8092;
            let mut cmd = Command::new("bash");
            cmd.arg(root.join("scripts/run_llamacpp_native.sh"))
                .args([port.to_string(), c.to_string()]);
            let sys = System {
                url: format!("http://127.0.0.1:{port}"),
                peer: Some(child(&mut cmd, "llamacpp_server")?),
            };
            sys.healthy("llama-server (build it: bash scripts/build_llamacpp.sh)")
                .await?;
            Ok(sys)
        }
        other => bail!("unknown system {other}"),
    }
}

/// Part 3, closed-loop serving.
async fn serve(
    a: &BatchArgs,
    path: &Path,
    native: p05_kv_cache::load::LoadedEngine,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let tok = Arc::new(native.tokenizer.context("the model has no tokenizer")?);
    let native = Arc::new(native.engine);
    let variant = Arc::new(load_native(path, NativeWeights::batch_variant())?.engine);
    let mut systems = vec!["p10", "p10 batch-variant", "llama.cpp"];
    if a.base_bin.is_some() {
        systems.insert(2, "p10 previous commit");
    }
    let name = "SmolLM2-135M-Instruct";
    let warm = p07_batching::serve_bench::requests(&tok, 32, &[8; 4], a.seed + 100)?;
    println!(
        "3. closed loop, {}-token prompts, {} output tokens:",
        a.input_len, a.output_len
    );
    println!(
        "{:>22} {:>4} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8}",
        "system", "c", "out tok/s", "TTFT p50", "p95", "p99", "ITL p50", "p95", "p99"
    );
    let mut curves: Vec<Vec<(f64, f64)>> = vec![Vec::new(); systems.len()];
    let mut at: Vec<Vec<(usize, Report)>> = (0..systems.len()).map(|_| Vec::new()).collect();
    for &c in &a.concurrency {
        let n = (2 * c).max(8);
        let reqs: Vec<LoadRequest> = p07_batching::serve_bench::requests(
            &tok,
            a.input_len,
            &vec![a.output_len; n],
            a.seed + c as u64,
        )?;
        for (k, sys_name) in systems.iter().enumerate() {
            let sys = start(sys_name, c, a, &native, &variant, &tok).await?;
            p07_batching::serve_bench::load(
                &sys.url,
                name,
                Arrival::Closed { concurrency: 2 },
                &[],
                &warm,
            )
            .await?;
            let (r, _) = p07_batching::serve_bench::load(
                &sys.url,
                name,
                Arrival::Closed { concurrency: c },
                &[],
                &reqs,
            )
            .await?;
            drop(sys);
            anyhow::ensure!(
                r.failed == 0,
                "{sys_name} at c={c}: {} requests failed: {:?}",
                r.failed,
                r.errors
            );
            println!(
                "{sys_name:>22} {c:>4} {:>9.1} {:>9.0} {:>9.0} {:>9.0} {:>8.1} {:>8.1} {:>8.1}",
                r.output_throughput,
                r.ttft.median,
                r.ttft.p95,
                r.ttft.p99,
                r.itl.median,
                r.itl.p95,
                r.itl.p99
            );
            let what = format!("p10 serve closed c={c} ({n} requests)");
            rows.push(Row::new(
                format!("{what} output tok/s, whole run [{sys_name}]"),
                r.output_throughput,
                "tok/s",
            ));
            for (m, s) in [("TTFT", r.ttft), ("ITL", r.itl)] {
                for (stat, v) in [("p50", s.median), ("p95", s.p95), ("p99", s.p99)] {
                    rows.push(Row::new(format!("{what} {m} {stat} [{sys_name}]"), v, "ms"));
                }
            }
            curves[k].push((c as f64, r.output_throughput));
            at[k].push((c, r));
        }
    }
    let find = |k: usize, c: usize| at[k].iter().find(|x| x.0 == c).map(|x| &x.1);
    let peer = systems.iter().position(|s| *s == "llama.cpp");
    if let (Some(ours), Some(theirs)) = (find(0, 16), peer.and_then(|p| find(p, 16))) {
        let r = ours.output_throughput / theirs.output_throughput;
        println!("  c=16: output tok/s ours / llama.cpp {r:.2}x (target >= 2x); TTFT p99 {:.0} vs {:.0} ms", ours.ttft.p99, theirs.ttft.p99);
        rows.push(
            Row::new(
                "p10 serve closed c=16: output tok/s, p10 / llama.cpp (ratio)",
                r,
                "x",
            )
            .predicted(">= 2x (target)"),
        );
        rows.push(
            Row::new(
                "p10 serve closed c=16: TTFT p99, p10 / llama.cpp (ratio)",
                ours.ttft.p99 / theirs.ttft.p99,
                "x",
            )
            .predicted("<= 1 (target)"),
        );
    }
    let base = systems.iter().position(|s| *s == "p10 previous commit");
    for c in [1usize, 16] {
        if let (Some(ours), Some(prev)) = (find(0, c), base.and_then(|b| find(b, c))) {
            let r = ours.output_throughput / prev.output_throughput;
            println!("  c={c}: output tok/s this commit / previous {r:.2}x");
            rows.push(Row::new(
                format!("p10 serve closed c={c}: output tok/s, this commit / --base-bin (ratio)"),
                r,
                "x",
            ));
        }
        if let (Some(ours), Some(var)) = (find(0, c), find(1, c)) {
            let cost = 1.0 - ours.output_throughput / var.output_throughput;
            rows.push(Row::new(format!("p10 serve closed c={c}: cost of invariance, 1 - invariant / batch-variant output tok/s"), 100.0 * cost, "%"));
        }
    }
    let series: Vec<Series> = systems
        .iter()
        .zip(&curves)
        .map(|(n, c)| Series::new(*n, c.clone()))
        .collect();
    let title = format!(
        "Closed-loop serving: output tok/s vs concurrent streams ({}-token prompts, {} out)",
        a.input_len, a.output_len
    );
    line_chart(
        &common::assets::workspace_root().join("p10_quant/plots/serve_concurrency.png"),
        Labels {
            title: &title,
            x: "concurrent streams (log)",
            y: "output tok/s",
        },
        &series,
        Scale::LogX,
    )
    .map_err(anyhow::Error::msg)?;
    Ok(())
}
