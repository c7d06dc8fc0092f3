//! `cargo run --release -p p04_transformer -- inspect --model FILE.gguf`: a thin front.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(about = "Project 04: transformer engine (GGUF loader so far)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Architecture, parameter count, bytes by dtype, FLOPs per token.
    Inspect {
        /// A GGUF file (default: the fetched SmolLM2-135M-Instruct).
        #[arg(long)]
        model: Option<PathBuf>,
    },
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Inspect { model } => {
            let path = match model {
                Some(p) => p,
                None => common::assets::ensure(common::assets::Asset::SmolLm2)
                    .map_err(anyhow::Error::msg)?,
            };
            let f = p04_transformer::GgufFile::open(&path)?;
            print!("{}", p04_transformer::inspect::summary(&f.header)?);
            Ok(())
        }
    }
}
