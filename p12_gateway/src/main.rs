//! `p12_gateway --config gateway.toml`: the gateway in front of the
//! backends its config names. `p12_gateway hash-key <key>` prints the
//! SHA-256 the config stores for a key.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use p12_gateway::clock::SystemClock;
use p12_gateway::{build, router, Config};

#[derive(Parser)]
#[command(about = "Project 12: an inference gateway (keys, limits, routing, retries)")]
struct Args {
    /// The gateway's TOML config (see p12_gateway/gateway.toml).
    #[arg(long, default_value = "p12_gateway/gateway.toml")]
    config: PathBuf,
    /// Listen here instead of the config's `listen`.
    #[arg(long)]
    listen: Option<String>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the hex SHA-256 of a key, for the config's `sha256`.
    HashKey { key: String },
    /// Added latency vs direct, prefix affinity vs round-robin, a backend kill.
    #[cfg(feature = "bench")]
    Bench(p12_gateway::bench::BenchArgs),
}

fn main() -> Result<()> {
    let args = Args::parse();
    match args.cmd {
        Some(Cmd::HashKey { key }) => {
            println!("{}", p12_gateway::auth::hash_key(&key));
            Ok(())
        }
        #[cfg(feature = "bench")]
        Some(Cmd::Bench(a)) => p12_gateway::bench::run(&a),
        None => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(serve(args.config, args.listen)),
    }
}

async fn serve(config: PathBuf, listen: Option<String>) -> Result<()> {
    let mut cfg = Config::load(&config)?;
    if let Some(l) = listen {
        cfg.listen = l;
    }
    let listen = cfg.listen.clone();
    let g = Arc::new(build(cfg, Arc::new(SystemClock::default()))?);
    tokio::spawn(p12_gateway::health::run(g.clone()));
    tokio::spawn(p12_gateway::score::run(g.clone()));
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .with_context(|| format!("bind {listen}"))?;
    eprintln!("gateway listening on http://{listen}");
    axum::serve(listener, router(g))
        .with_graceful_shutdown(p06_server::server::shutdown_signal())
        .await?;
    Ok(())
}
