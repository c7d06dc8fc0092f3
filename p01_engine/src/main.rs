//! `cargo run --release -p p01_engine [-- bench]`: a thin front over the library.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use common::compare::diff;
use p01_engine::{bench, Graph};

#[derive(Parser, Debug)]
#[command(about = "Project 01: a from-scratch forward pass that matches PyTorch")]
struct Cli {
    /// Model directory holding model.json and weights.safetensors.
    #[arg(long, global = true)]
    model_dir: Option<PathBuf>,
    /// safetensors with `images`, `labels` and PyTorch's `logits`.
    #[arg(long, global = true)]
    data: Option<PathBuf>,
    /// Threads for the matmuls (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Sweep batch sizes beside PyTorch, plot, and append rows to numbers.md.
    Bench {
        /// Comma-separated batch sizes.
        #[arg(
            long,
            default_value = "1,2,4,8,16,32,64,128,256,512,1024",
            value_delimiter = ','
        )]
        batches: Vec<usize>,
        /// A B A B rounds.
        #[arg(long, default_value_t = 2)]
        rounds: usize,
        /// Skip the PyTorch peer (no .venv-ref needed).
        #[arg(long)]
        no_peer: bool,
        /// Do not append to numbers.md.
        #[arg(long)]
        no_record: bool,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let fixtures = p01_engine::fixtures_dir();
    let model_dir = cli
        .model_dir
        .clone()
        .unwrap_or_else(|| fixtures.join("mlp"));
    let data = cli
        .data
        .clone()
        .unwrap_or_else(|| fixtures.join("mnist_test.safetensors"));
    let threads = cli
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .context("building the thread pool")?;
    match cli.cmd {
        None => parity(&model_dir, &data, threads),
        Some(Cmd::Bench {
            batches,
            rounds,
            no_peer,
            no_record,
        }) => {
            if batches.is_empty() || batches.contains(&0) {
                bail!("--batches needs positive sizes");
            }
            bench::run(&bench::BenchArgs {
                model_dir,
                images: data,
                batches,
                threads,
                rounds: rounds.max(1),
                peer: !no_peer,
                record: !no_record,
                command: common::numbers::command_line("p01_engine"),
            })
        }
    }
}

/// Run every test digit through the engine and compare with PyTorch.
fn parity(model_dir: &std::path::Path, data: &std::path::Path, threads: usize) -> Result<()> {
    let engine = Graph::load_with(
        model_dir,
        p01_engine::LoadOptions {
            threads,
            ..Default::default()
        },
    )?;
    let s = engine.stats();
    println!("model {}: {} params ({} weight bytes), {} FLOPs/image in linear layers, loaded in {:.2} ms",
        model_dir.display(), s.n_params, s.weight_bytes, s.linear_flops_per_example, engine.load_time.as_secs_f64() * 1e3);
    println!(
        "kernel {:?} ({}), {threads} threads",
        p01_engine::linear::Kernel::detect(),
        common::assets::simd_description()
    );
    let mut f = common::st::load(data)?;
    let images = f.take("images")?;
    let expected = f.take("logits")?;
    let labels = f.ints("labels")?.1.clone();
    let t = std::time::Instant::now();
    let logits = engine.forward(&images)?;
    let dt = t.elapsed();
    let d = diff(logits.data(), expected.data(), 1e-5, 0.0).map_err(anyhow::Error::msg)?;
    let ours = logits.argmax_rows()?;
    let theirs = expected.argmax_rows()?;
    let n = ours.len();
    let correct = ours
        .iter()
        .zip(&labels)
        .filter(|(p, l)| **p as i64 == **l)
        .count();
    let agree = ours.iter().zip(&theirs).filter(|(a, b)| a == b).count();
    println!("{n} test digits in {:.2} ms", dt.as_secs_f64() * 1e3);
    println!(
        "accuracy: {:.2}% ({correct}/{n})",
        100.0 * correct as f64 / n as f64
    );
    println!(
        "max |logit - PyTorch| = {:.3e} (bar 1e-5) at flat index {}: {} vs {}",
        d.max_abs, d.worst_index, d.actual, d.expected
    );
    println!("argmax identical to PyTorch: {agree}/{n}");
    if d.max_abs >= 1e-5 || agree != n {
        bail!("parity FAILED");
    }
    println!("parity OK");
    Ok(())
}
