//! The two bench commands: tables on stdout, rows in numbers.md, plots in
//! `p07_batching/plots/`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use common::loadgen::Arrival;
use common::numbers::{command_line, Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use common::stats::{summarize, Summary};
use p05_kv_cache::llama_engine::LlamaEngine;

use crate::bench::{matmul_params, measure, StepPoint};
use crate::serve_bench::{drive, late_arrivals, requests, Engines};
use crate::BatchConfig;

#[derive(Clone, Debug, Args)]
pub struct StepArgs {
    /// `smollm2` or a model path.
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    pub batches: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "64,512")]
    pub positions: Vec<usize>,
    /// Timed steps per point (median and p95 reported).
    #[arg(long, default_value_t = 5)]
    pub samples: usize,
    #[arg(long)]
    pub no_record: bool,
}

/// SmolLM2 (`smollm2`) or a model path, with its tokenizer: what the bench
/// commands of p07 and later load.
pub fn load_model(spec: &str) -> Result<(LlamaEngine, p04_transformer::Tokenizer)> {
    let path = p06_server::load::resolve_model(spec).map_err(anyhow::Error::msg)?;
    let loaded = p05_kv_cache::load::load(&path).with_context(|| path.display().to_string())?;
    let tok = loaded.tokenizer.context("the model has no tokenizer")?;
    Ok((loaded.engine, tok))
}

fn plots_dir() -> std::path::PathBuf {
    common::assets::workspace_root().join("p07_batching/plots")
}

pub fn step(a: &StepArgs) -> Result<()> {
    let (engine, _) = load_model(&a.model)?;
    let threads = engine.model.threads;
    let params = matmul_params(&engine);
    let weight_bytes = params * 4;
    // The roofline of this machine, measured now: a step takes at least
    // max(weights / bandwidth, 2 params B / peak); the batch where the two
    // meet is where it turns compute-bound.
    let (peak_gflops, simd) = p02_matmul_bench::ceilings::peak_gflops(threads);
    let bw_gbs = p02_matmul_bench::ceilings::read_bandwidth(weight_bytes, threads);
    let knee = 2.0 * peak_gflops / bw_gbs;
    println!(
        "weights {:.0} MB f32, {threads} threads: peak {peak_gflops:.1} GFLOP/s ({simd}), read bandwidth {bw_gbs:.1} GB/s -> compute-bound from batch ~{knee:.0}",
        weight_bytes as f64 / 1e6
    );
    let predict = |b: usize| -> f64 {
        let t = (weight_bytes as f64 / (bw_gbs * 1e9))
            .max(2.0 * params as f64 * b as f64 / (peak_gflops * 1e9));
        b as f64 / t
    };
    println!(
        "{:>5} {:>5} {:>11} {:>11} {:>12} {:>12} {:>8} {:>9} {:>8} {:>9}",
        "pos",
        "batch",
        "step ms",
        "single ms",
        "tok/s batch",
        "tok/s single",
        "vs b=1",
        "predicted",
        "GB/s",
        "GFLOP/s"
    );
    let mut points: Vec<StepPoint> = Vec::new();
    let mut rows = Vec::new();
    for &pos in &a.positions {
        let mut base = None;
        for &b in &a.batches {
            let p = measure(&engine, b, pos, a.samples)?;
            let b1 = *base.get_or_insert(p.batched_tok_per_s());
            println!(
                "{:>5} {:>5} {:>11.1} {:>11.1} {:>12.1} {:>12.1} {:>7.2}x {:>9.1} {:>8.1} {:>9.1}",
                pos,
                b,
                p.batched_s * 1e3,
                p.single_s * 1e3,
                p.batched_tok_per_s(),
                p.single_tok_per_s(),
                p.batched_tok_per_s() / b1,
                predict(b),
                p.bytes / p.batched_s / 1e9,
                p.flops / p.batched_s / 1e9,
            );
            rows.extend(Row::rate_median_p95(
                format!("p07 batched decode pos {pos} batch {b}"),
                b as f64,
                &p.batched,
                "tok/s",
                format!("{:.0} (roofline)", predict(b)),
            ));
            rows.extend(Row::rate_median_p95(
                format!("p07 single-sequence decode pos {pos} (beside batch {b})"),
                1.0,
                &p.single,
                "tok/s",
                "",
            ));
            if b > 1 {
                let target = match b {
                    8 => " (target >= 4x)",
                    16 => " (target >= 6x)",
                    _ => "",
                };
                rows.push(
                    Row::new(
                        format!(
                            "p07 batch {b} / batch 1 decode tok/s, pos {pos} (ratio of medians)"
                        ),
                        p.batched_tok_per_s() / b1,
                        "x",
                    )
                    .predicted(format!("{:.1}x{target}", predict(b) / predict(1))),
                );
            }
            points.push(p);
        }
    }
    rows.push(Row::new(
        "p07 roofline knee (2 peak / bandwidth)",
        knee,
        "batch",
    ));
    let mut series = Vec::new();
    for &pos in &a.positions {
        let pts = |f: fn(&StepPoint) -> f64| -> Vec<(f64, f64)> {
            points
                .iter()
                .filter(|p| p.pos == pos)
                .map(|p| (p.batch as f64, f(p)))
                .collect()
        };
        // Bars: from the rate at the p95 step time up to the median's.
        let spread = |f: fn(&StepPoint) -> (f64, Summary)| -> Vec<(f64, f64, f64)> {
            points
                .iter()
                .filter(|p| p.pos == pos)
                .map(|p| {
                    let (tokens, s) = f(p);
                    (p.batch as f64, tokens / s.p95, tokens / s.median)
                })
                .collect()
        };
        series.push(
            Series::new(
                format!("batched step, pos {pos} (bars: median to p95)"),
                pts(StepPoint::batched_tok_per_s),
            )
            .with_spread(spread(|p| (p.batch as f64, p.batched))),
        );
        series.push(
            Series::new(
                format!("single-sequence steps, pos {pos}"),
                pts(StepPoint::single_tok_per_s),
            )
            .with_spread(spread(|p| (1.0, p.single))),
        );
    }
    series.push(Series::new(
        "roofline prediction",
        a.batches.iter().map(|&b| (b as f64, predict(b))).collect(),
    ));
    line_chart(
        &plots_dir().join("step_tok_per_s.png"),
        Labels {
            title: "SmolLM2 decode: aggregate tok/s vs batch size",
            x: "batch size",
            y: "tokens / s",
        },
        &series,
        Scale::LogLog,
    )
    .map_err(anyhow::Error::msg)?;
    if !a.no_record {
        Recorder::for_workspace(command_line("p07_batching")).append(&rows)?;
    }
    Ok(())
}

#[derive(Clone, Debug, Args)]
pub struct ServeBenchArgs {
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Closed-loop comparison: prompt and output tokens, concurrency, requests.
    #[arg(long, default_value_t = 256)]
    pub input_len: usize,
    #[arg(long, default_value_t = 64)]
    pub output_len: usize,
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    #[arg(long, default_value_t = 16)]
    pub num_requests: usize,
    /// Requests per side and round of the idle-engine TTFT check (closed loop, c=1).
    #[arg(long, default_value_t = 12)]
    pub idle_requests: usize,
    /// Requests per side at 0.1 req/s (Poisson; 10 s apart on average).
    #[arg(long, default_value_t = 6)]
    pub slow_requests: usize,
    /// Poisson rate and requests per point of the wait x batch sweep (0 skips it).
    #[arg(long, default_value_t = 0.6)]
    pub sweep_rate: f64,
    #[arg(long, default_value_t = 24)]
    pub sweep_requests: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[arg(long)]
    pub no_record: bool,
}

fn batching(max_batch: usize, max_wait_ms: u64) -> BatchConfig {
    BatchConfig {
        max_batch,
        max_wait: Duration::from_millis(max_wait_ms),
        max_waiting: 1024,
    }
}

pub async fn serve(a: &ServeBenchArgs) -> Result<()> {
    let (engine, tok) = load_model(&a.model)?;
    let e = Engines {
        model: Arc::new(engine),
        tok: Arc::new(tok),
        name: p06_server::load::served_name(&a.model),
    };
    let name = e.name.clone();
    let mut rows = Vec::new();
    let warm = requests(&e.tok, 16, &[4], a.seed + 100)?;

    // 1. Closed loop at concurrency 8: serial, then batcher, same requests.
    let reqs = requests(
        &e.tok,
        a.input_len,
        &vec![a.output_len; a.num_requests],
        a.seed,
    )?;
    let closed = Arrival::Closed {
        concurrency: a.concurrency,
    };
    let (serial, _) = drive(e.serial()?, &name, closed, &warm, &reqs).await?;
    let (batched, _) = drive(
        e.batching(batching(a.concurrency.max(16), 5))?,
        &name,
        closed,
        &warm,
        &reqs,
    )
    .await?;
    let ratio = batched.output_throughput / serial.output_throughput;
    println!(
        "closed loop c={} (in {} out {}): output tok/s serial {:.1}, batcher {:.1} = {ratio:.2}x; TTFT median {:.0} vs {:.0} ms",
        a.concurrency, a.input_len, a.output_len, serial.output_throughput, batched.output_throughput,
        serial.ttft.median, batched.ttft.median
    );
    let label = format!(
        "c={} in {} out {}",
        a.concurrency, a.input_len, a.output_len
    );
    rows.push(Row::new(
        format!("p07 serial (p06) output tok/s, whole run, {label}"),
        serial.output_throughput,
        "tok/s",
    ));
    rows.push(Row::new(
        format!("p07 batcher output tok/s, whole run, {label}"),
        batched.output_throughput,
        "tok/s",
    ));
    rows.push(
        Row::new(
            format!("p07 batcher / serial output tok/s, {label}"),
            ratio,
            "x",
        )
        .predicted(">= 3x (target)"),
    );

    // 2. An idle batcher must not wait. Closed loop at concurrency 1 (every
    //    request finds the engine idle), serial and batcher alternated
    //    A B A B; then the literal 0.1 req/s Poisson run.
    let reqs = requests(&e.tok, 64, &vec![8; a.idle_requests], a.seed + 1)?;
    let one = Arrival::Closed { concurrency: 1 };
    let (mut ttft_serial, mut ttft_batched) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        let (_, r) = drive(e.serial()?, &name, one, &warm, &reqs).await?;
        ttft_serial.extend(r.iter().map(|r| r.ttft * 1e3));
        let (_, r) = drive(e.batching(batching(16, 5))?, &name, one, &warm, &reqs).await?;
        ttft_batched.extend(r.iter().map(|r| r.ttft * 1e3));
    }
    let (ss, sb) = (summarize(&ttft_serial), summarize(&ttft_batched));
    let (ms, mb) = (ss.median, sb.median);
    println!(
        "idle engine (c=1, A B A B, {} requests a side): TTFT median serial {ms:.1} ms, batcher {mb:.1} ms (added {:+.2} ms); p95 {:.1} vs {:.1} ms",
        2 * a.idle_requests,
        mb - ms,
        ss.p95,
        sb.p95
    );
    rows.extend(Row::median_p95(
        "p07 serial (p06) TTFT, idle engine (c=1)",
        ms,
        ss.p95,
        "ms",
        "",
    ));
    rows.extend(Row::median_p95(
        "p07 batcher TTFT, idle engine (c=1)",
        mb,
        sb.p95,
        "ms",
        "",
    ));
    rows.push(
        Row::new(
            "p07 batcher added TTFT, idle engine (c=1) (difference of medians)",
            mb - ms,
            "ms",
        )
        .predicted("<= 1 ms (target)"),
    );
    if a.slow_requests > 0 {
        let reqs = requests(&e.tok, 64, &vec![8; a.slow_requests], a.seed + 4)?;
        let slow = Arrival::Poisson {
            rate: 0.1,
            seed: a.seed,
        };
        let (serial, _) = drive(e.serial()?, &name, slow, &warm, &reqs).await?;
        let (batched, _) = drive(e.batching(batching(16, 5))?, &name, slow, &warm, &reqs).await?;
        let added = batched.ttft.median - serial.ttft.median;
        println!(
            "0.1 req/s: TTFT median serial {:.1} ms, batcher {:.1} ms (added {added:+.2} ms)",
            serial.ttft.median, batched.ttft.median
        );
        rows.extend(Row::median_p95(
            "p07 serial (p06) TTFT at 0.1 req/s",
            serial.ttft.median,
            serial.ttft.p95,
            "ms",
            "",
        ));
        rows.extend(Row::median_p95(
            "p07 batcher TTFT at 0.1 req/s",
            batched.ttft.median,
            batched.ttft.p95,
            "ms",
            "",
        ));
        rows.push(
            Row::new(
                "p07 batcher added TTFT at 0.1 req/s (difference of medians)",
                added,
                "ms",
            )
            .predicted("<= 1 ms (target)"),
        );
    }

    // 3. max_wait_ms x max_batch under Poisson load.
    if a.sweep_rate > 0.0 && a.sweep_requests > 0 {
        let reqs = requests(&e.tok, 128, &vec![32; a.sweep_requests], a.seed + 2)?;
        let arrival = Arrival::Poisson {
            rate: a.sweep_rate,
            seed: a.seed,
        };
        println!("sweep at {} req/s, in 128 out 32:", a.sweep_rate);
        println!(
            "{:>9} {:>7} {:>8} {:>9} {:>9} {:>9} {:>9}",
            "max_batch", "wait ms", "req/s", "TTFT p50", "p95", "p99", "TPOT p50"
        );
        let mut series = Vec::new();
        for max_batch in [4usize, 8, 16] {
            let mut pts = Vec::new();
            for wait in [0u64, 5, 20] {
                let (r, _) = drive(
                    e.batching(batching(max_batch, wait))?,
                    &name,
                    arrival,
                    &warm,
                    &reqs,
                )
                .await?;
                println!(
                    "{max_batch:>9} {wait:>7} {:>8.2} {:>9.0} {:>9.0} {:>9.0} {:>9.1}",
                    r.request_throughput, r.ttft.median, r.ttft.p95, r.ttft.p99, r.tpot.median
                );
                let cfg = format!(
                    "max_batch {max_batch} max_wait_ms {wait} at {} req/s",
                    a.sweep_rate
                );
                rows.push(Row::new(
                    format!("p07 sweep req/s, whole run, {cfg}"),
                    r.request_throughput,
                    "req/s",
                ));
                rows.extend(Row::median_p95(
                    format!("p07 sweep TTFT, {cfg}"),
                    r.ttft.median,
                    r.ttft.p95,
                    "ms",
                    "",
                ));
                rows.push(Row::new(
                    format!("p07 sweep TTFT p99, {cfg}"),
                    r.ttft.p99,
                    "ms",
                ));
                rows.extend(Row::median_p95(
                    format!("p07 sweep TPOT, {cfg}"),
                    r.tpot.median,
                    r.tpot.p95,
                    "ms",
                    "",
                ));
                pts.push((wait as f64, r.ttft.p95));
            }
            series.push(Series::new(format!("max_batch {max_batch}: TTFT p95"), pts));
        }
        line_chart(
            &plots_dir().join("wait_batch_sweep.png"),
            Labels {
                title: "TTFT p95 vs max_wait_ms under Poisson load",
                x: "max_wait_ms",
                y: "TTFT p95 (ms)",
            },
            &series,
            Scale::Linear,
        )
        .map_err(anyhow::Error::msg)?;
    }

    // 4. Lock-step: a batch of 8 starts; 4 short requests arrive 1 s later
    //    and wait for it. All-short batch (16 tokens each) vs mixed (4 x 16
    //    and 4 x 256): the longest member sets the newcomers' wait.
    let delay = Duration::from_secs(1);
    let (ttft_short, empty_short) = late_arrivals(&e, &[16; 8], 4, delay, a.seed + 3).await?;
    let mixed = [16, 256, 16, 256, 16, 256, 16, 256];
    let (ttft_mixed, empty_mixed) = late_arrivals(&e, &mixed, 4, delay, a.seed + 3).await?;
    println!(
        "lock-step: newcomers' TTFT median {:.0} ms (p95 {:.0}) behind an all-short batch, {:.0} ms (p95 {:.0}) behind a mixed one; empty decode slots {:.0}% vs {:.0}%",
        ttft_short.median,
        ttft_short.p95,
        ttft_mixed.median,
        ttft_mixed.p95,
        100.0 * empty_short,
        100.0 * empty_mixed
    );
    rows.extend(Row::median_p95(
        "p07 lock-step: newcomer TTFT behind 8 x 16-token batch",
        ttft_short.median,
        ttft_short.p95,
        "ms",
        "",
    ));
    rows.extend(Row::median_p95(
        "p07 lock-step: newcomer TTFT behind 4 x 16 + 4 x 256-token batch",
        ttft_mixed.median,
        ttft_mixed.p95,
        "ms",
        "~ the 256-token members' decode time (~250 steps of batch 4-8)",
    ));
    rows.push(
        Row::new(
            "p07 lock-step: empty decode slots, 4 x 16 + 4 x 256 tokens",
            100.0 * empty_mixed,
            "%",
        )
        .predicted("47% (4 of 8 slots idle for 240 of 255 steps)"),
    );
    if !a.no_record {
        Recorder::for_workspace(command_line("p07_batching")).append(&rows)?;
    }
    Ok(())
}
