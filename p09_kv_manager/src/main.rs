//! `p09_kv_manager`: serve a model over the OpenAI API with Project 08's
//! continuous batching on paged K/V memory with prefix caching, or measure
//! what the pages buy.
//!
//!   cargo run --release -p p09_kv_manager -- --model smollm2 --port 8000
//!   cargo run --release -p p09_kv_manager -- bench

use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use common::batch::BatchModel;
use p06_server::server;
use p08_continuous::cli::SchedArgs;
use p08_continuous::ContinuousEngine;
use p09_kv_manager::PagedKv;

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
    /// Fragmentation, sequences per budget, cold vs warm TTFT, hit rate, indirection cost, n = 4 forks.
    Bench(p09_kv_manager::bench::BenchArgs),
}

#[derive(Clone, Debug, Args)]
struct ServeArgs {
    #[command(flatten)]
    listen: server::ListenArgs,
    #[command(flatten)]
    sched: SchedArgs,
    #[command(flatten)]
    paged: PagedArgs,
}

#[derive(Clone, Debug, Args)]
struct PagedArgs {
    /// Positions per K/V block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Turn prefix caching off.
    #[arg(long)]
    no_prefix_caching: bool,
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
        Some(Cmd::Bench(a)) => p09_kv_manager::bench::run(&a),
    }
}

async fn serve(cli: ServeArgs) -> Result<()> {
    let name = cli.listen.name();
    let listener = cli.listen.bind().await?;
    let config = cli.sched.config();
    let paged = cli.paged.clone();
    let spec = cli.listen.model.clone();
    let state = server::load_in_background(&name, cli.listen.max_body_bytes, move |name| {
        let path = server::resolve_model(&spec)?;
        let loaded =
            p05_kv_cache::load::load(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let tokenizer = loaded
            .tokenizer
            .ok_or_else(|| format!("{} has no tokenizer to serve text with", path.display()))?;
        let kv = PagedKv::new(
            loaded.engine.kv_shape(),
            paged.block_size,
            config.kv_cache_bytes,
            !paged.no_prefix_caching,
        )
        .map_err(|e| e.to_string())?;
        let engine = ContinuousEngine::start_with_backend(
            Arc::new(loaded.engine),
            Arc::new(tokenizer),
            name,
            config,
            kv,
        )?;
        Ok(Arc::new(engine))
    });
    Ok(server::run_until_signal(listener, state, cli.listen.grace()).await?)
}
