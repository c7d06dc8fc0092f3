//! Placeholder, filled below.
use anyhow::Result;
use clap::Args;

#[derive(Clone, Debug, Args)]
pub struct BudgetArgs {}
#[derive(Clone, Debug, Args)]
pub struct ServeArgs {}

pub fn budget(_a: &BudgetArgs) -> Result<()> {
    Ok(())
}
pub async fn serve(_a: &ServeArgs) -> Result<()> {
    Ok(())
}
