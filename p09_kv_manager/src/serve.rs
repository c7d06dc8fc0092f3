//! The paged server: p06's HTTP layer, Project 08's continuous batcher on
//! [`PagedKv`] with prefix caching. Later projects serve through it with
//! their own model loader (Project 10: native quantised weights).

use std::path::Path;
use std::sync::Arc;

use clap::Args;
use common::batch::BatchModel;
use p05_kv_cache::load::LoadedEngine;
use p06_server::server;
use p08_continuous::cli::SchedArgs;
use p08_continuous::ContinuousEngine;

use crate::PagedKv;

#[derive(Clone, Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub listen: server::ListenArgs,
    #[command(flatten)]
    pub sched: SchedArgs,
    #[command(flatten)]
    pub paged: PagedArgs,
}

#[derive(Clone, Debug, Args)]
pub struct PagedArgs {
    /// Positions per K/V block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Turn prefix caching off.
    #[arg(long)]
    pub no_prefix_caching: bool,
}

/// Serve until SIGINT/SIGTERM, loading the model with `load` (in the
/// background: `/health` answers 503 until it is ready).
pub async fn serve<L>(cli: ServeArgs, load: L) -> anyhow::Result<()>
where
    L: FnOnce(&Path) -> anyhow::Result<LoadedEngine> + Send + 'static,
{
    let config = cli.sched.config();
    let paged = cli.paged.clone();
    server::serve_model(&cli.listen, move |path, name| {
        let (engine, tokenizer) = p06_server::load::with_tokenizer(path, load(path)?)?;
        let kv = PagedKv::new(
            engine.kv_shape(),
            paged.block_size,
            config.kv_cache_bytes,
            !paged.no_prefix_caching,
        )?;
        let engine = ContinuousEngine::start_with_backend(
            Arc::new(engine),
            Arc::new(tokenizer),
            name,
            config,
            kv,
        )?;
        Ok(Arc::new(engine))
    })
    .await
}
