//! bench
use clap::Args;

#[derive(Clone, Debug, Args)]
pub struct BenchArgs {}

pub async fn run(_a: BenchArgs) -> anyhow::Result<()> {
    Ok(())
}
