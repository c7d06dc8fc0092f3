//! `cargo run --release -p p02_matmul_bench -- sweep | ceilings`: a thin front.

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(about = "Project 02: CPU sgemm from naive to near peak, measured against BLAS")]
struct Cli {
    /// Threads for the threaded rows (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Every variant and peer at every size, SmolLM2 shapes, the MNIST MLP; plots and numbers.md rows.
    Sweep {
        /// Square sizes N.
        #[arg(
            long,
            default_value = "64,128,256,512,1024,2048,4096",
            value_delimiter = ','
        )]
        sizes: Vec<usize>,
        /// Skip numpy/PyTorch (no .venv-ref needed).
        #[arg(long)]
        no_python: bool,
        /// Do not append to numbers.md.
        #[arg(long)]
        no_record: bool,
        /// Only the MNIST MLP comparison (quick; records nothing).
        #[arg(long)]
        mlp_only: bool,
    },
    /// Only the measured ceilings: peak FMA and memory bandwidth.
    Ceilings,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let threads = cli
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()?;
    match cli.cmd {
        Cmd::Sweep {
            sizes,
            no_python,
            no_record,
            mlp_only,
        } => {
            if sizes.is_empty() || sizes.contains(&0) {
                bail!("--sizes needs positive sizes");
            }
            p02_matmul_bench::sweep::run(&p02_matmul_bench::sweep::SweepArgs {
                sizes,
                threads,
                python: !no_python,
                record: !no_record && !mlp_only,
                mlp_only,
                command: common::numbers::command_line("p02_matmul_bench"),
            })
        }
        Cmd::Ceilings => {
            for t in [1, threads] {
                let (g, isa) = p02_matmul_bench::ceilings::peak_gflops(t);
                println!("peak {t} thread(s): {g:.1} GFLOP/s ({isa})");
                for bytes in [8usize << 20, 256 << 20] {
                    for b in p02_matmul_bench::ceilings::bandwidth(bytes, t, 5) {
                        println!(
                            "  {:<5} {:>4} MB/array: {:.1} GB/s",
                            b.kind,
                            bytes >> 20,
                            b.gbs
                        );
                    }
                }
            }
            Ok(())
        }
    }
}
