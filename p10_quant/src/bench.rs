//! `p10_quant bench`: native quantised weights against f32, beside
//! llama.cpp, in one run.
//!
//! 1. accuracy of the native path (8-bit activations) against the f32 one
//!    on the same weights: mean KL divergence and top-1 agreement over every
//!    position of a few prompts;
//! 2. decode tok/s (128 tokens after a 16-token prompt) and prefill tok/s
//!    (256 and 1,024 tokens, f32 and native in interleaved pairs), and llama.cpp's `llama-bench`
//!    on the same GGUF with the same threads;
//! 3. where a decode step goes (projections, head, the rest), both paths;
//! 4. GEMV per SmolLM2 shape: GB/s and GFLOP/s per format, against the
//!    measured read bandwidth (Project 02's ceiling), and the bandwidth
//!    limit of a whole token;
//! 5. resident memory after loading, f32 vs native (a child process each).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use common::numbers::{command_line, Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use common::stats::{time_it, BenchConfig};
use p04_transformer::Proj;
use p05_kv_cache::llama_engine::LlamaEngine;
use p05_kv_cache::sampling::argmax;

use crate::loader::{load, load_native};
use crate::{Dot, NativeWeights};

#[derive(Clone, Debug, Args)]
pub struct BenchArgs {
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// llama.cpp's tools (scripts/build_llamacpp.sh puts them here).
    #[arg(long, default_value = ".llamacpp/bin")]
    pub llamacpp: PathBuf,
    /// Skip llama.cpp.
    #[arg(long)]
    pub no_peer: bool,
    #[arg(long)]
    pub no_record: bool,
}

/// Every projection of the model, with a label of its kind.
fn projections(e: &LlamaEngine) -> Vec<(&'static str, &Proj)> {
    let m = &e.model;
    let mut v = Vec::new();
    for b in &m.blocks {
        v.extend([
            ("q", &b.wq),
            ("k", &b.wk),
            ("v", &b.wv),
            ("o", &b.wo),
            ("gate", &b.w_gate),
            ("up", &b.w_up),
            ("down", &b.w_down),
        ]);
    }
    v.push(("head", &m.lm_head));
    v
}

/// Bytes of weights one decode token reads.
pub fn bytes_per_token(e: &LlamaEngine) -> usize {
    projections(e)
        .iter()
        .map(|(_, p)| p.weights().weight_bytes())
        .sum()
}

/// The texts [`accuracy`] is measured on (prose, code, prose).
pub const ACCURACY_PROMPTS: [&str; 3] = [
    "The keeper of the lighthouse wrote in his log every evening: the wind, the ships that passed, the colour of the sea.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide and water.",
];

/// (mean KL(f32 ‖ native) in nats, top-1 agreement) over every position.
pub fn accuracy(f32e: &LlamaEngine, nat: &LlamaEngine, prompts: &[Vec<u32>]) -> Result<(f64, f64)> {
    use crate::perplexity::{kl, log_softmax};
    let (mut kl_sum, mut agree, mut n) = (0.0f64, 0usize, 0usize);
    let (mut la, mut lb) = (Vec::new(), Vec::new());
    for p in prompts {
        let a = f32e.model.forward(p, 1, p.len())?;
        let b = nat.model.forward(p, 1, p.len())?;
        let v = f32e.model.cfg.vocab_size;
        for (ra, rb) in a.data().chunks_exact(v).zip(b.data().chunks_exact(v)) {
            log_softmax(ra, &mut la);
            log_softmax(rb, &mut lb);
            kl_sum += kl(&la, &lb);
            agree += usize::from(argmax(ra) == argmax(rb));
            n += 1;
        }
    }
    Ok((kl_sum / n as f64, agree as f64 / n as f64))
}

/// Seconds of one product x (1, in) → (1, out), at least 30 timings.
fn gemv_seconds(p: &Proj, threads: usize) -> common::stats::Summary {
    let x = vec![0.1f32; p.in_features()];
    let mut y = vec![0.0f32; p.out_features()];
    let cfg = BenchConfig {
        warmup_iters: 5,
        min_samples: 30,
        min_time: Duration::from_millis(200),
        max_samples: 2000,
    };
    time_it(cfg, || {
        p.apply_into(&x, 1, &mut y, threads).expect("shapes")
    })
}

/// llama.cpp's `llama-bench` on the same file: (pp256, pp1024, tg128), each
/// the tok/s of every repetition (its `samples_ts`).
#[allow(clippy::type_complexity)]
fn llama_bench(bin: &Path, model: &Path, threads: usize) -> Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
    let exe = bin.join("llama-bench");
    let out = std::process::Command::new(&exe)
        .env("LD_LIBRARY_PATH", bin)
        .args(["-m", &model.display().to_string()])
        .args([
            "-t",
            &threads.to_string(),
            "-p",
            "256,1024",
            "-n",
            "128",
            "-r",
            &common::numbers::MIN_SAMPLES.to_string(),
        ])
        .args(["-o", "json"])
        .output()
        .with_context(|| {
            format!(
                "running {} (build it: bash scripts/build_llamacpp.sh)",
                exe.display()
            )
        })?;
    anyhow::ensure!(
        out.status.success(),
        "llama-bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("llama-bench's JSON")?;
    let find = |p: u64, g: u64| {
        v.as_array()
            .into_iter()
            .flatten()
            .find(|r| r["n_prompt"] == p && r["n_gen"] == g)
            .and_then(|r| {
                let runs: Vec<f64> = r["samples_ts"]
                    .as_array()?
                    .iter()
                    .filter_map(serde_json::Value::as_f64)
                    .collect();
                (!runs.is_empty()).then_some(runs)
            })
            .context("a llama-bench row (or its samples_ts) is missing")
    };
    Ok((find(256, 0)?, find(1024, 0)?, find(0, 128)?))
}

fn child_rss(model: &str, weights: &str) -> Result<f64> {
    let out = std::process::Command::new(std::env::current_exe()?)
        .args(["rss", "--model", model, "--weights", weights])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let b: f64 = String::from_utf8_lossy(&out.stdout).trim().parse()?;
    Ok(b / 1e6)
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let path = p06_server::load::resolve_model(&a.model).map_err(anyhow::Error::msg)?;
    let isa = Dot::detect().isa();
    let f32m = load(&path, crate::Weights::F32)?;
    let nat = load(&path, crate::Weights::Native)?;
    let (fe, ne) = (&f32m.engine, &nat.engine);
    let threads = fe.model.threads;
    let mut rows = Vec::new();
    println!("kernels: {isa}, {threads} threads");

    // 1. Accuracy: the same weights, activations in 8 bits.
    let tok = f32m
        .tokenizer
        .as_ref()
        .context("the model has no tokenizer")?;
    let prompts: Vec<Vec<u32>> = ACCURACY_PROMPTS.iter().map(|t| tok.encode(t)).collect();
    // Every position through the integer path (decode's), not prefill's f32.
    let int = load_native(
        &path,
        NativeWeights {
            f32_rows: usize::MAX,
            ..NativeWeights::detect()
        },
    )?;
    let (kl, top1) = accuracy(fe, &int.engine, &prompts)?;
    drop(int);
    let positions: usize = prompts.iter().map(Vec::len).sum();
    println!(
        "1. native vs f32 over {positions} positions: mean KL {kl:.5} nats, top-1 agreement {:.1}%",
        top1 * 100.0
    );
    rows.push(
        Row::new("p10 KL(f32 || native), same Q4_1 weights", kl, "nats")
            .predicted("~1e-3 (8-bit activations)"),
    );
    rows.push(Row::new("p10 top-1 agreement native vs f32", top1 * 100.0, "%").predicted("> 95%"));

    // 2. Speeds, f32 vs native vs llama.cpp.
    let bytes_nat = bytes_per_token(ne) as f64;
    let bytes_f32 = bytes_per_token(fe) as f64;
    let (dec_f_runs, step_f) =
        p05_kv_cache::bench::decode_profile(fe, common::numbers::MIN_SAMPLES)?;
    // The ceiling the native decode is read against, measured right before
    // and right after it (this VM's bandwidth moves between phases; one
    // measurement elsewhere in the run can land in a slow one).
    let bw_before = p02_read_bandwidth(threads);
    let (dec_n_runs, step_n) =
        p05_kv_cache::bench::decode_profile(ne, common::numbers::MIN_SAMPLES)?;
    let bw_after = p02_read_bandwidth(threads);
    let med = |v: &[f64]| common::stats::summarize(v).median;
    let (dec_f, dec_n) = (med(&dec_f_runs), med(&dec_n_runs));
    // Prefill in interleaved pairs: one prefill cell moves 10–30% between
    // runs on this VM, more than the difference being measured.
    let pairs256 = prefill_pairs(fe, ne, 256, 7)?;
    let pairs1k = prefill_pairs(fe, ne, 1024, 3)?;
    let (pre_f, pre_n, pre_ratio) = (
        med(&pairs256.f32),
        med(&pairs256.native),
        med(&pairs256.ratio),
    );
    let (pre1k_f, pre1k_n, pre1k_ratio) =
        (med(&pairs1k.f32), med(&pairs1k.native), med(&pairs1k.ratio));
    println!("2. decode tok/s: f32 {dec_f:.1}, native {dec_n:.1}; prefill 256: f32 {pre_f:.0}, native {pre_n:.0} (median native/f32 of 7 interleaved pairs {pre_ratio:.2}); prefill 1024: f32 {pre1k_f:.0}, native {pre1k_n:.0} (of 3 pairs {pre1k_ratio:.2})");
    println!(
        "   decode step (3 x 128 steps): f32 median {:.2} ms, p95 {:.2} ms; native median {:.2} ms, p95 {:.2} ms",
        step_f.median * 1e3,
        step_f.p95 * 1e3,
        step_n.median * 1e3,
        step_n.p95 * 1e3
    );
    rows.extend(Row::rates_median_p5(
        "p10 decode f32, 128 after 16",
        &dec_f_runs,
        "tok/s",
        "",
    ));
    for (path, st) in [("f32", &step_f), ("native", &step_n)] {
        let metric = format!("p10 decode step {path}, 3 x 128 after 16");
        rows.push(Row::new(format!("{metric}, median"), st.median * 1e3, "ms"));
        rows.push(Row::new(format!("{metric}, p95"), st.p95 * 1e3, "ms"));
    }
    rows.extend(Row::rates_median_p5(
        "p10 decode native, 128 after 16",
        &dec_n_runs,
        "tok/s",
        format!(
            "~{:.1}x f32 (bytes {:.0} vs {:.0} MB)",
            bytes_f32 / bytes_nat,
            bytes_nat / 1e6,
            bytes_f32 / 1e6
        ),
    ));
    for (n, pairs, pred) in [
        (
            256,
            &pairs256,
            ">= 1.0 (target; weights expanded inside p02's loop)",
        ),
        (1024, &pairs1k, ""),
    ] {
        rows.extend(Row::rates_median_p5(
            format!("p10 prefill f32, {n}"),
            &pairs.f32,
            "tok/s",
            "",
        ));
        rows.extend(Row::rates_median_p5(
            format!("p10 prefill native, {n}"),
            &pairs.native,
            "tok/s",
            if n == 256 { ">= f32 (target)" } else { "" },
        ));
        let r = common::stats::summarize(&pairs.ratio);
        rows.extend(Row::median_p95(
            format!(
                "p10 prefill {n} native / f32, per-pair ratio of {} interleaved pairs",
                pairs.ratio.len()
            ),
            r.median,
            r.p95,
            "x",
            pred,
        ));
    }
    if !a.no_peer {
        // Before timing llama.cpp: how far do its greedy tokens agree with
        // ours? Its Q4_1 path quantises activations to 8 bits, as our
        // native path does, so native should follow it longer than f32.
        let python = common::assets::workspace_root().join(".venv-peer/bin/python");
        match p05_kv_cache::bench::peer(&python, "llamacpp") {
            Ok(run) => {
                for (label, e) in [("native", ne), ("f32", fe)] {
                    let ours = p05_kv_cache::bench::greedy_ids(e, run.greedy.len())?;
                    rows.extend(p05_kv_cache::bench::agreement_rows(
                        &format!("p10 greedy agreement {label} vs {}", run.name),
                        &ours,
                        &run.greedy,
                        if label == "native" {
                            "most or all (both Q4_1 weights with 8-bit activations; block-sum order differs)"
                        } else {
                            "fewer (f32 activations leave llama.cpp's path after some tokens)"
                        },
                    ));
                }
            }
            Err(e) => println!("   greedy agreement with llama.cpp skipped (needs .venv-peer, see p05's README): {e:#}"),
        }
        match llama_bench(&a.llamacpp, &path, threads) {
            Ok((pp256_runs, pp1k_runs, tg_runs)) => {
                let (pp256, pp1k, tg) = (med(&pp256_runs), med(&pp1k_runs), med(&tg_runs));
                println!("   llama.cpp: decode {tg:.1}, prefill 256 {pp256:.0}, 1024 {pp1k:.0}; native / llama.cpp decode {:.2}x", dec_n / tg);
                rows.extend(Row::rates_median_p5(
                    "p10 llama.cpp decode tg128",
                    &tg_runs,
                    "tok/s",
                    "",
                ));
                rows.extend(Row::rates_median_p5(
                    "p10 llama.cpp prefill pp256",
                    &pp256_runs,
                    "tok/s",
                    "",
                ));
                rows.extend(Row::rates_median_p5(
                    "p10 llama.cpp prefill pp1024",
                    &pp1k_runs,
                    "tok/s",
                    "",
                ));
                rows.push(
                    Row::new(
                        "p10 decode native / llama.cpp (ratio of medians)",
                        dec_n / tg,
                        "x",
                    )
                    .predicted(">= 1.0x (target), 1.5x (stretch)"),
                );
                rows.push(Row::new(
                    "p10 prefill 256 native / llama.cpp (ratio of medians)",
                    pre_n / pp256,
                    "x",
                ));
            }
            Err(e) => println!("   llama.cpp skipped: {e:#}"),
        }
    }

    // 3. The decode step's time split.
    for (name, e) in [("f32", fe), ("native", ne)] {
        let parts = p05_kv_cache::bench::breakdown(e, 80)?;
        let line: Vec<String> = parts
            .iter()
            .map(|p| format!("{}: {:.2} ms", p.label, p.median_s * 1e3))
            .collect();
        println!("3. {name} decode step at position 80: {}", line.join("; "));
        for p in parts {
            rows.extend(p.rows(&format!("p10 decode split {name}")));
        }
    }

    // 4. GEMV per shape and format, against the read bandwidth: the
    // highest of three measurements in this run (before and after the
    // native decode, and now), so a slow phase cannot flatter the ratio.
    let bw_now = p02_read_bandwidth(threads);
    let bw = bw_before.max(bw_after).max(bw_now);
    let limit = bw * 1e9 / bytes_nat;
    println!("4. read bandwidth {bw:.1} GB/s ({threads} threads; best of {bw_before:.1} before the native decode, {bw_after:.1} after, {bw_now:.1} now): a native token ({:.1} MB) at most {limit:.0} tok/s; decode reaches {:.0}%", bytes_nat / 1e6, dec_n / limit * 100.0);
    for (when, v) in [
        ("before the native decode", bw_before),
        ("after the native decode", bw_after),
        ("at the GEMV phase", bw_now),
    ] {
        rows.push(Row::new(
            format!("p10 read bandwidth 256 MB {threads}t (best of 3), {when}"),
            v,
            "GB/s",
        ));
    }
    rows.push(Row::new(
        format!("p10 read bandwidth 256 MB {threads}t (best of 3), the highest (the limit's denominator)"),
        bw,
        "GB/s",
    ));
    rows.push(Row::new(
        "p10 bytes per token native",
        bytes_nat / 1e6,
        "MB",
    ));
    rows.push(Row::new("p10 bytes per token f32", bytes_f32 / 1e6, "MB"));
    rows.push(
        Row::new(
            "p10 decode native / bandwidth limit",
            dec_n / limit * 100.0,
            "%",
        )
        .predicted(">= 60% (target)"),
    );
    let (fp, np) = (projections(fe), projections(ne));
    let mut curves = [Vec::new(), Vec::new()];
    for kind in ["q", "k", "gate", "down", "head"] {
        let i = fp.iter().position(|(k, _)| *k == kind).unwrap_or(0);
        for (c, (name, p)) in [("f32", fp[i].1), ("native", np[i].1)]
            .into_iter()
            .enumerate()
        {
            let timing = gemv_seconds(p, threads);
            let s = timing.median;
            let bytes = p.weights().weight_bytes() as f64;
            let gbs = bytes / s / 1e9;
            let flops = 2.0 * (p.in_features() * p.out_features()) as f64 / s / 1e9;
            println!(
                "   {kind:>4} {}x{} {:>9}: {:8.1} us {gbs:6.1} GB/s {flops:6.1} GFLOP/s",
                p.out_features(),
                p.in_features(),
                p.weights().format(),
                s * 1e6
            );
            rows.extend(Row::rate_median_p95(
                format!(
                    "p10 GEMV {kind} {}x{} {name} ({})",
                    p.out_features(),
                    p.in_features(),
                    p.weights().format()
                ),
                bytes / 1e9,
                &timing,
                "GB/s",
                "",
            ));
            curves[c].push((bytes / 1e6, gbs));
        }
    }
    let dir = common::assets::workspace_root().join("p10_quant/plots");
    std::fs::create_dir_all(&dir)?;
    let bw_line: Vec<(f64, f64)> = curves.iter().flatten().map(|&(mb, _)| (mb, bw)).collect();
    line_chart(
        &dir.join("gemv_bandwidth.png"),
        Labels {
            title: "GEMV on SmolLM2's shapes: GB/s of weights read vs weight size",
            x: "weights (MB, log)",
            y: "GB/s",
        },
        &[
            Series::new("f32 packed", sorted(&curves[0])),
            Series::new("native (Q4_1; Q8_0 head)", sorted(&curves[1])),
            Series::new("read bandwidth (p02)", sorted(&bw_line)),
        ],
        Scale::LogX,
    )
    .map_err(anyhow::Error::msg)?;

    // 5. Memory at rest.
    let (rss_f, rss_n) = (child_rss(&a.model, "f32")?, child_rss(&a.model, "native")?);
    println!("5. resident after load: f32 {rss_f:.0} MB, native {rss_n:.0} MB");
    rows.push(Row::new("p10 RSS after load f32", rss_f, "MB"));
    rows.push(Row::new("p10 RSS after load native", rss_n, "MB"));

    if !a.no_record {
        Recorder::for_workspace(command_line("p10_quant"))
            .machine_note(&format!("kernels {isa}"))
            .append(&rows)?;
    }
    Ok(())
}

fn sorted(v: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

fn p02_read_bandwidth(threads: usize) -> f64 {
    p02_matmul_bench::ceilings::read_bandwidth(256 << 20, threads)
}

/// Prefill tok/s per pair, f32 and native, and the per-pair ratios.
#[derive(Clone, Debug, Default)]
struct Pairs {
    f32: Vec<f64>,
    native: Vec<f64>,
    ratio: Vec<f64>,
}

/// Prefill tok/s of `n` tokens, f32 and native alternately (each going
/// first in turn) for `pairs` rounds (each a median of 3, p05's
/// `prefill_speed`), with the per-pair ratios native / f32.
fn prefill_pairs(fe: &LlamaEngine, ne: &LlamaEngine, n: usize, pairs: usize) -> Result<Pairs> {
    let mut out = Pairs::default();
    for pair in 0..pairs {
        // The two paths take turns going first.
        let (a, b) = if pair % 2 == 0 {
            let a = p05_kv_cache::bench::prefill_speed(fe, n)?;
            (a, p05_kv_cache::bench::prefill_speed(ne, n)?)
        } else {
            let b = p05_kv_cache::bench::prefill_speed(ne, n)?;
            (p05_kv_cache::bench::prefill_speed(fe, n)?, b)
        };
        out.f32.push(a);
        out.native.push(b);
        out.ratio.push(b / a);
    }
    Ok(out)
}
