//! `cargo run --release -p p11_gpu_bench -- run`: a thin front.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    about = "Project 11: GPU characterisation suite (bandwidth, transfers, launch, GEMM, roofline, spread)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// The whole suite: rows, suite.json and plots.
    Run {
        /// Smaller sizes, fewer repetitions: a smoke run.
        #[arg(long)]
        quick: bool,
        /// Directory for suite.json and plots/ (default: p11_gpu_bench/).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Append rows here instead of the workspace's numbers.md.
        #[arg(long)]
        rows: Option<PathBuf>,
        /// The commit the binary was built at (for a tree without git).
        #[arg(long)]
        commit: Option<String>,
        /// Independent runs for the spread.
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// Record no rows.
        #[arg(long)]
        no_record: bool,
    },
    /// Redraw the plots from a suite.json (e.g. one the GPU machine returned).
    Plot {
        /// The directory holding suite.json.
        #[arg(long)]
        from: PathBuf,
        /// Where to write the PNGs (default: FROM/plots).
        #[arg(long)]
        to: Option<PathBuf>,
    },
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Run {
            quick,
            out,
            rows,
            commit,
            runs,
            no_record,
        } => {
            if runs < 2 {
                bail!("--runs needs at least 2 runs to measure a spread");
            }
            let root = common::assets::workspace_root();
            let args = p11_gpu_bench::suite::SuiteArgs {
                quick,
                out: out.unwrap_or_else(|| root.join("p11_gpu_bench")),
                rows: (!no_record).then(|| rows.unwrap_or_else(|| root.join("numbers.md"))),
                commit,
                runs,
                command: common::numbers::command_line("p11_gpu_bench"),
            };
            let report = p11_gpu_bench::suite::run(&args)?;
            for s in &report.spread {
                println!(
                    "spread {:<45} {:.2}% {}",
                    s.name,
                    100.0 * s.range_over_median,
                    if s.ok() { "ok" } else { "OVER 3%" }
                );
            }
            println!("wrote {}", args.out.join("suite.json").display());
            Ok(())
        }
        Cmd::Plot { from, to } => {
            let to = to.unwrap_or_else(|| from.join("plots"));
            p11_gpu_bench::report::replot(&from, &to)?;
            println!("plots -> {}", to.display());
            Ok(())
        }
    }
}
