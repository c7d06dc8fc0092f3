//! `p15_platform server`: the model server a node agent runs, Project
//! 10's (native quantised or f32 weights on Project 09's paged continuous
//! batching, Project 06's HTTP layer: `/health` 503 while loading, 503 to
//! new requests and in-flight ones finished after SIGTERM).

use clap::{Args, ValueEnum};
use p09_kv_manager::serve::ServeArgs;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WeightsArg {
    Native,
    F32,
}

#[derive(Clone, Debug, Args)]
pub struct ServerArgs {
    #[command(flatten)]
    pub serve: ServeArgs,
    #[arg(long, value_enum, default_value_t = WeightsArg::Native)]
    pub weights: WeightsArg,
}

pub fn run(a: ServerArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let native = a.weights == WeightsArg::Native;
    rt.block_on(p09_kv_manager::serve::serve(
        a.serve,
        move |path| match native {
            true => p10_quant::loader::load_native(path, p10_quant::NativeWeights::detect()),
            false => p10_quant::loader::load(path, false),
        },
    ))
}
