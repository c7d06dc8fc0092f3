//! `p06_server`: serve a model over the OpenAI API, or benchmark any
//! OpenAI-compatible server.
//!
//!   cargo run --release -p p06_server -- --model smollm2
//!   cargo run --release -p p06_server -- bench --url http://127.0.0.1:8000 --rate 2 --num-requests 100

use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use p06_server::bench::BenchArgs;
use p06_server::server::{self, LoadingEngine};
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
        return run(listener, state, Duration::from_secs(a.shutdown_grace_s)).await;
    }
    let loading = Arc::new(LoadingEngine::new(&name));
    let state = AppState::new(loading.clone(), a.max_body_bytes);
    state.ready.store(false, Ordering::SeqCst);
    {
        let (state, spec, name) = (state.clone(), a.model.clone(), name.clone());
        let max_waiting = a.max_waiting;
        tokio::task::spawn_blocking(move || {
            let t0 = Instant::now();
            let engine = server::resolve_model(&spec)
                .and_then(|path| server::load_serial(&path, &name, max_waiting));
            match engine {
                Ok(e) => {
                    loading.set(Arc::new(e));
                    state.ready.store(true, Ordering::SeqCst);
                    println!("ready: model loaded in {:.1} s", t0.elapsed().as_secs_f64());
                    let _ = std::io::stdout().flush();
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    std::process::exit(1);
                }
            }
        });
    }
    run(listener, state, Duration::from_secs(a.shutdown_grace_s)).await
}

/// Serve until SIGTERM/SIGINT, then drain for `grace`.
async fn run(listener: tokio::net::TcpListener, state: AppState, grace: Duration) -> Result<()> {
    let shutdown = async move {
        server::shutdown_signal().await;
        println!("shutting down: draining for up to {} s", grace.as_secs());
        let _ = std::io::stdout().flush();
        // Connections that still will not close (a client that stopped
        // reading) do not hold the process past the deadline.
        tokio::spawn(async move {
            tokio::time::sleep(grace + Duration::from_secs(5)).await;
            eprintln!("shutdown deadline passed with connections open; exiting");
            std::process::exit(0);
        });
    };
    server::serve(listener, state, shutdown, grace).await?;
    println!("stopped");
    Ok(())
}
