//! `p04_transformer bench`: full-sequence forward time vs sequence length with
//! the attention share, FLOPs predicted vs achieved, and naive (no-cache)
//! generation speed; plot and numbers.md rows.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use common::numbers::{Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use common::stats::{time_it, BenchConfig};

use crate::llama::{Llama, Profile};
use crate::model::Transformer;

/// FLOPs of one full forward over `t` tokens: 2 per multiply-add of every
/// weight matrix (head included) per token, plus causal attention
/// (QK^T and PV: 2 x 2 x width x t(t+1)/2 per layer).
pub fn predicted_flops(m: &Llama, t: usize) -> f64 {
    let c = &m.cfg;
    let d = c.hidden_size as f64;
    let per_layer = d * (c.n_head * c.head_dim) as f64 * 2.0 // q, o
        + d * (c.n_kv_head * c.head_dim) as f64 * 2.0 // k, v
        + d * c.intermediate_size as f64 * 3.0; // gate, up, down
    let weights = c.n_layer as f64 * per_layer + d * c.vocab_size as f64;
    let t = t as f64;
    2.0 * weights * t + 2.0 * d * c.n_layer as f64 * t * (t + 1.0)
}

pub fn run(model: &Transformer, seqs: &[usize], record: bool, command: &str) -> Result<()> {
    let Transformer::Llama(m) = model else {
        anyhow::bail!("bench runs on a Llama-family model (a GGUF file)")
    };
    let mut rows = Vec::new();
    let (mut total_pts, mut att_pts) = (Vec::new(), Vec::new());
    println!(
        "{:>6} {:>12} {:>10} {:>12} {:>14}",
        "seq", "forward", "attention", "GFLOP/s", "pred. GFLOP"
    );
    for &t in seqs {
        if t > m.cfg.max_seq {
            continue;
        }
        let ids: Vec<u32> = (0..t)
            .map(|i| (100 + 37 * i as u32) % m.cfg.vocab_size as u32)
            .collect();
        let cfg = if t <= 256 {
            BenchConfig {
                warmup_iters: 1,
                min_samples: 3,
                min_time: Duration::ZERO,
                max_samples: 3,
            }
        } else {
            BenchConfig {
                warmup_iters: 0,
                min_samples: 2,
                min_time: Duration::ZERO,
                max_samples: 2,
            }
        };
        let mut prof = Profile::default();
        let mut calls = 0u32;
        let s = time_it(cfg, || {
            std::hint::black_box(
                m.forward_profiled(&ids, 1, t, &mut prof)
                    .expect("valid ids"),
            );
            calls += 1;
        });
        let att = prof.attention.as_secs_f64() / f64::from(calls);
        let flops = predicted_flops(m, t);
        let share = 100.0 * att / s.median;
        println!(
            "{t:>6} {:>9.1} ms {:>9.0}% {:>12.1} {:>14.2}",
            s.median * 1e3,
            share,
            flops / s.median / 1e9,
            flops / 1e9
        );
        total_pts.push((t as f64, s.median * 1e3));
        att_pts.push((t as f64, att * 1e3));
        rows.extend(Row::median_p95(
            format!("p04 smollm2 forward seq={t}"),
            s.median * 1e3,
            s.p95 * 1e3,
            "ms",
            match t {
                16 => "~45 ms (8.6 GFLOP at ~100 GFLOP/s, small M)",
                1024 => "~4-6 s (275 GFLOP matmuls + 36 GFLOP attention at ~10 GFLOP/s)",
                _ => "",
            },
        ));
        rows.push(
            Row::new(format!("p04 smollm2 attention share seq={t}"), share, "%")
                .predicted(if t == 1024 { "> 50%" } else { "" }),
        );
        rows.extend(Row::rate_median_p95(
            format!("p04 smollm2 achieved seq={t}"),
            flops / 1e9,
            &s,
            "GFLOP/s",
            "",
        ));
    }
    // Naive generation: 32 tokens after a 16-token prompt, recomputing everything each step.
    let prompt: Vec<u32> = (0..16).map(|i| 100 + 37 * i).collect();
    let (_, stats) = crate::generate::greedy(model, &prompt, 32, None, |_| {})?;
    println!(
        "\nnaive greedy generation (no KV cache), 16-token prompt, 32 new tokens: {:.2} tok/s",
        stats.tok_per_s()
    );
    rows.push(
        Row::new(
            "p04 smollm2 naive generation 16+32 tokens, whole run (one generation)",
            stats.tok_per_s(),
            "tok/s",
        )
        .predicted("~10-20 tok/s (each step is a 16..47-token forward)"),
    );

    let png = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("plots/forward_vs_seq.png");
    let labels = Labels {
        title: "SmolLM2-135M full forward (f32, no cache) vs sequence length",
        x: "sequence length (tokens)",
        y: "ms per forward",
    };
    line_chart(
        &png,
        labels,
        &[
            Series::new("whole forward", total_pts),
            Series::new("attention part", att_pts),
        ],
        Scale::LogLog,
    )
    .map_err(anyhow::Error::msg)?;
    println!("plot: {}", png.display());
    if record {
        Recorder::for_workspace(command).append(&rows)?;
        println!("appended {} rows to numbers.md", rows.len());
    }
    Ok(())
}
