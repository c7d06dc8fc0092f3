//! `p05_kv_cache bench`: decode latency vs position with and without the
//! cache, prefill and decode speed beside transformers and llama.cpp, where
//! decode time goes; plot and numbers.md rows.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use common::numbers::{Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use common::stats::{summarize, time_it, BenchConfig, Summary};
use common::Model;

use crate::llama_engine::LlamaEngine;
use crate::sampling::argmax;

/// `n` fixed token ids (the benches' synthetic prompt).
pub fn ids(n: usize) -> Vec<u32> {
    (0..n).map(|i| ((100 + 37 * i) % 49152) as u32).collect()
}

/// Median seconds of one decode step at cache position `pos` (the cache is
/// sized and its length set directly: attention cost does not depend on the
/// cached values).
pub fn decode_latency(engine: &LlamaEngine, pos: usize) -> Result<f64> {
    let mut cache = engine.new_cache(pos + 2);
    let mut logits = vec![0.0f32; engine.model.cfg.vocab_size];
    engine.step(&[100], &mut cache, &mut logits)?; // sizes the buffers
    let cfg = BenchConfig {
        warmup_iters: 2,
        min_samples: 10,
        min_time: Duration::ZERO,
        max_samples: 10,
    };
    let s = time_it(cfg, || {
        cache.kv.len = pos;
        engine
            .step(&[101], &mut cache, &mut logits)
            .expect("room for one");
    });
    Ok(s.median)
}

/// (prefill tok/s on 256 tokens, decode tok/s for 128 tokens after 16), medians of 3.
pub fn speeds(engine: &LlamaEngine) -> Result<(f64, f64)> {
    let (mut pre, mut dec) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let p = ids(256);
        let t = Instant::now();
        let _ = engine.prefill(&p, 257)?;
        pre.push(256.0 / t.elapsed().as_secs_f64());
        let (mut logits, mut cache) = engine.prefill(&ids(16), 16 + 129)?;
        let t = Instant::now();
        for _ in 0..128 {
            let next = argmax(&logits);
            engine.decode(next, &mut cache, &mut logits)?;
        }
        dec.push(128.0 / t.elapsed().as_secs_f64());
    }
    Ok((summarize(&pre).median, summarize(&dec).median))
}

/// Decode of 128 tokens after a 16-token prompt, `runs` times: (median
/// over runs of tok/s, the summary of every step's seconds, so a timing
/// row can give the median and the p95 of a token's latency).
pub fn decode_profile(engine: &LlamaEngine, runs: usize) -> Result<(f64, Summary)> {
    let (mut rates, mut steps) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let (mut logits, mut cache) = engine.prefill(&ids(16), 16 + 129)?;
        let t = Instant::now();
        for _ in 0..128 {
            let s = Instant::now();
            let next = argmax(&logits);
            engine.decode(next, &mut cache, &mut logits)?;
            steps.push(s.elapsed().as_secs_f64());
        }
        rates.push(128.0 / t.elapsed().as_secs_f64());
    }
    Ok((summarize(&rates).median, summarize(&steps)))
}

/// Median prefill tok/s of `n` tokens over 3 runs.
pub fn prefill_speed(engine: &LlamaEngine, n: usize) -> Result<f64> {
    let mut s = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        let _ = engine.prefill(&ids(n), n + 1)?;
        s.push(n as f64 / t.elapsed().as_secs_f64());
    }
    Ok(summarize(&s).median)
}

/// Where one decode step's time goes at position `pos`: (label, seconds).
pub fn breakdown(engine: &LlamaEngine, pos: usize) -> Result<Vec<(&'static str, f64)>> {
    let m = &engine.model;
    let c = &m.cfg;
    let x = vec![0.1f32; c.hidden_size.max(c.intermediate_size)];
    let mut y = vec![0.0f32; c.vocab_size.max(c.intermediate_size)];
    let cfg = BenchConfig {
        warmup_iters: 2,
        min_samples: 10,
        min_time: Duration::ZERO,
        max_samples: 10,
    };
    let t = m.threads;
    let blocks = time_it(cfg, || {
        for b in &m.blocks {
            for p in [&b.wq, &b.wk, &b.wv, &b.wo, &b.w_gate, &b.w_up, &b.w_down] {
                p.apply_into(&x[..p.in_features()], 1, &mut y[..p.out_features()], t)
                    .expect("shapes");
            }
        }
    })
    .median;
    let head = time_it(cfg, || {
        m.lm_head
            .apply_into(&x[..c.hidden_size], 1, &mut y[..c.vocab_size], t)
            .expect("shapes")
    })
    .median;
    let total = decode_latency(engine, pos)?;
    let other = (total - blocks - head).max(0.0);
    Ok(vec![
        ("block projections (q,k,v,o,gate,up,down) x 30", blocks),
        ("lm_head (576 x 49152)", head),
        ("attention over the cache + norms + rest", other),
        ("whole decode step", total),
    ])
}

fn peer(python: &Path, which: &str) -> Result<(String, f64, f64)> {
    let root = common::assets::workspace_root();
    let out = Command::new(python)
        .arg(root.join("scripts/bench_p05_peers.py"))
        .args(["--peer", which])
        .env("OMP_NUM_THREADS", "2")
        .output()
        .with_context(|| format!("running the {which} peer"))?;
    if !out.status.success() {
        anyhow::bail!(
            "{which} peer failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or("");
    let v: serde_json::Value =
        serde_json::from_str(line).with_context(|| format!("{which} peer printed {line:?}"))?;
    Ok((
        format!("{which} {}", v["version"].as_str().unwrap_or("?")),
        v["prefill_tok_s"].as_f64().unwrap_or(f64::NAN),
        v["decode_tok_s"].as_f64().unwrap_or(f64::NAN),
    ))
}

pub fn run(
    engine: &LlamaEngine,
    _model_path: &Path,
    peers: bool,
    record: bool,
    command: &str,
) -> Result<()> {
    let m = &engine.model;
    let mut rows = Vec::new();
    println!("decode latency per token vs position (median of 10 steps; no cache = a full forward of pos+1 tokens)");
    let positions = [16usize, 32, 64, 128, 256, 512, 1024, 2048];
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for &pos in &positions {
        let cached = decode_latency(engine, pos)?;
        let full = if pos <= 1024 {
            let seq = ids(pos + 1);
            let cfg = if pos <= 256 {
                BenchConfig {
                    warmup_iters: 1,
                    min_samples: 3,
                    min_time: Duration::ZERO,
                    max_samples: 3,
                }
            } else {
                BenchConfig {
                    warmup_iters: 0,
                    min_samples: 1,
                    min_time: Duration::ZERO,
                    max_samples: 1,
                }
            };
            Some(time_it(cfg, || drop(m.forward(&seq, 1, seq.len()).expect("valid"))).median)
        } else {
            None
        };
        println!(
            "  pos {pos:>5}: cache {:>8.2} ms{}",
            cached * 1e3,
            full.map_or(String::new(), |f| format!(
                "   no cache {:>9.1} ms   speedup {:>6.1}x",
                f * 1e3,
                f / cached
            ))
        );
        with.push((pos as f64, cached * 1e3));
        rows.push(
            Row::new(
                format!("p05 smollm2 decode latency pos={pos} (cache)"),
                cached * 1e3,
                "ms",
            )
            .predicted(if pos == 16 {
                "~25 ms (540 MB of f32 weights at ~22 GB/s)"
            } else {
                ""
            }),
        );
        if let Some(f) = full {
            without.push((pos as f64, f * 1e3));
            if [64, 256, 1024].contains(&pos) {
                rows.push(
                    Row::new(
                        format!("p05 smollm2 cache speedup pos={pos}"),
                        f / cached,
                        "x",
                    )
                    .predicted(match pos {
                        64 => "~5x",
                        256 => "~40x",
                        _ => "~300x",
                    }),
                );
            }
        }
    }
    let (pre, dec) = speeds(engine)?;
    println!("\nours (f32): prefill {pre:.1} tok/s (256-token prompt), decode {dec:.1} tok/s (128 tokens after 16)");
    rows.push(
        Row::new("p05 smollm2 prefill 256 (ours f32)", pre, "tok/s")
            .predicted(">= transformers (~500)"),
    );
    rows.push(
        Row::new("p05 smollm2 decode 128 after 16 (ours f32)", dec, "tok/s")
            .predicted("~40 (>= 2x transformers' ~19)"),
    );
    if peers {
        let root = common::assets::workspace_root();
        for (which, venv) in [("transformers", ".venv-ref"), ("llamacpp", ".venv-peer")] {
            let python = root.join(venv).join("bin/python");
            if !python.exists() {
                println!(
                    "  {which}: {} missing (see the crate README for the install command); skipped",
                    python.display()
                );
                continue;
            }
            match peer(&python, which) {
                Ok((name, p, d)) => {
                    println!("  {name}: prefill {p:.1} tok/s (ours/peer {:.2}), decode {d:.1} tok/s (ours/peer {:.2})", pre / p, dec / d);
                    rows.push(Row::new(
                        format!("p05 smollm2 prefill 256 ({name})"),
                        p,
                        "tok/s",
                    ));
                    rows.push(Row::new(
                        format!("p05 smollm2 decode 128 after 16 ({name})"),
                        d,
                        "tok/s",
                    ));
                    rows.push(
                        Row::new(format!("p05 prefill ours/{which}"), pre / p, "x").predicted(
                            if which == "transformers" {
                                "target >= 1"
                            } else {
                                ""
                            },
                        ),
                    );
                    rows.push(
                        Row::new(format!("p05 decode ours/{which}"), dec / d, "x").predicted(
                            if which == "transformers" {
                                "target >= 2"
                            } else {
                                "gap to close in p10"
                            },
                        ),
                    );
                }
                Err(e) => println!("  {which}: {e:#}"),
            }
        }
    }
    println!("\nwhere a decode step's time goes (position 256):");
    for (label, s) in breakdown(engine, 256)? {
        println!("  {label:<48} {:>8.2} ms", s * 1e3);
        rows.push(Row::new(
            format!("p05 decode breakdown pos=256: {label}"),
            s * 1e3,
            "ms",
        ));
    }
    let png = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("plots/decode_latency.png");
    let labels = Labels {
        title: "SmolLM2-135M decode latency per token vs position (f32, 2 threads)",
        x: "position (tokens already in context)",
        y: "ms per token",
    };
    line_chart(
        &png,
        labels,
        &[
            Series::new("with KV cache", with),
            Series::new("without (full recompute)", without),
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
