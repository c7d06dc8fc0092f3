//! `p06_server`: serve a model over the OpenAI API, or benchmark any
//! OpenAI-compatible server.
//!
//!   cargo run --release -p p06_server -- --model smollm2
//!   cargo run --release -p p06_server -- bench --url http://127.0.0.1:8000 --rate 2 --num-requests 100

use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
#[cfg(feature = "bench")]
use p06_server::bench::BenchArgs;
use p06_server::server;
use p06_server::AppState;

#[derive(Debug, Parser)]
#[command(
    about = "Project 06: an OpenAI-compatible server, and a load generator for any such server"
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
    /// Drive an OpenAI-compatible server and report TTFT, TPOT, ITL, E2EL, throughput.
    Bench(Box<BenchArgs>),
}

#[derive(Clone, Debug, Args)]
struct ServeArgs {
    #[command(flatten)]
    listen: server::ListenArgs,
    /// Requests that may wait behind the running one; more get 429.
    #[arg(long, default_value_t = 64)]
    max_waiting: usize,
    /// Serve no model here: forward every request to this OpenAI-compatible
    /// server (e.g. http://127.0.0.1:8080) through `common::client::RemoteEngine`,
    /// under the served model name.
    #[arg(long)]
    upstream: Option<String>,
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
        Some(Cmd::Bench(a)) => rt.block_on(p06_server::bench::run(*a)),
    }
}

async fn serve(a: ServeArgs) -> Result<()> {
    if let Some(up) = &a.upstream {
        let listener = a.listen.bind().await?;
        let engine = Arc::new(common::client::RemoteEngine::new(up, &a.listen.name()));
        let state = AppState::new(engine, a.listen.max_body_bytes);
        println!("ready: forwarding to {up}");
        return Ok(server::run_until_signal(listener, state, a.listen.grace()).await?);
    }
    let max_waiting = a.max_waiting;
    server::serve_model(&a.listen, move |path, name| {
        Ok(Arc::new(p06_server::SerialEngine::load(
            path,
            name,
            max_waiting,
        )?))
    })
    .await
}
