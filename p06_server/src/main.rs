//! `p06_server`: serve a model over the OpenAI API, or benchmark any
//! OpenAI-compatible server.
//!
//!   cargo run --release -p p06_server -- --model smollm2
//!   cargo run --release -p p06_server -- bench --url http://127.0.0.1:8000 --rate 2 --num-requests 100

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
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
    /// Drive an OpenAI-compatible server and report TTFT, TPOT, ITL, E2EL, throughput.
    Bench(Box<BenchArgs>),
}

#[derive(Clone, Debug, Args)]
struct ServeArgs {
    /// `smollm2` (fetched on first run), a .gguf file or an HF Llama directory.
    #[arg(long, default_value = "smollm2")]
    model: String,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (the chosen one is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The name clients pass as `model` (default: SmolLM2-135M-Instruct or the file stem).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Requests that may wait behind the running one; more get 429.
    #[arg(long, default_value_t = 64)]
    max_waiting: usize,
    /// Larger request bodies get 413.
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
    /// Seconds in-flight requests get to finish after SIGTERM/SIGINT.
    #[arg(long, default_value_t = 30)]
    shutdown_grace_s: u64,
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
        Some(Cmd::Bench(a)) => rt.block_on(p06_server::bench::run(*a)),
    }
}

async fn serve(a: ServeArgs) -> Result<()> {
    let name = a
        .served_model_name
        .clone()
        .unwrap_or_else(|| server::served_name(&a.model));
    let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
        .await
        .with_context(|| format!("binding {}:{}", a.host, a.port))?;
    let addr = listener.local_addr()?;
    println!("listening on http://{addr} (model {name})");
    let _ = std::io::stdout().flush();

    if let Some(up) = &a.upstream {
        let engine = Arc::new(common::client::RemoteEngine::new(up, &name));
        let state = AppState::new(engine, a.max_body_bytes);
        println!("ready: forwarding to {up}");
        return Ok(server::run_until_signal(
            listener,
            state,
            Duration::from_secs(a.shutdown_grace_s),
        )
        .await?);
    }
    let (spec, max_waiting) = (a.model.clone(), a.max_waiting);
    let state = server::load_in_background(&name, a.max_body_bytes, move |name| {
        let path = server::resolve_model(&spec)?;
        Ok(Arc::new(server::load_serial(&path, name, max_waiting)?))
    });
    Ok(server::run_until_signal(listener, state, Duration::from_secs(a.shutdown_grace_s)).await?)
}
