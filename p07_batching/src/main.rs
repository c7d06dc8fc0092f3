//! `p07_batching`: serve a model over the OpenAI API with a dynamic batcher,
//! or measure the batched step and the batcher.
//!
//!   cargo run --release -p p07_batching -- --model smollm2 --port 8000 --max-batch 16 --max-wait-ms 5
//!   cargo run --release -p p07_batching -- bench-step
//!   cargo run --release -p p07_batching -- bench-serve

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use p06_server::server;
#[cfg(feature = "bench")]
use p07_batching::bench_cmd;
use p07_batching::{BatchConfig, BatchingEngine};

#[derive(Debug, Parser)]
#[command(about = "Project 07: a batched forward step and a dynamic batcher behind the OpenAI API")]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Serve (the default).
    Serve(ServeArgs),
    #[cfg(feature = "bench")]
    /// Aggregate decode tok/s of the batched step vs batch size, beside single-sequence steps.
    BenchStep(bench_cmd::StepArgs),
    #[cfg(feature = "bench")]
    /// The batcher behind HTTP vs p06's serial server: throughput, TTFT, wait x batch sweep, lock-step penalty.
    BenchServe(bench_cmd::ServeBenchArgs),
}

#[derive(Clone, Debug, Args)]
struct ServeArgs {
    #[command(flatten)]
    listen: server::ListenArgs,
    /// Most requests in one batch.
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    /// How long a busy batcher may wait to fill a batch (an idle one never waits).
    #[arg(long, default_value_t = 5)]
    max_wait_ms: u64,
    /// Requests that may wait for a batch; more get 429.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    match cli.cmd {
        None => rt.block_on(serve(cli.serve)),
        Some(Cmd::Serve(a)) => rt.block_on(serve(a)),
        #[cfg(feature = "bench")]
        Some(Cmd::BenchStep(a)) => bench_cmd::step(&a),
        #[cfg(feature = "bench")]
        Some(Cmd::BenchServe(a)) => rt.block_on(bench_cmd::serve(&a)),
    }
}

async fn serve(a: ServeArgs) -> Result<()> {
    let config = BatchConfig {
        max_batch: a.max_batch,
        max_wait: Duration::from_millis(a.max_wait_ms),
        max_waiting: a.max_waiting,
    };
    server::serve_model(&a.listen, move |path, name| {
        let (engine, tokenizer) = p06_server::load::load_local(path)?;
        let engine = BatchingEngine::start(Arc::new(engine), Arc::new(tokenizer), name, config)?;
        Ok(Arc::new(engine))
    })
    .await
}
