//! `cargo run --release -p p03_gpu_kernel -- info | bench`: a thin front.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    about = "Project 03: CUDA kernels through cudarc, timed against measured ceilings and cuBLAS"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Which CUDA libraries load, the device, and whether the kernels compile for it.
    Info,
    /// The kernels' PTX for a compute capability (NVRTC only, no GPU): read
    /// what the compiler made of them, or feed it to `ptxas -v`.
    Ptx {
        /// Compute capability as major and minor digits (90 = H100/H200).
        #[arg(long, default_value_t = 90)]
        sm: u32,
        /// Write here instead of standard output.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Ceilings, then every kernel against them; rows to numbers.md (or --rows).
    Bench {
        /// Square matmul sizes.
        #[arg(long, default_value = "1024,2048,4096,8192", value_delimiter = ',')]
        sizes: Vec<usize>,
        /// Fewer repetitions: a smoke run.
        #[arg(long)]
        quick: bool,
        /// Append the rows here instead of the workspace's numbers.md.
        #[arg(long)]
        rows: Option<PathBuf>,
        /// The commit these binaries were built at (for a tree without git).
        #[arg(long)]
        commit: Option<String>,
        /// Write the matmul plot into this directory.
        #[arg(long)]
        plots: Option<PathBuf>,
        /// Record nothing.
        #[arg(long)]
        no_record: bool,
    },
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Info => info(),
        Cmd::Ptx { sm, out } => {
            let arch = p03_gpu_kernel::kernels::virtual_arch((sm / 10) as i32, (sm % 10) as i32)
                .ok_or_else(|| {
                    anyhow::anyhow!("--sm {sm}: not a compute capability this lab knows")
                })?;
            let ptx = p03_gpu_kernel::gpu::compile(Some(arch))?.to_src();
            match out {
                Some(path) => std::fs::write(&path, ptx)?,
                None => print!("{ptx}"),
            }
            Ok(())
        }
        Cmd::Bench {
            sizes,
            quick,
            rows,
            commit,
            plots,
            no_record,
        } => {
            if sizes.is_empty() || sizes.contains(&0) {
                bail!("--sizes needs positive sizes");
            }
            let rows = (!no_record).then(|| {
                rows.unwrap_or_else(|| common::assets::workspace_root().join("numbers.md"))
            });
            p03_gpu_kernel::bench::run(&p03_gpu_kernel::bench::BenchArgs {
                sizes,
                quick,
                rows,
                commit,
                plots: plots.or_else(|| {
                    Some(common::assets::workspace_root().join("p03_gpu_kernel/plots"))
                }),
                command: common::numbers::command_line("p03_gpu_kernel"),
            })
        }
    }
}

fn info() -> Result<()> {
    use p03_gpu_kernel::probe;
    for (what, found) in [
        ("driver", probe::driver()),
        ("NVRTC", probe::nvrtc()),
        ("cuBLAS", probe::cublas()),
    ] {
        match found {
            Ok(lib) => println!("{what:<7} {lib}"),
            Err(e) => println!("{what:<7} missing: {e}"),
        }
    }
    let gpu = p03_gpu_kernel::Gpu::new(0)?;
    let info = gpu.info();
    println!("device  {}", info.describe());
    println!(
        "        {:.1} GiB, L2 {} MiB, {} KiB shared memory per block, clock {} MHz",
        info.total_mem_bytes as f64 / (1u64 << 30) as f64,
        info.l2_bytes >> 20,
        info.max_shared_per_block >> 10,
        info.clock_khz / 1000
    );
    println!(
        "kernels compiled and loaded: {}",
        p03_gpu_kernel::kernels::NAMES.join(", ")
    );
    Ok(())
}
