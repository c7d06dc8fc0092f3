//! `p14_distributed`: disaggregated prefill and decode.
//!
//!   cargo run --release -p p14_distributed -- up --prefill 1 --decode 1 --port 8000
//!   cargo run --release -p p14_distributed -- prefill --etcd http://192.0.2.1:2379 --host 192.0.2.2
//!   cargo run --release -p p14_distributed -- decode  --etcd http://192.0.2.1:2379 --host 192.0.2.3
//!   cargo run --release -p p14_distributed -- proxy   --etcd http://192.0.2.1:2379 --port 8000
//!   cargo run --release -p p14_distributed -- bench-transfer
//!   cargo run --release -p p14_distributed -- bench-migrate

use anyhow::Result;
use clap::{Parser, Subcommand};
use p14_distributed::proxy_serve::{ProxyArgs, UpArgs};
use p14_distributed::registry::Role;
use p14_distributed::worker_serve::{self, WorkerArgs};

#[derive(Debug, Parser)]
#[command(
    about = "Project 14: prefill and decode workers over etcd and NATS, a K/V transfer protocol, a proxy speaking the OpenAI API"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// A local cluster in one command: etcd, NATS, the workers and the proxy.
    Up(UpArgs),
    /// A prefill worker.
    Prefill(WorkerArgs),
    /// A decode worker.
    Decode(WorkerArgs),
    /// The proxy (the OpenAI API) in front of the registered workers.
    Proxy(ProxyArgs),
    #[cfg(feature = "bench")]
    /// One prompt's K/V over the transfer protocol against prompt length, on loopback and 1/10/25 Gbit/s links, beside the link's TCP ceiling and Mooncake's transfer engine.
    BenchTransfer(p14_distributed::bench_transfer::TransferArgs),
    #[cfg(feature = "bench")]
    /// Decode streams' ITL under a mixed long-prompt/short-decode load: 1P1D pinned one core each against the co-located engine.
    BenchItl(p14_distributed::bench_itl::ItlArgs),
    #[cfg(feature = "bench")]
    /// Prefill and decode workers on two hosts (network namespaces, shaped links): TTFT split, and sending K/V against recomputing it.
    BenchHosts(p14_distributed::bench_hosts::HostsArgs),
    #[cfg(feature = "bench")]
    /// A decode worker SIGKILLed mid-stream, 1P2D: the pause the client sees until the migrated request's next token, against recomputing it from nothing; every migrated stream checked against an uncut run.
    BenchMigrate(p14_distributed::bench_migrate::MigrateArgs),
    #[cfg(feature = "bench")]
    /// Goodput at a TTFT and TPOT SLO for P:D ratios 1P1D, 2P1D, 1P2D against the co-located engine, one Poisson load.
    BenchRatios(p14_distributed::bench_ratios::RatiosArgs),
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Up(a) => worker_serve_up(a),
        Cmd::Prefill(a) => worker_serve::run(Role::Prefill, a),
        Cmd::Decode(a) => worker_serve::run(Role::Decode, a),
        Cmd::Proxy(a) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(p14_distributed::proxy_serve::run(a)),
        #[cfg(feature = "bench")]
        Cmd::BenchTransfer(a) => p14_distributed::bench_transfer::run(&a),
        #[cfg(feature = "bench")]
        Cmd::BenchItl(a) => p14_distributed::bench_itl::run(&a),
        #[cfg(feature = "bench")]
        Cmd::BenchHosts(a) => p14_distributed::bench_hosts::run(&a),
        #[cfg(feature = "bench")]
        Cmd::BenchRatios(a) => p14_distributed::bench_ratios::run(&a),
        #[cfg(feature = "bench")]
        Cmd::BenchMigrate(a) => p14_distributed::bench_migrate::run(&a),
    }
}

fn worker_serve_up(a: UpArgs) -> Result<()> {
    p14_distributed::proxy_serve::up(a)
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
