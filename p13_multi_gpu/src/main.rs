//! `p13_multi_gpu`: serve SmolLM2 split across tensor-parallel ranks.
//!
//!   cargo run --release -p p13_multi_gpu -- serve --model smollm2 --tp 3 --port 8000

use anyhow::Result;
use clap::{Parser, Subcommand};
use p13_multi_gpu::serve::{RankArgs, TpServeArgs};

#[derive(Parser, Debug)]
#[command(
    name = "p13_multi_gpu",
    about = "Project 13: one model split across tensor-parallel ranks (processes joined by TCP), served behind the OpenAI API"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Rank 0: the OpenAI API; starts the other ranks unless --peers names them.
    Serve(TpServeArgs),
    /// A rank other than 0 (started by `serve`, or by hand on another host).
    Rank(RankArgs),
    /// All-reduce latency and bandwidth, 4 B to 64 MiB, over threads and TCP, beside torch's gloo.
    #[cfg(feature = "bench")]
    BenchAllreduce(p13_multi_gpu::bench::AllReduceArgs),
    /// One sequence's prefill and decode at TP = 1 and 3 and PP = 3 (ranks as threads), communication's share, bytes per rank.
    #[cfg(feature = "bench")]
    BenchDecode(p13_multi_gpu::bench_decode::DecodeArgs),
    /// TP = 3 and PP = 3 decode with each rank on a simulated host (a network namespace), links delayed 0 to 1 ms or capped, beside an α–β model.
    #[cfg(feature = "bench")]
    BenchLinks(p13_multi_gpu::bench_links::LinksArgs),
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Serve(a) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(p13_multi_gpu::serve::serve(a)),
        Cmd::Rank(a) => p13_multi_gpu::serve::rank(a),
        #[cfg(feature = "bench")]
        Cmd::BenchAllreduce(a) => p13_multi_gpu::bench::all_reduce(&a),
        #[cfg(feature = "bench")]
        Cmd::BenchDecode(a) => p13_multi_gpu::bench_decode::run(&a),
        #[cfg(feature = "bench")]
        Cmd::BenchLinks(a) => p13_multi_gpu::bench_links::run(&a),
    }
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
