//! `p10_quant perplexity`: the two accuracy studies, over a fixed public
//! text ([`crate::perplexity`] counts the scores).
//!
//! (a) The cost of 8-bit activations: the file's Q4_1 weights on the
//!     integer path (every position, as decode runs) against the same
//!     weights in f32; beside llama.cpp's `llama-perplexity
//!     --kl-divergence`, its base an F32 GGUF of the same dequantised
//!     weights, its test the Q4_1 file.
//! (b) The cost of weight quantisation: the f32 weights quantised again by
//!     this crate to Q8_0, int8 per channel and Q4_0, each against f32.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use common::numbers::{command_line, Recorder, Row};
use p05_kv_cache::load::LoadedEngine;

use crate::loader::{NativeWeights, Requantize};
use crate::matrix::Format;
use crate::perplexity::{compare, Comparison};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Study {
    /// (a) 8-bit activations: native Q4_1 vs f32, beside llama.cpp.
    Activations,
    /// (b) weight formats: Q8_0, int8 per channel, Q4_0 vs f32.
    Weights,
    /// Both.
    All,
}

#[derive(Clone, Debug, Args)]
pub struct PerplexityArgs {
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// The text (default: the corpus scripts/fetch_assets.sh fetches).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Tokens per chunk; the second half of each chunk is scored.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Chunks scored (from the text's start); 0 = every whole chunk.
    #[arg(long, default_value_t = 40)]
    pub chunks: usize,
    #[arg(long, value_enum, default_value = "all")]
    pub study: Study,
    /// llama.cpp's tools (scripts/build_llamacpp.sh puts them here).
    #[arg(long, default_value = ".llamacpp/bin")]
    pub llamacpp: PathBuf,
    /// The F32 GGUF for llama.cpp's base (scripts/export_p10_f32_gguf.py).
    #[arg(long, default_value = "assets/p10/SmolLM2-135M-Instruct.F32.gguf")]
    pub f32_gguf: PathBuf,
    /// Skip llama.cpp.
    #[arg(long)]
    pub no_peer: bool,
    #[arg(long)]
    pub no_record: bool,
}

/// The default text: see `scripts/fetch_assets.sh text`.
pub fn default_text() -> PathBuf {
    common::assets::workspace_root().join(crate::study::TEXT_PATH)
}

/// Where `scripts/fetch_assets.sh text` puts the corpus.
pub const TEXT_PATH: &str = "assets/text/corpus.txt";

/// Loads one test model.
type Loader = Box<dyn Fn() -> Result<LoadedEngine>>;

/// One line of the study's table.
struct Line {
    label: String,
    c: Comparison,
}

pub fn run(a: &PerplexityArgs) -> Result<()> {
    let path = p06_server::load::resolve_model(&a.model).map_err(anyhow::Error::msg)?;
    let text_path = a.text.clone().unwrap_or_else(default_text);
    let text = std::fs::read_to_string(&text_path).with_context(|| {
        format!(
            "reading {} (fetch it: bash scripts/fetch_assets.sh text)",
            text_path.display()
        )
    })?;
    let max_chunks = (a.chunks > 0).then_some(a.chunks);
    let base = crate::loader::load(&path, crate::Weights::F32)?;
    let tok = base
        .tokenizer
        .as_ref()
        .context("the model has no tokenizer")?;
    let t = Instant::now();
    let tokens = tok.encode(&text);
    println!(
        "{}: {} bytes, {} tokens (tokenised in {:.1} s); chunks of {} tokens, the second half of each scored",
        text_path.display(),
        text.len(),
        tokens.len(),
        t.elapsed().as_secs_f64(),
        a.ctx
    );
    let int_path = NativeWeights {
        // Every position on the integer path, as in decode.
        f32_rows: usize::MAX,
        ..NativeWeights::detect()
    };
    let mut tests: Vec<(String, Loader)> = Vec::new();
    if a.study != Study::Weights {
        let p = path.clone();
        tests.push((
            "native Q4_1 (file's blocks, 8-bit activations)".into(),
            Box::new(move || crate::loader::load_native(&p, int_path)),
        ));
    }
    if a.study != Study::Activations {
        for format in [Format::Q8_0, Format::I8Channel, Format::Q4_0] {
            let p = path.clone();
            tests.push((
                format!("{} requantised from f32", format.name()),
                Box::new(move || {
                    let r = Requantize {
                        format,
                        weights: int_path,
                    };
                    p05_kv_cache::load::load_with(&p, &r)
                        .with_context(|| format!("loading {}", p.display()))
                }),
            ));
        }
    }
    let mut loaded = Vec::new();
    for (label, make) in &tests {
        loaded.push((label.clone(), make()?));
    }
    let engines: Vec<&p05_kv_cache::llama_engine::LlamaEngine> =
        loaded.iter().map(|(_, l)| &l.engine).collect();
    let t = Instant::now();
    let results = compare(
        &base.engine,
        &engines,
        &tokens,
        a.ctx,
        max_chunks,
        |done, total, c| {
            let kls: Vec<String> = c.iter().map(|c| format!("{:.4}", c.kl.mean())).collect();
            eprint!("\r  chunk {done}/{total}: KL {}   ", kls.join(" "));
        },
    )?;
    eprintln!();
    let lines: Vec<Line> = loaded
        .into_iter()
        .zip(results)
        .map(|((label, _), c)| Line { label, c })
        .collect();
    println!(
        "{} models x {} tokens scored in {:.0} s",
        lines.len() + 1,
        lines.first().map_or(0, |l| l.c.kl.count()),
        t.elapsed().as_secs_f64()
    );
    let Some(first) = lines.first() else {
        bail!("no study selected")
    };
    let base_ppl = first.c.base;
    println!("\n| model | PPL | KL vs f32 (nats) | top-1 agreement |");
    println!("|---|---|---|---|");
    println!(
        "| f32 (the file's weights dequantised) | {:.3} ± {:.3} | 0 | 100% |",
        base_ppl.ppl(),
        base_ppl.ppl_err()
    );
    for l in &lines {
        println!(
            "| {} | {:.3} ± {:.3} | {:.5} ± {:.5} | {:.2} ± {:.2}% |",
            l.label,
            l.c.test.ppl(),
            l.c.test.ppl_err(),
            l.c.kl.mean(),
            l.c.kl.stderr(),
            l.c.top1.mean() * 100.0,
            l.c.top1.stderr() * 100.0
        );
    }
    let scored = first.c.kl.count();
    let mut rows = vec![Row::new(
        format!("p10 PPL f32, {scored} tokens ctx {}", a.ctx),
        base_ppl.ppl(),
        "ppl",
    )];
    for l in &lines {
        rows.push(Row::new(
            format!("p10 PPL {}", l.label),
            l.c.test.ppl(),
            "ppl",
        ));
        rows.push(Row::new(
            format!("p10 KL(f32 || {})", l.label),
            l.c.kl.mean(),
            "nats",
        ));
        rows.push(Row::new(
            format!("p10 top-1 agreement {}", l.label),
            l.c.top1.mean() * 100.0,
            "%",
        ));
    }

    let mut peer_kl = None;
    if a.study != Study::Weights && !a.no_peer {
        match llama_perplexity(a, &path, &text_path) {
            Ok(p) => {
                peer_kl = Some(p.kl.0);
                println!(
                    "| llama.cpp F32 base | {:.3} ± {:.3} | 0 | 100% |",
                    p.base_ppl.0, p.base_ppl.1
                );
                println!(
                    "| llama.cpp Q4_1 | {:.3} ± {:.3} | {:.5} ± {:.5} | {:.2} ± {:.2}% |",
                    p.test_ppl.0, p.test_ppl.1, p.kl.0, p.kl.1, p.top1.0, p.top1.1
                );
                let ours = first.c.kl.mean();
                println!(
                    "our KL / llama.cpp's KL: {:.2} (target <= 1.1)",
                    ours / p.kl.0
                );
                rows.push(Row::new("p10 llama.cpp PPL F32 base", p.base_ppl.0, "ppl"));
                rows.push(Row::new("p10 llama.cpp PPL Q4_1", p.test_ppl.0, "ppl"));
                rows.push(Row::new("p10 llama.cpp KL(F32 || Q4_1)", p.kl.0, "nats"));
                rows.push(Row::new("p10 llama.cpp top-1 agreement", p.top1.0, "%"));
                rows.push(
                    Row::new("p10 KL native / llama.cpp KL", ours / p.kl.0, "x")
                        .predicted("<= 1.1 (target)"),
                );
            }
            Err(e) => println!("llama.cpp skipped: {e:#}"),
        }
    }
    if !a.no_record {
        plot_kl(&lines, peer_kl)?;
        Recorder::for_workspace(command_line("p10_quant"))
            .machine_note(&format!("kernels {}", crate::Isa::detect()))
            .append(&rows)?;
    }
    Ok(())
}

/// Bits per weight of each studied format (blocks of 32: a 16-bit scale,
/// and a 16-bit minimum for Q4_1; int8 per channel counted as 8, its one
/// scale per row being negligible).
fn bits_per_weight(label: &str) -> Option<f64> {
    [
        ("Q4_0", 4.5),
        ("Q4_1", 5.0),
        ("Q8_0", 8.5),
        ("I8 per channel", 8.0),
    ]
    .iter()
    .find(|(name, _)| label.contains(name))
    .map(|&(_, b)| b)
}

/// `plots/kl_vs_bits.png`: KL(f32 ‖ format) against bits per weight, this
/// run's rows, with llama.cpp's Q4_1 point when it ran.
fn plot_kl(lines: &[Line], peer_kl: Option<f64>) -> Result<()> {
    use common::plot::{line_chart, Labels, Scale, Series};
    let mut ours: Vec<(f64, f64)> = lines
        .iter()
        .filter_map(|l| Some((bits_per_weight(&l.label)?, l.c.kl.mean())))
        .collect();
    ours.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut series = vec![Series::new("ours, 8-bit activations", ours)];
    if let Some(kl) = peer_kl {
        series.push(Series::new("llama.cpp Q4_1", vec![(5.0, kl)]));
    }
    let dir = common::assets::workspace_root().join("p10_quant/plots");
    std::fs::create_dir_all(&dir)?;
    line_chart(
        &dir.join("kl_vs_bits.png"),
        Labels {
            title: "KL(f32 || quantised) per token vs bits per weight (SmolLM2, Moby-Dick)",
            x: "bits per weight (log)",
            y: "mean KL, nats (log)",
        },
        &series,
        Scale::LogLog,
    )
    .map_err(anyhow::Error::msg)
}

/// llama.cpp's figures, each (value, error).
struct PeerPpl {
    base_ppl: (f64, f64),
    test_ppl: (f64, f64),
    kl: (f64, f64),
    top1: (f64, f64),
}

/// `llama-perplexity` twice: the F32 GGUF saving its logits, then the
/// Q4_1 file against them.
fn llama_perplexity(a: &PerplexityArgs, q4_1: &Path, text: &Path) -> Result<PeerPpl> {
    let root = common::assets::workspace_root();
    let exe = root.join(&a.llamacpp).join("llama-perplexity");
    let f32_gguf = root.join(&a.f32_gguf);
    if !f32_gguf.exists() {
        bail!(
            "{} is missing (make it: .venv-ref/bin/python scripts/export_p10_f32_gguf.py {} {})",
            f32_gguf.display(),
            q4_1.display(),
            f32_gguf.display()
        );
    }
    let kld = std::env::temp_dir().join(format!("p10_kld_base_{}.bin", std::process::id()));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let run = |model: &Path, extra: &[&str]| -> Result<String> {
        let mut cmd = Command::new(&exe);
        cmd.arg("-m")
            .arg(model)
            .arg("-f")
            .arg(text)
            .args(["-c", &a.ctx.to_string(), "-t", &threads.to_string()])
            .args(["-b", &a.ctx.to_string()])
            .arg("--kl-divergence-base")
            .arg(&kld)
            .args(extra);
        if a.chunks > 0 {
            cmd.args(["--chunks", &a.chunks.to_string()]);
        }
        let out = cmd
            .output()
            .with_context(|| format!("running {}", exe.display()))?;
        let all = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            bail!("{} failed: {}", exe.display(), tail(&all));
        }
        Ok(all)
    };
    let base = run(&f32_gguf, &[]);
    let test = base.as_ref().ok().map(|_| run(q4_1, &["--kl-divergence"]));
    let _ = std::fs::remove_file(&kld);
    let (base, test) = (base?, test.context("no base run")??);
    let base_ppl = pm(&base, "Final estimate: PPL =")?;
    Ok(PeerPpl {
        base_ppl,
        test_ppl: pm(&test, "Mean PPL(Q)")?,
        kl: pm(&test, "Mean    KLD:")?,
        top1: pm(&test, "Same top p:")?,
    })
}

/// The "v ± e" after `key` on its line of llama-perplexity's output.
fn pm(out: &str, key: &str) -> Result<(f64, f64)> {
    let line = out
        .lines()
        .find(|l| l.contains(key))
        .with_context(|| format!("no '{key}' in llama-perplexity's output: {}", tail(out)))?;
    let rest = &line[line.find(key).map_or(0, |i| i + key.len())..];
    let nums: Vec<f64> = rest
        .split(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == 'e'))
        .filter_map(|s| s.parse().ok())
        .collect();
    match nums[..] {
        [v, e, ..] => Ok((v, e)),
        _ => bail!("cannot read '{line}'"),
    }
}

/// The last ~1,500 bytes of `s`, cut at a character boundary (the
/// tool prints '±').
fn tail(s: &str) -> &str {
    let mut cut = s.len().saturating_sub(1500);
    while !s.is_char_boundary(cut) {
        cut += 1;
    }
    &s[cut..]
}

#[cfg(test)]
mod tests {
    use super::{bits_per_weight, pm};

    #[test]
    fn every_studied_format_has_its_bits() {
        assert_eq!(
            bits_per_weight("native Q4_1 (file's blocks, 8-bit activations)"),
            Some(5.0)
        );
        assert_eq!(bits_per_weight("Q8_0 requantised from f32"), Some(8.5));
        assert_eq!(
            bits_per_weight("I8 per channel requantised from f32"),
            Some(8.0)
        );
        assert_eq!(bits_per_weight("Q4_0 requantised from f32"), Some(4.5));
        assert_eq!(bits_per_weight("f32"), None);
    }

    #[test]
    fn reads_llama_perplexitys_summary_lines() {
        // Lines copied from llama-perplexity's output (the llama-cpp-python
        // 0.3.36 sdist's tools, scripts/build_llamacpp.sh).
        let out = "0.10.732.513 I Final estimate: PPL = 24.1321 +/- 3.69012\n\
                   Mean PPL(Q)                   :  24.173228 ±   3.699023\n\
                   Mean PPL(Q)/PPL(base)         :   1.001706 ±   0.003736\n\
                   Mean    KLD:   0.003276 ±   0.000136\n\
                   Same top p: 96.667 ± 0.796 %\n";
        assert_eq!(
            pm(out, "Final estimate: PPL =").unwrap(),
            (24.1321, 3.69012)
        );
        assert_eq!(pm(out, "Mean PPL(Q)").unwrap(), (24.173228, 3.699023));
        assert_eq!(pm(out, "Mean    KLD:").unwrap(), (0.003276, 0.000136));
        assert_eq!(pm(out, "Same top p:").unwrap(), (96.667, 0.796));
        assert!(pm(out, "Median KLD").is_err());
    }
}
