//! The one way this workspace builds and serves a model: the weights
//! choice ([`Weights`]), the flags that pick the kernels ([`LoadArgs`]),
//! and the server the README runs ([`serve`]: Project 09's paged
//! continuous batching behind Project 06's HTTP layer). Project 10's
//! binary, Project 13's ranks, Project 14's workers and Project 15's
//! agents all take these flags and load through [`LoadArgs::load`].
//!
//! ```text
//! p10_quant serve --model smollm2 --port 8000              native blocks, integer kernels
//! p10_quant serve --weights f32                            dequantised at load (Projects 04-09)
//! p10_quant serve --batch-variant-f32-prefill              faster long prefill, NOT batch-invariant
//! ```

use std::path::Path;

use crate::loader::{self, NativeWeights, Weights};
use clap::Args;
use p05_kv_cache::load::LoadedEngine;

/// How a server loads its model: every server's flags.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Args)]
pub struct LoadArgs {
    /// Weight format of the projections.
    #[arg(long, value_enum, default_value = "native")]
    pub weights: Weights,
    /// Native weights: products of 16 rows or more (long prompts, large
    /// batches) on the f32 path. Faster prefill on some machines, but NOT
    /// batch-invariant: a request's tokens then depend on what shares its
    /// steps.
    #[arg(long)]
    pub batch_variant_f32_prefill: bool,
}

impl LoadArgs {
    pub fn of(weights: Weights) -> LoadArgs {
        LoadArgs {
            weights,
            batch_variant_f32_prefill: false,
        }
    }

    /// The kernels native weights run on.
    pub fn kernels(&self) -> NativeWeights {
        match self.batch_variant_f32_prefill {
            true => NativeWeights::batch_variant(),
            false => NativeWeights::detect(),
        }
    }

    /// The model at `path`, ready to serve.
    pub fn load(&self, path: &Path) -> anyhow::Result<LoadedEngine> {
        match self.weights {
            Weights::Native => loader::load_native(path, self.kernels()),
            Weights::F32 => loader::load_f32(path),
        }
    }

    /// One line for the log: what the products run on.
    pub fn describe(&self) -> String {
        match (self.weights, self.batch_variant_f32_prefill) {
            (Weights::F32, _) => "f32 weights".into(),
            (Weights::Native, false) => format!(
                "native weights, {} kernels, every product on the integer kernels: batch-invariant",
                self.kernels().dot.isa()
            ),
            (Weights::Native, true) => format!(
                "native weights, {} kernels, products of 16+ rows in f32: not batch-invariant",
                self.kernels().dot.isa()
            ),
        }
    }

    /// The same flags for another process of this workspace.
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec!["--weights".to_string(), self.weights.as_str().to_string()];
        if self.batch_variant_f32_prefill {
            v.push("--batch-variant-f32-prefill".into());
        }
        v
    }
}

/// `p10_quant serve`: the README's server.
#[cfg(feature = "http")]
#[derive(Clone, Debug, Args)]
#[group(skip)] // Project 09's flags are a group named `ServeArgs` already
pub struct ServeArgs {
    #[command(flatten)]
    pub serve: p09_kv_manager::serve::ServeArgs,
    #[command(flatten)]
    pub load: LoadArgs,
}

#[cfg(feature = "http")]
/// Serve until SIGINT/SIGTERM (the model loads in the background:
/// `/health` answers 503 until it is ready).
pub async fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let load = a.load;
    eprintln!("{}", load.describe());
    p09_kv_manager::serve::serve(a.serve, move |path| load.load(path)).await
}

#[cfg(feature = "http")]
/// [`serve`] on a runtime of its own (what a binary's `main` calls).
pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| anyhow::anyhow!("starting the tokio runtime: {e}"))?
        .block_on(serve(a))
}

#[cfg(all(test, feature = "http"))]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    /// clap's own checks of the flags (unique names and groups), and
    /// the flags reaching the fields they name.
    #[test]
    fn the_serve_flags_are_well_formed_and_reach_their_fields() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from(["serve", "--weights", "f32", "--batch-variant-f32-prefill"])
            .unwrap();
        assert_eq!(cli.serve.load.weights, Weights::F32);
        assert!(cli.serve.load.batch_variant_f32_prefill);
        let back = Cli::try_parse_from(
            std::iter::once("serve".to_string()).chain(cli.serve.load.to_args()),
        )
        .unwrap();
        assert_eq!(back.serve.load, cli.serve.load);
    }
}
