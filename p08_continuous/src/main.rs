//! `p08_continuous`: serve a model over the OpenAI API with continuous
//! batching, or measure the scheduler against the earlier engines and
//! llama.cpp's own server.
//!
//!   cargo run --release -p p08_continuous -- --model smollm2 --port 8000
//!   cargo run --release -p p08_continuous -- bench-budget
//!   cargo run --release -p p08_continuous -- bench-serve

use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use p06_server::server;
use p08_continuous::core::MEASURED_STEP_COST;
use p08_continuous::scheduler::StepCost;
use p08_continuous::{bench_cmd, ContinuousConfig, ContinuousEngine};

#[derive(Debug, Parser)]
#[command(
    about = "Project 08: continuous batching (chunked prefill, preemption) behind the OpenAI API"
)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Serve (the default).
    Serve(ServeArgs),
    /// The step-time model: step time vs prefill-chunk size beside running decodes; the default budget.
    BenchBudget(bench_cmd::BudgetArgs),
    /// Serial, p07, p08 and llama.cpp's server under the same load: throughput, TTFT, ITL, fairness.
    BenchServe(bench_cmd::ServeArgs),
}

#[derive(Clone, Debug, Args)]
struct ServeArgs {
    #[command(flatten)]
    listen: server::ListenArgs,
    #[command(flatten)]
    sched: SchedArgs,
}

/// The scheduler's knobs, with vLLM's names.
#[derive(Clone, Debug, Args)]
pub struct SchedArgs {
    /// Token budget of one step: decode tokens plus prefill chunks.
    #[arg(long, default_value_t = ContinuousConfig::default().max_num_batched_tokens)]
    max_num_batched_tokens: usize,
    /// Most sequences running at once.
    #[arg(long, default_value_t = ContinuousConfig::default().max_num_seqs)]
    max_num_seqs: usize,
    /// K/V memory for all running sequences, in MiB.
    #[arg(long, default_value_t = ContinuousConfig::default().kv_cache_bytes >> 20)]
    kv_cache_mib: usize,
    /// Steps a waiting request that does not fit may see later arrivals go ahead of it.
    #[arg(long, default_value_t = ContinuousConfig::default().max_passed_over)]
    max_passed_over: usize,
    /// Requests that may wait; more get 429.
    #[arg(long, default_value_t = ContinuousConfig::default().max_waiting)]
    max_waiting: usize,
    /// While streams decode, cap prefill so a step takes at most this many
    /// times a decode-only step (0 turns the cap off: the budget only).
    #[arg(long, default_value_t = MEASURED_STEP_COST.itl_factor)]
    itl_factor: f64,
    /// The step-time model (see `bench-budget`): a step's fixed cost, in prompt tokens.
    #[arg(long, default_value_t = MEASURED_STEP_COST.fixed_tokens)]
    step_fixed_tokens: f64,
    /// The step-time model: one decode token's cost, in prompt tokens.
    #[arg(long, default_value_t = MEASURED_STEP_COST.decode_tokens)]
    step_decode_tokens: f64,
    /// The step-time model: the position at which a prompt token's attention doubles its cost.
    #[arg(long, default_value_t = MEASURED_STEP_COST.attn_positions)]
    step_attn_positions: f64,
}

impl SchedArgs {
    fn config(&self) -> ContinuousConfig {
        ContinuousConfig {
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            kv_cache_bytes: self.kv_cache_mib.saturating_mul(1 << 20),
            max_passed_over: self.max_passed_over,
            max_waiting: self.max_waiting,
            step_cost: (self.itl_factor > 1.0).then_some(StepCost {
                itl_factor: self.itl_factor,
                fixed_tokens: self.step_fixed_tokens,
                decode_tokens: self.step_decode_tokens,
                attn_positions: self.step_attn_positions,
            }),
        }
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    match cli.cmd {
        None => rt.block_on(serve(cli.serve)),
        Some(Cmd::Serve(a)) => rt.block_on(serve(a)),
        Some(Cmd::BenchBudget(a)) => bench_cmd::budget(&a),
        Some(Cmd::BenchServe(a)) => rt.block_on(bench_cmd::serve(&a)),
    }
}

async fn serve(a: ServeArgs) -> Result<()> {
    let name = a.listen.name();
    let listener = a.listen.bind().await?;
    let config = a.sched.config();
    let spec = a.listen.model.clone();
    let state = server::load_in_background(&name, a.listen.max_body_bytes, move |name| {
        let path = server::resolve_model(&spec)?;
        let loaded =
            p05_kv_cache::load::load(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let tokenizer = loaded
            .tokenizer
            .ok_or_else(|| format!("{} has no tokenizer to serve text with", path.display()))?;
        let engine =
            ContinuousEngine::start(Arc::new(loaded.engine), Arc::new(tokenizer), name, config)?;
        Ok(Arc::new(engine))
    });
    Ok(server::run_until_signal(listener, state, a.listen.grace()).await?)
}
