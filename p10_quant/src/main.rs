//! `p10_quant`: serve SmolLM2 with its quantised weights kept native, and
//! measure what that buys.
//!
//!   cargo run --release -p p10_quant -- serve --model smollm2 --port 8000
//!   cargo run --release -p p10_quant -- bench
//!   cargo run --release -p p10_quant -- perplexity
//!   cargo run --release -p p10_quant -- isa

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use p09_kv_manager::serve::ServeArgs;
use p10_quant::{Dot, Isa};

#[derive(Debug, Parser)]
#[command(
    about = "Project 10: native quantised weights (Q4_1, Q8_0) with SIMD integer kernels, served on Project 09's paged continuous batching"
)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    serve: Serve,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Serve the OpenAI API (the default).
    Serve(Serve),
    /// Decode and prefill f32 vs native beside llama.cpp, GEMV bandwidth per format, accuracy.
    Bench(p10_quant::bench::BenchArgs),
    /// Perplexity, KL divergence and top-1 agreement over a text: 8-bit activations and weight formats against f32, beside llama.cpp.
    Perplexity(p10_quant::study::PerplexityArgs),
    /// The kernel paths this CPU has, and the one chosen.
    Isa,
    /// Load a model and print its resident memory (the bench runs this).
    #[command(hide = true)]
    Rss(RssArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Weights {
    /// Dequantise everything to f32 at load (Projects 04–09).
    F32,
    /// Keep the GGUF's Q4_0 / Q4_1 / Q8_0 blocks.
    Native,
}

#[derive(Clone, Debug, Args)]
struct Serve {
    #[command(flatten)]
    serve: ServeArgs,
    /// Weight format of the projections.
    #[arg(long, value_enum, default_value = "native")]
    weights: Weights,
}

#[derive(Clone, Debug, Args)]
struct RssArgs {
    #[arg(long, default_value = "smollm2")]
    model: String,
    #[arg(long, value_enum)]
    weights: Weights,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        None => serve(cli.serve),
        Some(Cmd::Serve(a)) => serve(a),
        Some(Cmd::Bench(a)) => p10_quant::bench::run(&a),
        Some(Cmd::Perplexity(a)) => p10_quant::study::run(&a),
        Some(Cmd::Isa) => {
            println!("available: {:?}", Isa::available());
            println!(
                "chosen: {} (cap with INFERENCE_LAB_ISA=scalar|avx2)",
                Dot::detect().isa()
            );
            Ok(())
        }
        Some(Cmd::Rss(a)) => {
            let path = p06_server::server::resolve_model(&a.model).map_err(anyhow::Error::msg)?;
            let loaded = p10_quant::bench::load(&path, a.weights == Weights::Native)?;
            println!("{}", p10_quant::bench::rss_bytes());
            drop(loaded);
            Ok(())
        }
    }
}

fn serve(a: Serve) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let native = a.weights == Weights::Native;
    if native {
        eprintln!("native weights, {} kernels", Dot::detect().isa());
    }
    rt.block_on(p09_kv_manager::serve::serve(a.serve, move |path| {
        p10_quant::bench::load(path, native).map_err(|e| format!("{e:#}"))
    }))
}
