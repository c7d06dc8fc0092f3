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

/// Seconds of one decode step at cache position `pos`, over 10 steps (the
/// cache is sized and its length set directly: attention cost does not
/// depend on the cached values).
pub fn decode_latency(engine: &LlamaEngine, pos: usize) -> Result<Summary> {
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
        cache.kv.set_len(pos).expect("room for pos + 2");
        engine
            .step(&[101], &mut cache, &mut logits)
            .expect("room for one");
    });
    Ok(s)
}

/// (prefill tok/s on 256 tokens, decode tok/s for 128 tokens after 16),
/// one of each per run, `MIN_SAMPLES` (5) runs.
pub fn speed_runs(engine: &LlamaEngine) -> Result<(Vec<f64>, Vec<f64>)> {
    let (mut pre, mut dec) = (Vec::new(), Vec::new());
    for _ in 0..common::numbers::MIN_SAMPLES {
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
    Ok((pre, dec))
}

/// Decode of 128 tokens after a 16-token prompt, `runs` times: (each
/// run's tok/s, the summary of every step's seconds, so a timing row can
/// give the median and the p95 of a token's latency).
pub fn decode_profile(engine: &LlamaEngine, runs: usize) -> Result<(Vec<f64>, Summary)> {
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
    Ok((rates, summarize(&steps)))
}

/// Median prefill tok/s of `n` tokens over `MIN_SAMPLES` (5) runs.
pub fn prefill_speed(engine: &LlamaEngine, n: usize) -> Result<f64> {
    let mut s = Vec::new();
    for _ in 0..common::numbers::MIN_SAMPLES {
        let t = Instant::now();
        let _ = engine.prefill(&ids(n), n + 1)?;
        s.push(n as f64 / t.elapsed().as_secs_f64());
    }
    Ok(summarize(&s).median)
}

/// One part of a decode step's time (seconds).
#[derive(Clone, Copy, Debug)]
pub struct Part {
    pub label: &'static str,
    pub median_s: f64,
    /// None for a part that is a difference of medians (not timed itself).
    pub p95_s: Option<f64>,
}

impl Part {
    /// numbers.md rows: median and p95 of a timed part; one row, named as
    /// a difference of medians, for the remainder.
    pub fn rows(&self, prefix: &str) -> Vec<Row> {
        match self.p95_s {
            Some(p95) => Row::median_p95(
                format!("{prefix}: {}", self.label),
                self.median_s * 1e3,
                p95 * 1e3,
                "ms",
                "",
            )
            .to_vec(),
            None => vec![Row::new(
                format!("{prefix}: {} (difference of medians)", self.label),
                self.median_s * 1e3,
                "ms",
            )],
        }
    }
}

/// Where one decode step's time goes at position `pos`, 10 timings of each
/// part.
pub fn breakdown(engine: &LlamaEngine, pos: usize) -> Result<Vec<Part>> {
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
    });
    let head = time_it(cfg, || {
        m.lm_head
            .apply_into(&x[..c.hidden_size], 1, &mut y[..c.vocab_size], t)
            .expect("shapes")
    });
    let total = decode_latency(engine, pos)?;
    let other = (total.median - blocks.median - head.median).max(0.0);
    let timed = |label, s: Summary| Part {
        label,
        median_s: s.median,
        p95_s: Some(s.p95),
    };
    Ok(vec![
        timed("block projections (q,k,v,o,gate,up,down) x 30", blocks),
        timed("lm_head (576 x 49152)", head),
        Part {
            label: "attention over the cache + norms + rest",
            median_s: other,
            p95_s: None,
        },
        timed("whole decode step", total),
    ])
}

/// What a peer reported: its name and version, every timed run's rate,
/// and the greedy ids of its untimed first decode run.
#[derive(Clone, Debug)]
pub struct PeerRun {
    pub name: String,
    pub prefill: Vec<f64>,
    pub decode: Vec<f64>,
    pub greedy: Vec<u32>,
}

/// Run `scripts/bench_p05_peers.py --peer WHICH` (`transformers` or
/// `llamacpp`) with `python`: speeds on this crate's fixed prompts and the
/// greedy ids of its untimed first decode run.
pub fn peer(python: &Path, which: &str) -> Result<PeerRun> {
    let root = common::assets::workspace_root();
    let out = Command::new(python)
        .arg(root.join("scripts/bench_p05_peers.py"))
        .args(["--peer", which])
        .args(["--reps", &common::numbers::MIN_SAMPLES.to_string()])
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
    let list = |k: &str| -> Vec<f64> {
        v[k].as_array()
            .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
            .unwrap_or_default()
    };
    let greedy: Vec<u32> = list("greedy_ids").iter().map(|&x| x as u32).collect();
    let (prefill, decode) = (list("prefill_runs"), list("decode_runs"));
    if prefill.is_empty() || decode.is_empty() || greedy.is_empty() {
        anyhow::bail!("{which} peer printed no runs or greedy ids: {line:?}");
    }
    Ok(PeerRun {
        name: format!("{which} {}", v["version"].as_str().unwrap_or("?")),
        prefill,
        decode,
        greedy,
    })
}

/// Our greedy ids for the decode benchmark's prompt (16 fixed ids, then
/// `n` tokens): what a peer's greedy run is compared with.
pub fn greedy_ids(engine: &LlamaEngine, n: usize) -> Result<Vec<u32>> {
    let (mut logits, mut cache) = engine.prefill(&ids(16), 16 + n + 1)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let next = argmax(&logits);
        out.push(next);
        engine.decode(next, &mut cache, &mut logits)?;
    }
    Ok(out)
}

/// (tokens equal before the first difference, positions equal overall).
pub fn agreement(ours: &[u32], theirs: &[u32]) -> (usize, usize) {
    let prefix = ours.iter().zip(theirs).take_while(|(a, b)| a == b).count();
    let same = ours.iter().zip(theirs).filter(|(a, b)| a == b).count();
    (prefix, same)
}

/// Print and return the two agreement rows of `ours` against a peer's
/// greedy ids: "<metric>: tokens equal before the first difference" (with
/// `prediction`) and "<metric>: positions equal", in tokens of `ours.len()`.
pub fn agreement_rows(metric: &str, ours: &[u32], theirs: &[u32], prediction: &str) -> [Row; 2] {
    let (prefix, same) = agreement(ours, theirs);
    let n = ours.len();
    println!("  {metric}: {prefix} of {n} tokens equal before the first difference, {same} positions equal");
    [
        Row::new(
            format!("{metric}: tokens equal before the first difference"),
            prefix as f64,
            format!("tokens of {n}"),
        )
        .predicted(prediction),
        Row::new(
            format!("{metric}: positions equal"),
            same as f64,
            format!("tokens of {n}"),
        ),
    ]
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
    let (mut with, mut without, mut with_spread) = (Vec::new(), Vec::new(), Vec::new());
    for &pos in &positions {
        let step = decode_latency(engine, pos)?;
        let cached = step.median;
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
        with_spread.push((pos as f64, cached * 1e3, step.p95 * 1e3));
        rows.extend(Row::median_p95(
            format!("p05 smollm2 decode latency pos={pos} (cache), 10 steps"),
            cached * 1e3,
            step.p95 * 1e3,
            "ms",
            if pos == 16 {
                "~25 ms (540 MB of f32 weights at ~22 GB/s)"
            } else {
                ""
            },
        ));
        if let Some(f) = full {
            without.push((pos as f64, f * 1e3));
            if [64, 256, 1024].contains(&pos) {
                rows.push(
                    Row::new(
                        format!("p05 smollm2 cache speedup pos={pos} (ratio of medians)"),
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
    let (pre_runs, dec_runs) = speed_runs(engine)?;
    let (pre, dec) = (summarize(&pre_runs).median, summarize(&dec_runs).median);
    println!("\nours (f32): prefill {pre:.1} tok/s (256-token prompt), decode {dec:.1} tok/s (128 tokens after 16)");
    rows.extend(Row::rates_median_p5(
        "p05 smollm2 prefill 256 (ours f32)",
        &pre_runs,
        "tok/s",
        ">= transformers (~500)",
    ));
    rows.extend(Row::rates_median_p5(
        "p05 smollm2 decode 128 after 16 (ours f32)",
        &dec_runs,
        "tok/s",
        "~40 (>= 2x transformers' ~19)",
    ));
    let ours_greedy = greedy_ids(engine, 128)?;
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
                Ok(run) => {
                    let name = &run.name;
                    // First: does the peer compute the same thing? Greedy
                    // ids of its untimed first run against ours.
                    let why = if which == "llamacpp" {
                        "llama.cpp keeps Q4_1 weights and quantises activations to 8 bits; ours is the f32 reference, so they part after some tokens"
                    } else {
                        "same weights (dequantised GGUF) in f32: expect all or nearly all"
                    };
                    rows.extend(agreement_rows(
                        &format!("p05 greedy agreement with {name}"),
                        &ours_greedy,
                        &run.greedy,
                        why,
                    ));
                    let p = summarize(&run.prefill).median;
                    let d = summarize(&run.decode).median;
                    println!("  {name}: prefill {p:.1} tok/s (ours/peer {:.2}), decode {d:.1} tok/s (ours/peer {:.2})", pre / p, dec / d);
                    rows.extend(Row::rates_median_p5(
                        format!("p05 smollm2 prefill 256 ({name})"),
                        &run.prefill,
                        "tok/s",
                        "",
                    ));
                    rows.extend(Row::rates_median_p5(
                        format!("p05 smollm2 decode 128 after 16 ({name})"),
                        &run.decode,
                        "tok/s",
                        "",
                    ));
                    rows.push(
                        Row::new(
                            format!("p05 prefill ours/{which} (ratio of medians)"),
                            pre / p,
                            "x",
                        )
                        .predicted(if which == "transformers" {
                            "target >= 1"
                        } else {
                            ""
                        }),
                    );
                    rows.push(
                        Row::new(
                            format!("p05 decode ours/{which} (ratio of medians)"),
                            dec / d,
                            "x",
                        )
                        .predicted(if which == "transformers" {
                            "target >= 2"
                        } else {
                            "gap to close in p10"
                        }),
                    );
                }
                Err(e) => println!("  {which}: {e:#}"),
            }
        }
    }
    println!("\nwhere a decode step's time goes (position 256):");
    for part in breakdown(engine, 256)? {
        println!("  {:<48} {:>8.2} ms", part.label, part.median_s * 1e3);
        rows.extend(part.rows("p05 decode breakdown pos=256"));
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
            Series::new("with KV cache (bars: median to p95)", with).with_spread(with_spread),
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
