//! `p10_quant`: serve SmolLM2 with its quantised weights kept native, and
//! measure what that buys.
//!
//!   cargo run --release -p p10_quant -- serve --model smollm2 --port 8000
//!   cargo run --release -p p10_quant -- bench
//!   cargo run --release -p p10_quant -- perplexity
//!   cargo run --release -p p10_quant -- int8
//!   cargo run --release -p p10_quant -- isa

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use p10_quant::serve::ServeArgs;
use p10_quant::{Dot, Isa, Weights};

#[derive(Debug, Parser)]
#[command(
    about = "Project 10: native quantised weights (Q4_1, Q8_0) with SIMD integer kernels, served on Project 09's paged continuous batching"
)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Serve the OpenAI API (the default).
    Serve(ServeArgs),
    #[cfg(feature = "bench")]
    /// Decode and prefill f32 vs native beside llama.cpp, GEMV bandwidth per format, accuracy.
    Bench(p10_quant::bench::BenchArgs),
    #[cfg(feature = "bench")]
    /// Batched decode at 1..64 sequences (native invariant, native batch-variant, f32, llama-batched-bench), the kernel against the integer peak, closed-loop serving at 1..32 streams beside llama-server.
    BenchBatch(p10_quant::batch_bench::BatchArgs),
    #[cfg(feature = "bench")]
    /// The model-runner seam's cost per step, and this server against another commit's (--base-bin) through HTTP: decode at 1 and 16 streams, prefill, closed-loop output.
    BenchSeam(p10_quant::seam_bench::SeamArgs),
    #[cfg(feature = "bench")]
    /// Perplexity, KL divergence and top-1 agreement over a text: 8-bit activations and weight formats against f32, beside llama.cpp.
    Perplexity(p10_quant::study::PerplexityArgs),
    #[cfg(feature = "bench")]
    /// int8 per output channel for our own f32 models: Project 01's MNIST MLP (accuracy and agreement with f32 on the 1,000 held-out digits) and a GPT-2 layout model (agreement, KL).
    Int8(Int8Args),
    /// The kernel paths this CPU has, and the one chosen.
    Isa,
    /// Load a model and print its resident memory (the bench runs this).
    #[command(hide = true)]
    Rss(RssArgs),
}

#[cfg(feature = "bench")]
#[derive(Clone, Debug, Args)]
struct Int8Args {
    /// A Project 01 model directory (linear and relu layers).
    #[arg(long, default_value = "p01_engine/fixtures/mlp")]
    model_dir: std::path::PathBuf,
    /// Labelled digits: safetensors with `images` and `labels`.
    #[arg(long, default_value = "p01_engine/fixtures/mnist_test.safetensors")]
    data: std::path::PathBuf,
    /// A GPT-2 layout model directory with an `io.safetensors` holding `ids`
    /// (Project 04's fixture by default): int8 per channel vs f32 on them.
    #[arg(long, default_value = "p04_transformer/fixtures/tiny_gpt2")]
    gpt2: std::path::PathBuf,
    #[arg(long)]
    no_record: bool,
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
        None => p10_quant::serve::run(cli.serve),
        Some(Cmd::Serve(a)) => p10_quant::serve::run(a),
        #[cfg(feature = "bench")]
        Some(Cmd::Bench(a)) => p10_quant::bench::run(&a),
        #[cfg(feature = "bench")]
        Some(Cmd::BenchBatch(a)) => p10_quant::batch_bench::run(&a),
        #[cfg(feature = "bench")]
        Some(Cmd::BenchSeam(a)) => p10_quant::seam_bench::run(&a),
        #[cfg(feature = "bench")]
        Some(Cmd::Perplexity(a)) => p10_quant::study::run(&a),
        #[cfg(feature = "bench")]
        Some(Cmd::Int8(a)) => int8(&a),
        Some(Cmd::Isa) => {
            println!("available: {:?}", Isa::available());
            println!(
                "chosen: {} (cap with INFERENCE_LAB_ISA=scalar|avx2|avx512|avx512vnni)",
                Dot::detect().isa()
            );
            Ok(())
        }
        Some(Cmd::Rss(a)) => {
            let path = p06_server::load::resolve_model(&a.model)?;
            let loaded = p10_quant::loader::load(&path, a.weights)?;
            println!("{}", p10_quant::loader::rss_bytes());
            drop(loaded);
            Ok(())
        }
    }
}

#[cfg(feature = "bench")]
fn int8(a: &Int8Args) -> Result<()> {
    use common::numbers::{command_line, Recorder, Row};
    let root = common::assets::workspace_root();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let dot = Dot::detect();
    let r =
        p10_quant::int8_mlp::evaluate(&root.join(&a.model_dir), &root.join(&a.data), dot, threads)?;
    let pct = |c: usize| 100.0 * c as f64 / r.n as f64;
    println!(
        "{} digits; weights f32 {} bytes, int8 per channel {} bytes ({:.2}x smaller)",
        r.n,
        r.bytes[0],
        r.bytes[1],
        r.bytes[0] as f64 / r.bytes[1] as f64
    );
    println!("| model | accuracy | argmax = f32 | max abs logit diff |");
    println!("|---|---|---|---|");
    println!(
        "| f32 (Project 01's engine) | {:.1}% | - | - |",
        pct(r.correct[0])
    );
    for (i, name) in [
        "int8 weights, f32 activations (W8)",
        "int8 weights, 8-bit activations (W8A8)",
    ]
    .iter()
    .enumerate()
    {
        println!(
            "| {name} | {:.1}% | {}/{} | {:.4} |",
            pct(r.correct[i + 1]),
            r.agree[i],
            r.n,
            r.max_diff[i]
        );
    }
    // GPT-2 layout: every Conv1D projection int8 per channel, 8-bit
    // activations (the integer path), against the same model in f32.
    let dir = root.join(&a.gpt2);
    let io = common::st::load(&dir.join("io.safetensors"))?;
    let (shape, ids) = io.ints("ids")?;
    anyhow::ensure!(
        shape.len() == 2,
        "{}: ids must be (batch, seq)",
        dir.display()
    );
    let ids = ids
        .iter()
        .map(|&i| u32::try_from(i))
        .collect::<Result<Vec<u32>, _>>()?;
    let g = p10_quant::int8_gpt2::compare(&dir, &ids, shape[0], shape[1], dot)?;
    println!(
        "{}: int8 per channel (W8A8) vs f32 on {} positions: argmax equal at {}, max |logit diff| {:.4}, mean KL {:.2e} nats; projection bytes {} -> {}",
        a.gpt2.display(),
        g.positions,
        g.argmax_agree,
        g.max_abs_logit_diff,
        g.mean_kl,
        g.weight_bytes[0],
        g.weight_bytes[1]
    );
    if !a.no_record {
        let gpt2 = a.gpt2.display();
        let rows = vec![
            Row::new(
                format!("p10 int8 GPT-2 layout ({gpt2}) argmax = f32, W8A8"),
                100.0 * g.argmax_agree as f64 / g.positions as f64,
                "%",
            )
            .predicted("all but near-ties"),
            Row::new(
                format!("p10 int8 GPT-2 layout ({gpt2}) mean KL vs f32, W8A8"),
                g.mean_kl,
                "nats",
            )
            .predicted("~1e-4"),
            Row::new(
                format!("p10 int8 GPT-2 layout ({gpt2}) max logit diff, W8A8"),
                g.max_abs_logit_diff as f64,
                "logit",
            ),
            Row::new("p10 int8 MNIST accuracy f32", pct(r.correct[0]), "%"),
            Row::new("p10 int8 MNIST accuracy W8", pct(r.correct[1]), "%")
                .predicted("within 0.5 points of f32"),
            Row::new("p10 int8 MNIST accuracy W8A8", pct(r.correct[2]), "%")
                .predicted("within 0.5 points of f32"),
            Row::new("p10 int8 MNIST argmax = f32, W8", pct(r.agree[0]), "%"),
            Row::new("p10 int8 MNIST argmax = f32, W8A8", pct(r.agree[1]), "%").predicted(">= 99%"),
            Row::new(
                "p10 int8 MNIST max logit diff W8",
                r.max_diff[0] as f64,
                "logit",
            ),
            Row::new(
                "p10 int8 MNIST max logit diff W8A8",
                r.max_diff[1] as f64,
                "logit",
            ),
        ];
        Recorder::for_workspace(command_line("p10_quant"))
            .machine_note(&format!("kernels {}", dot.isa()))
            .append(&rows)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// clap's own checks of every subcommand's flags (unique names and
    /// groups): a clash panics only when the binary starts.
    #[test]
    fn the_command_line_is_well_formed() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
