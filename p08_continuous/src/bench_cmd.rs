//! `p08_continuous bench-budget`: the step-time model behind the default
//! token budget. A mixed step carries `d` decode tokens (sequences at
//! position 256) and one prefill chunk of `c` tokens; its time is close to
//! linear in c: t(d, c) ≈ t(d, 0) + k_d · c. While a long prompt is being
//! prefilled, each running stream's inter-token latency is t(d, c) instead
//! of t(d, 0); keeping that within 2× the steady state bounds the chunk at
//! c ≤ t(d, 0) / k_d. The scheduler's [`StepCost`] is that model in units of
//! one prompt token: t(d, c) = k (fixed + decode·d + c), fitted here.
//!
//! [`StepCost`]: crate::scheduler::StepCost
//!
//! The serving comparison is in [`crate::serve_bench`].

use std::time::Duration;

use anyhow::Result;
use clap::Args;
use common::batch::{Batch, BatchModel};
use common::numbers::{command_line, Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use common::stats::{time_it, BenchConfig, Summary};
use p05_kv_cache::kv_cache::KvCache;
use p05_kv_cache::llama_engine::LlamaEngine;
use p07_batching::bench::decode_stores;
pub use p07_batching::bench_cmd::load_model;

pub use crate::serve_bench::{serve, ServeArgs};

#[derive(Clone, Debug, Args)]
pub struct BudgetArgs {
    /// `smollm2` or a model path.
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Decode tokens in the step (running streams).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub decodes: Vec<usize>,
    /// Prefill-chunk sizes.
    #[arg(long, value_delimiter = ',', default_value = "0,16,32,64,128,256,512")]
    pub chunks: Vec<usize>,
    /// The streams' position.
    #[arg(long, default_value_t = 256)]
    pub pos: usize,
    /// Timed steps per point (median and p95 reported).
    #[arg(long, default_value_t = 7)]
    pub samples: usize,
    /// The allowed slow-down of a running stream's step while a prompt is prefilled.
    #[arg(long, default_value_t = 2.0)]
    pub itl_factor: f64,
    /// Where the late chunk of the attention-cost measurement starts.
    #[arg(long, default_value_t = 2016)]
    pub far: usize,
    #[arg(long)]
    pub no_record: bool,
}

pub fn plots_dir() -> std::path::PathBuf {
    common::assets::workspace_root().join("p08_continuous/plots")
}

/// Seconds of one step (median, p95, ... over `samples`) with `d` decode
/// tokens at `pos` and a prefill chunk of `c` tokens at positions
/// `chunk_at..chunk_at + c`.
pub fn step_time(
    engine: &LlamaEngine,
    d: usize,
    c: usize,
    chunk_at: usize,
    pos: usize,
    samples: usize,
) -> Result<Summary> {
    let s = engine.kv_shape();
    let vocab = engine.model.cfg.vocab_size;
    let mut kv = decode_stores(engine, d, pos);
    let mut b = Batch::new();
    for i in 0..d {
        b.push(&[100 + i as u32], pos)?;
    }
    if c > 0 {
        // The earlier positions' values do not change the cost.
        let mut chunk_kv = KvCache::new(s.n_layer, s.n_kv_head, s.head_dim, chunk_at + c);
        chunk_kv.set_len(chunk_at).expect("chunk_at < chunk_at + c");
        kv.push(chunk_kv);
        let chunk: Vec<u32> = (0..c).map(|i| 200 + (i % 1000) as u32).collect();
        b.push(&chunk, chunk_at)?;
    }
    let mut ws = engine.new_workspace();
    let mut logits = vec![0.0f32; kv.len() * vocab];
    let mut failed = None;
    let cfg = BenchConfig {
        warmup_iters: 1,
        min_samples: samples,
        min_time: Duration::ZERO,
        max_samples: samples,
    };
    let t = time_it(cfg, || {
        let mut refs: Vec<&mut KvCache> = kv.iter_mut().collect();
        if let Err(e) = engine.forward_batch(&b, &mut refs, &mut ws, &mut logits) {
            failed = Some(e);
        }
        for (i, s) in kv.iter_mut().enumerate() {
            s.set_len(if i < d { pos } else { chunk_at })
                .expect("each store was made with room");
        }
    });
    if let Some(e) = failed {
        return Err(e.into());
    }
    Ok(t)
}

/// Least-squares line through (x, y): (intercept, slope).
fn fit(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    let (sx, sy) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let (sxy, sxx) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| {
        (a + (x - mx) * (y - my), b + (x - mx) * (x - mx))
    });
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    (my - slope * mx, slope)
}

pub fn budget(a: &BudgetArgs) -> Result<()> {
    let (engine, _) = load_model(&a.model)?;
    println!(
        "step time (ms) with d decode tokens at position {} and a prefill chunk of c tokens; {} threads",
        a.pos, engine.model.threads
    );
    print!("{:>4}", "d");
    for c in &a.chunks {
        print!(" {:>8}", format!("c={c}"));
    }
    println!(" {:>9} {:>10} {:>8}", "k ms/tok", "max chunk", "budget");
    let mut rows = Vec::new();
    let mut series = Vec::new();
    let mut decode_only = Vec::new();
    let mut ks = Vec::new();
    for &d in &a.decodes {
        let mut pts = Vec::new();
        print!("{d:>4}");
        for &c in &a.chunks {
            let s = step_time(&engine, d, c, 0, a.pos, a.samples)?;
            let t = s.median;
            print!(" {:>8.1}", t * 1e3);
            pts.push((c as f64, t * 1e3));
            rows.extend(Row::median_p95(
                format!("p08 step time, {d} decodes + {c}-token chunk"),
                t * 1e3,
                s.p95 * 1e3,
                "ms",
                "",
            ));
        }
        let t0 = pts.iter().find(|p| p.0 == 0.0).map_or(pts[0].1, |p| p.1);
        let (_, k) = fit(&pts);
        decode_only.push((d as f64, t0));
        ks.push(k);
        let max_chunk = (a.itl_factor - 1.0) * t0 / k.max(1e-9);
        let budget = ((d as f64 + max_chunk) / 16.0).floor() as usize * 16;
        println!(" {k:>9.3} {max_chunk:>10.0} {budget:>8}");
        rows.push(Row::new(
            format!("p08 prefill cost per chunk token beside {d} decodes (fit to medians)"),
            k,
            "ms/token",
        ));
        rows.push(
            Row::new(
                format!(
                    "p08 token budget for ITL <= {}x steady, {d} streams",
                    a.itl_factor
                ),
                budget as f64,
                "tokens",
            )
            .predicted(format!("d + (factor-1) t(d,0)/k = {d} + {max_chunk:.0}")),
        );
        series.push(Series::new(format!("{d} decodes"), pts));
    }
    // The model in prompt-token units: t(d, 0) = a + b d, k = mean slope.
    let (a0, b) = fit(&decode_only);
    let k = ks.iter().sum::<f64>() / ks.len().max(1) as f64;
    let (fixed, decode) = (a0 / k, b / k);
    println!(
        "step-time model: t(d, c) = {k:.2} ms x ({fixed:.1} + {decode:.2} d + c)  ->  --step-fixed-tokens {fixed:.1} --step-decode-tokens {decode:.2}"
    );
    // A chunk late in a long prompt pays for its attention over every
    // earlier key: the same chunk at position `far` vs at 0, beside 4 decodes.
    let (c, far) = (32, a.far);
    let near_t = step_time(&engine, 4, c, 0, a.pos, a.samples)?.median * 1e3;
    let far_s = step_time(&engine, 4, c, far, a.pos, a.samples)?;
    let far_t = far_s.median * 1e3;
    let extra_per_token = (far_t - near_t) / (c as f64 * k); // prompt-token units
    let attn_positions = far as f64 / extra_per_token.max(1e-9);
    println!(
        "a {c}-token chunk at position {far}: {far_t:.1} ms vs {near_t:.1} at 0 -> attention costs a prompt token's work at position ~{attn_positions:.0}  ->  --step-attn-positions {attn_positions:.0}"
    );
    rows.extend(Row::median_p95(
        format!("p08 step time, 4 decodes + {c}-token chunk at position {far}"),
        far_t,
        far_s.p95 * 1e3,
        "ms",
        "",
    ));
    rows.push(Row::new(
        "p08 step cost: position where a prompt token's attention doubles its cost (fit)",
        attn_positions,
        "positions",
    ));
    let cost = crate::scheduler::StepCost {
        itl_factor: a.itl_factor,
        fixed_tokens: fixed,
        decode_tokens: decode,
        attn_positions,
    };
    for &d in &a.decodes {
        let units = cost.prefill_units(d);
        println!(
            "  {d} streams decoding, itl_factor {}: a chunk of {} tokens at position 0, {} at {far}",
            a.itl_factor,
            cost.chunk_tokens(0, units),
            cost.chunk_tokens(far, units),
        );
    }
    rows.push(Row::new(
        "p08 step cost: fixed part in prompt tokens (fit)",
        fixed,
        "tokens",
    ));
    rows.push(Row::new(
        "p08 step cost: one decode token in prompt tokens (fit)",
        decode,
        "tokens",
    ));
    line_chart(
        &plots_dir().join("step_time_vs_chunk.png"),
        Labels {
            title: "SmolLM2 step time vs prefill-chunk size",
            x: "prefill chunk (tokens)",
            y: "step time (ms)",
        },
        &series,
        Scale::Linear,
    )
    .map_err(anyhow::Error::msg)?;
    if !a.no_record {
        Recorder::for_workspace(command_line("p08_continuous")).append(&rows)?;
    }
    Ok(())
}
