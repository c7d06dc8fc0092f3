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
    let name = cli.listen.name();
    let listener = cli.listen.bind().await?;
    let config = cli.sched.config();
    let paged = cli.paged.clone();
    let spec = cli.listen.model.clone();
    let state = server::load_in_background(&name, cli.listen.max_body_bytes, move |name| {
        let path = server::resolve_model(&spec)?;
        let loaded = load(&path)?;
        let tokenizer = loaded
            .tokenizer
            .ok_or_else(|| p06_server::LoadError::NoTokenizer { path: path.clone() })?;
        let kv = PagedKv::new(
            loaded.engine.kv_shape(),
            paged.block_size,
            config.kv_cache_bytes,
            !paged.no_prefix_caching,
        )?;
        let engine = ContinuousEngine::start_with_backend(
            Arc::new(loaded.engine),
            Arc::new(tokenizer),
            name,
            config,
            kv,
        )?;
        Ok(Arc::new(engine))
    });
    Ok(server::run_until_signal(listener, state, cli.listen.grace()).await?)
}
