//! The engine core: requests, their K/V caches and the model, driven one
//! step at a time (nano-vllm's `LLMEngine.step()`, vLLM's `EngineCore`).
//!
//! ```text
//! step():  plan = scheduler.schedule()        which sequences, how many tokens each
//!          run(plan)                          one batched, ragged forward (Project 07)
//!          postprocess(plan, logits)          sample, stream, retire
//! ```
//!
//! No threads and no channels here: the serving engine ([`crate::engine`])
//! calls [`EngineCore::step`] in a loop on its model thread, and the tests
//! call it directly to watch each step.

use std::collections::HashMap;

use common::batch::{Batch, BatchModel};
use p04_transformer::Tokenizer;
use p05_kv_cache::generate::{GenerateError, GenerateParams, Sequence, Step};
use p05_kv_cache::kv_cache::KvCache;
use thiserror::Error;

use crate::scheduler::{Scheduler, SchedulerConfig, SchedulerError, SeqId, StepCost, StepPlan};

/// The continuous batcher's knobs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ContinuousConfig {
    /// Token budget of one step (decode tokens + prefill chunks).
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// K/V memory for all running sequences.
    pub kv_cache_bytes: usize,
    /// How many steps a waiting request that does not fit in memory may see
    /// later arrivals admitted ahead of it.
    pub max_passed_over: usize,
    /// Requests that may wait; more get 429.
    pub max_waiting: usize,
    /// Cap on prefill tokens while streams decode (None: the budget only).
    pub step_cost: Option<StepCost>,
}

/// The step-time model measured by `bench-budget` on a 2-core AVX2 EPYC
/// (SmolLM2, f32): a step costs as much as ~14 prompt tokens before any
/// work, and a decode token at position 256 as much as ~1.7 prompt tokens.
/// These are ratios, so they move less between machines than the times.
pub const MEASURED_STEP_COST: StepCost = StepCost {
    itl_factor: 1.8,
    fixed_tokens: 14.0,
    decode_tokens: 1.7,
};

impl Default for ContinuousConfig {
    /// The defaults for SmolLM2-135M on a 2-core CPU; see the README for
    /// the step-time model behind the token budget.
    fn default() -> Self {
        ContinuousConfig {
            max_num_batched_tokens: 512,
            max_num_seqs: 16,
            kv_cache_bytes: 4 << 30,
            max_passed_over: 32,
            max_waiting: 256,
            step_cost: Some(MEASURED_STEP_COST),
        }
    }
}

#[derive(Debug, Error)]
pub enum AddError<E: std::error::Error + 'static> {
    /// The request does not fit the model's context or has bad settings.
    #[error(transparent)]
    Request(#[from] GenerateError<E>),
    /// It could not run even alone in the K/V memory, or its id is taken.
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
}

/// A sequence that sampled in this step.
#[derive(Clone, Debug)]
pub struct SeqOutput {
    pub id: SeqId,
    pub step: Step,
    /// The token joins the output (false for a stop token).
    pub is_token: bool,
    /// Prompt and generated tokens so far.
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// What one step did.
#[derive(Debug, Default)]
pub struct StepOutput {
    pub plan: StepPlan,
    /// Sequences that sampled, in batch order; those whose `step.finish` is
    /// set have been retired.
    pub outputs: Vec<SeqOutput>,
    /// Sequences retired because the step failed, with the reason.
    pub failed: Vec<(SeqId, String)>,
}

/// A request the core holds: its generation state and, while running, its K/V.
#[derive(Debug)]
struct Request {
    seq: Sequence,
    kv: Option<KvCache>,
}

pub struct EngineCore<'a, M: BatchModel> {
    model: &'a M,
    tok: &'a Tokenizer,
    scheduler: Scheduler,
    requests: HashMap<SeqId, Request>,
    bytes_per_position: usize,
    workspace: M::Workspace,
    batch: Batch,
    /// (n_seqs, vocab)
    logits: Vec<f32>,
}

impl<M: BatchModel> std::fmt::Debug for EngineCore<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineCore")
            .field("scheduler", &self.scheduler)
            .field("requests", &self.requests.len())
            .finish_non_exhaustive()
    }
}

impl<'a, M: BatchModel> EngineCore<'a, M> {
    pub fn new(
        model: &'a M,
        tok: &'a Tokenizer,
        config: &ContinuousConfig,
    ) -> Result<Self, SchedulerError> {
        let shape = model.kv_shape();
        let bytes_per_position = shape.bytes_per_position().max(1);
        let scheduler = Scheduler::new(SchedulerConfig {
            max_num_batched_tokens: config.max_num_batched_tokens,
            max_num_seqs: config.max_num_seqs,
            kv_positions: config.kv_cache_bytes / bytes_per_position,
            max_passed_over: config.max_passed_over,
            step_cost: config.step_cost,
        })?;
        Ok(EngineCore {
            model,
            tok,
            scheduler,
            requests: HashMap::new(),
            bytes_per_position,
            workspace: model.new_workspace(),
            batch: Batch::new(),
            logits: Vec::new(),
        })
    }

    /// Queue a request. Returns false when it is finished before it starts
    /// (`max_tokens == 0`); it is then not held.
    pub fn add(
        &mut self,
        id: SeqId,
        prompt: &[u32],
        params: &GenerateParams,
    ) -> Result<bool, AddError<M::Error>> {
        let seq = Sequence::new::<M::Error>(self.model.info(), prompt, params)?;
        if seq.is_finished() {
            return Ok(false);
        }
        self.scheduler.add(
            id,
            prompt.len(),
            prompt.len().saturating_add(params.max_tokens),
        )?;
        self.requests.insert(id, Request { seq, kv: None });
        Ok(true)
    }

    /// Cancel a request, freeing its K/V. Returns its (prompt, generated)
    /// token counts if it was held.
    pub fn abort(&mut self, id: SeqId) -> Option<(usize, usize)> {
        self.scheduler.remove(id);
        let r = self.requests.remove(&id)?;
        Some((r.seq.prompt_tokens(), r.seq.generated_tokens()))
    }

    pub fn has_work(&self) -> bool {
        !self.scheduler.is_idle()
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Bytes of K/V allocated to running sequences (their caches' capacity).
    pub fn kv_bytes(&self) -> usize {
        self.requests
            .values()
            .filter_map(|r| r.kv.as_ref())
            .map(KvCache::allocated_bytes)
            .sum()
    }

    /// The K/V budget in bytes (whole positions).
    pub fn kv_capacity_bytes(&self) -> usize {
        self.scheduler.config().kv_positions * self.bytes_per_position
    }

    /// One iteration: schedule → run → post-process.
    pub fn step(&mut self) -> StepOutput {
        let plan = self.schedule();
        if plan.is_empty() {
            return StepOutput {
                plan,
                ..StepOutput::default()
            };
        }
        match self.run(&plan) {
            Ok(()) => {
                let outputs = self.postprocess(&plan);
                StepOutput {
                    plan,
                    outputs,
                    failed: Vec::new(),
                }
            }
            Err(e) => {
                // A fault of the step fails every sequence in it; the
                // others (waiting) are untouched.
                let failed = plan
                    .seqs
                    .iter()
                    .map(|s| {
                        self.abort(s.id);
                        (s.id, e.clone())
                    })
                    .collect();
                StepOutput {
                    plan,
                    outputs: Vec::new(),
                    failed,
                }
            }
        }
    }

    /// Plan the step and apply its memory decisions: preempted sequences
    /// lose their K/V; admitted ones get a cache; growing ones a larger one.
    fn schedule(&mut self) -> StepPlan {
        let plan = self.scheduler.schedule();
        for id in &plan.preempted {
            if let Some(r) = self.requests.get_mut(id) {
                r.kv = None;
            }
        }
        let shape = self.model.kv_shape();
        for s in &plan.seqs {
            if let Some(r) = self.requests.get_mut(&s.id) {
                match &mut r.kv {
                    Some(kv) if kv.max_seq < s.allocated => kv.grow(s.allocated),
                    Some(_) => {}
                    None => {
                        r.kv = Some(KvCache::new(
                            shape.n_layer,
                            shape.n_kv_head,
                            shape.head_dim,
                            s.allocated,
                        ))
                    }
                }
            }
        }
        plan
    }

    /// One batched, ragged forward over every scheduled chunk: a decode
    /// token, a prompt chunk, or a preempted sequence's recomputation.
    fn run(&mut self, plan: &StepPlan) -> Result<(), String> {
        self.batch.clear();
        // The caches leave their requests for the step (a move, not a copy).
        let mut caches: Vec<KvCache> = Vec::with_capacity(plan.seqs.len());
        let mut result = Ok(());
        for s in &plan.seqs {
            let Some(r) = self.requests.get_mut(&s.id) else {
                result = Err(format!("sequence {} is scheduled but not held", s.id));
                break;
            };
            let tokens = r.seq.history().get(s.start..s.start + s.len);
            let (Some(tokens), Some(kv)) = (tokens, r.kv.take()) else {
                result = Err(format!(
                    "sequence {} has no tokens or K/V for its chunk",
                    s.id
                ));
                break;
            };
            caches.push(kv);
            if let Err(e) = self.batch.push(tokens, s.start) {
                result = Err(e.to_string());
                break;
            }
        }
        if result.is_ok() {
            let vocab = self.model.info().vocab_size;
            self.logits.resize(plan.seqs.len() * vocab, 0.0);
            let mut stores: Vec<&mut KvCache> = caches.iter_mut().collect();
            result = self
                .model
                .forward_batch(
                    &self.batch,
                    &mut stores,
                    &mut self.workspace,
                    &mut self.logits,
                )
                .map_err(|e| e.to_string());
        }
        // Caches go back to their requests, whatever happened.
        for (s, kv) in plan.seqs.iter().zip(caches) {
            if let Some(r) = self.requests.get_mut(&s.id) {
                r.kv = Some(kv);
            }
        }
        result
    }

    /// Sample where a chunk reached the end of its sequence; retire the
    /// finished.
    fn postprocess(&mut self, plan: &StepPlan) -> Vec<SeqOutput> {
        let vocab = self.model.info().vocab_size;
        let mut outputs = Vec::new();
        for (row, s) in plan.seqs.iter().enumerate() {
            let Some(r) = self.requests.get_mut(&s.id) else {
                continue;
            };
            if !s.samples {
                self.scheduler.on_step(s.id, s.len, false);
                continue;
            }
            let before = r.seq.generated_tokens();
            let logits = &mut self.logits[row * vocab..(row + 1) * vocab];
            let step = r.seq.on_logits(logits, self.tok);
            let is_token = r.seq.generated_tokens() > before;
            self.scheduler.on_step(s.id, s.len, is_token);
            let out = SeqOutput {
                id: s.id,
                is_token,
                prompt_tokens: r.seq.prompt_tokens(),
                completion_tokens: r.seq.generated_tokens(),
                step,
            };
            if out.step.finish.is_some() {
                self.abort(s.id);
            }
            outputs.push(out);
        }
        outputs
    }
}
