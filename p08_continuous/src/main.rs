//! `p08_continuous`: serve a model over the OpenAI API with continuous
//! batching, or measure the scheduler against the earlier engines and
//! llama.cpp's own server.
//!
//!   cargo run --release -p p08_continuous -- --model smollm2 --port 8000
//!   cargo run --release -p p08_continuous -- bench-budget
//!   cargo run --release -p p08_continuous -- bench-serve

use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use p06_server::server;
#[cfg(feature = "bench")]
use p08_continuous::bench_cmd;
use p08_continuous::cli::SchedArgs;
use p08_continuous::ContinuousEngine;

#[derive(Debug, Parser)]
#[command(
    about = "Project 08: continuous batching (chunked prefill, preemption) behind the OpenAI API"
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
    /// Serve (the default).
    Serve(ServeArgs),
    #[cfg(feature = "bench")]
    /// The step-time model: step time vs prefill-chunk size beside running decodes; the default budget.
    BenchBudget(bench_cmd::BudgetArgs),
    #[cfg(feature = "bench")]
    /// Serial, p07, p08 and llama.cpp's server under the same load: throughput, TTFT, ITL, fairness.
    BenchServe(bench_cmd::ServeArgs),
}

#[derive(Clone, Debug, Args)]
struct ServeArgs {
    #[command(flatten)]
    listen: server::ListenArgs,
    #[command(flatten)]
    sched: SchedArgs,
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
        Some(Cmd::BenchBudget(a)) => bench_cmd::budget(&a),
        #[cfg(feature = "bench")]
        Some(Cmd::BenchServe(a)) => rt.block_on(bench_cmd::serve(&a)),
    }
}

async fn serve(a: ServeArgs) -> Result<()> {
    let config = a.sched.config();
    server::serve_model(&a.listen, move |path, name| {
        let (engine, tokenizer) = p06_server::load::load_local(path)?;
        let engine = ContinuousEngine::start(Arc::new(engine), Arc::new(tokenizer), name, config)?;
        Ok(Arc::new(engine))
    })
    .await
}
