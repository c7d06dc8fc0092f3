//! `p09_kv_manager`: serve a model over the OpenAI API with Project 08's
//! continuous batching on paged K/V memory with prefix caching, or measure
//! what the pages buy.
//!
//!   cargo run --release -p p09_kv_manager -- --model smollm2 --port 8000
//!   cargo run --release -p p09_kv_manager -- bench

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use p09_kv_manager::serve::ServeArgs;

#[derive(Debug, Parser)]
#[command(
    about = "Project 09: paged K/V memory and prefix caching under continuous batching, behind the OpenAI API"
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
    /// Fragmentation, sequences per budget, cold vs warm TTFT, hit rate, indirection cost, n = 4 forks.
    Bench(p09_kv_manager::bench::BenchArgs),
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
        Some(Cmd::Bench(a)) => p09_kv_manager::bench::run(&a),
    }
}

async fn serve(cli: ServeArgs) -> Result<()> {
    p09_kv_manager::serve::serve(cli, |path| Ok(p06_server::load::load_f32(path)?)).await
}
