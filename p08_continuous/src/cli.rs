//! The scheduler's command-line knobs (vLLM's names), shared by the p08
//! server and the servers that compose it (p09's paged one).

use clap::Args;

use crate::core::{ContinuousConfig, MEASURED_STEP_COST};
use crate::scheduler::StepCost;

#[derive(Clone, Debug, Args)]
pub struct SchedArgs {
    /// Token budget of one step: decode tokens plus prefill chunks.
    #[arg(long, default_value_t = ContinuousConfig::default().max_num_batched_tokens)]
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    #[arg(long, default_value_t = ContinuousConfig::default().max_num_seqs)]
    pub max_num_seqs: usize,
    /// K/V memory for all running sequences, in MiB.
    #[arg(long, default_value_t = ContinuousConfig::default().kv_cache_bytes >> 20)]
    pub kv_cache_mib: usize,
    /// Steps a waiting request that does not fit may see later arrivals go ahead of it.
    #[arg(long, default_value_t = ContinuousConfig::default().max_passed_over)]
    pub max_passed_over: usize,
    /// Requests that may wait; more get 429.
    #[arg(long, default_value_t = ContinuousConfig::default().max_waiting)]
    pub max_waiting: usize,
    /// While streams decode, cap prefill so a step takes at most this many
    /// times a decode-only step (0 turns the cap off: the budget only).
    #[arg(long, default_value_t = MEASURED_STEP_COST.itl_factor)]
    pub itl_factor: f64,
    /// The step-time model (see `p08_continuous bench-budget`): a step's fixed cost, in prompt tokens.
    #[arg(long, default_value_t = MEASURED_STEP_COST.fixed_tokens)]
    pub step_fixed_tokens: f64,
    /// The step-time model: one decode token's cost, in prompt tokens.
    #[arg(long, default_value_t = MEASURED_STEP_COST.decode_tokens)]
    pub step_decode_tokens: f64,
    /// The step-time model: the position at which a prompt token's attention doubles its cost.
    #[arg(long, default_value_t = MEASURED_STEP_COST.attn_positions)]
    pub step_attn_positions: f64,
}

impl SchedArgs {
    pub fn config(&self) -> ContinuousConfig {
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
