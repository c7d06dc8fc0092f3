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
use thiserror::Error;

use crate::kv_backend::{Chunk, ContiguousKv, KvBackend};
use crate::scheduler::{
    Scheduler, SchedulerConfig, SchedulerError, SeqId, StepCost, StepPlan, TokenSource,
};

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
/// (SmolLM2, f32; two runs: fixed 12.8 and 13.4, decode 1.82 and 1.47,
/// attention 1,078): a step costs as much as ~13.5 prompt tokens before any
/// work, a decode token at position 256 as much as ~1.6 prompt tokens, and
/// a prompt token at position p costs 1 + p/1,100 (its attention). These are
/// ratios, so they move less between machines than the times do. The ITL
/// factor is 1.8, not 2, to leave room for the machine's noise under the
/// 2x target.
pub const MEASURED_STEP_COST: StepCost = StepCost {
    itl_factor: 1.8,
    fixed_tokens: 13.5,
    decode_tokens: 1.6,
    attn_positions: 1100.0,
};

impl ContinuousConfig {
    /// The scheduler's part of the knobs.
    pub fn scheduler_config(&self) -> SchedulerConfig {
        SchedulerConfig {
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_passed_over: self.max_passed_over,
            step_cost: self.step_cost,
        }
    }
}

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

/// Why a step's forward did not run. The backend's and the model's own
/// error types are kept (boxed: the core is generic over both), so a
/// caller can downcast and act on the kind (e.g. a full pool).
#[derive(Debug, Error)]
pub enum StepError {
    #[error("sequence {0} has no tokens for its chunk")]
    NoTokens(SeqId),
    #[error(transparent)]
    Batch(#[from] common::batch::BatchError),
    #[error("K/V stores: {0}")]
    Stores(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("forward: {0}")]
    Model(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// What one step did.
#[derive(Debug, Default)]
pub struct StepOutput {
    pub plan: StepPlan,
    /// Sequences that sampled, in batch order; those whose `step.finish` is
    /// set have been retired.
    pub outputs: Vec<SeqOutput>,
    /// Sequences retired because the step failed, with the reason (one
    /// error shared by every sequence of the failed step).
    pub failed: Vec<(SeqId, std::sync::Arc<StepError>)>,
    /// Choices of parallel sampling that forked their parent's K/V in this
    /// step and now run (they sampled their first token here).
    pub forked: Vec<SeqId>,
    /// Each sampling row's logits as the model gave them, before sampling,
    /// when the core records them ([`EngineCore::record_logits`]): what a
    /// test compares bit for bit across batch compositions.
    pub logits: Vec<(SeqId, Vec<f32>)>,
}

/// The requests the core holds: their generation state (their K/V is the
/// backend's).
#[derive(Debug, Default)]
struct Requests(HashMap<SeqId, Sequence>);

/// A choice of parallel sampling waiting for its parent's prompt.
#[derive(Debug)]
struct Pending {
    id: SeqId,
    seq: Sequence,
    max_len: usize,
}

impl TokenSource for Requests {
    fn tokens(&self, id: SeqId) -> &[u32] {
        self.0.get(&id).map_or(&[], |s| s.history())
    }
}

pub struct EngineCore<'a, M: BatchModel, B: KvBackend = ContiguousKv> {
    model: &'a M,
    tok: &'a Tokenizer,
    scheduler: Scheduler,
    requests: Requests,
    /// Parent → its other choices, forked when it samples its first token.
    pending: HashMap<SeqId, Vec<Pending>>,
    kv: B,
    workspace: M::Workspace,
    batch: Batch,
    /// (n_seqs, vocab)
    logits: Vec<f32>,
    /// Copy each sampling row's logits into the step's output.
    record_logits: bool,
}

impl<M: BatchModel, B: KvBackend> std::fmt::Debug for EngineCore<'_, M, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineCore")
            .field("scheduler", &self.scheduler)
            .field("requests", &self.requests.0.len())
            .finish_non_exhaustive()
    }
}

impl<'a, M: BatchModel> EngineCore<'a, M, ContiguousKv> {
    /// Project 08's core: contiguous caches within `config.kv_cache_bytes`.
    pub fn new(
        model: &'a M,
        tok: &'a Tokenizer,
        config: &ContinuousConfig,
    ) -> Result<Self, SchedulerError> {
        let kv = ContiguousKv::new(model.kv_shape(), config.kv_cache_bytes);
        EngineCore::with_backend(model, tok, config, kv)
    }
}

impl<'a, M: BatchModel, B: KvBackend> EngineCore<'a, M, B> {
    /// A core on any K/V backend (Project 09 brings paged blocks).
    pub fn with_backend(
        model: &'a M,
        tok: &'a Tokenizer,
        config: &ContinuousConfig,
        kv: B,
    ) -> Result<Self, SchedulerError> {
        let scheduler = Scheduler::new(config.scheduler_config())?;
        Ok(EngineCore {
            model,
            tok,
            scheduler,
            requests: Requests::default(),
            pending: HashMap::new(),
            kv,
            workspace: model.new_workspace(),
            batch: Batch::new(),
            logits: Vec::new(),
            record_logits: false,
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
        self.add_choices(&[id], prompt, params, b"")
    }

    /// Queue `ids.len()` choices of one prompt (parallel sampling, `n`).
    /// The first computes the prompt; when it samples its first token, the
    /// others fork its K/V (shared blocks on a paged backend) and sample
    /// from the same logits, choice `i` with seed `seed + i`. `salt` keys
    /// the prefix cache. False when all are finished before they start.
    pub fn add_choices(
        &mut self,
        ids: &[SeqId],
        prompt: &[u32],
        params: &GenerateParams,
        salt: &[u8],
    ) -> Result<bool, AddError<M::Error>> {
        let Some((&parent, others)) = ids.split_first() else {
            return Ok(false);
        };
        let info = self.model.info();
        let seq = Sequence::new::<M::Error>(info, prompt, params)?;
        if seq.is_finished() {
            return Ok(false);
        }
        let max_len = prompt.len().saturating_add(params.max_tokens);
        let mut children = Vec::with_capacity(others.len());
        for (i, &id) in (1u64..).zip(others) {
            if id == parent || self.is_held(id) || children.iter().any(|c: &Pending| c.id == id) {
                return Err(SchedulerError::Duplicate(id).into());
            }
            let mut p = params.clone();
            p.sampling.seed = Some(p.sampling.seed.unwrap_or(0).wrapping_add(i));
            let seq = Sequence::new::<M::Error>(info, prompt, &p)?;
            children.push(Pending { id, seq, max_len });
        }
        self.scheduler
            .add(parent, prompt.len(), max_len, self.kv.capacity_positions())?;
        for &id in ids {
            self.kv.set_salt(id, salt);
        }
        self.requests.0.insert(parent, seq);
        if !children.is_empty() {
            self.pending.insert(parent, children);
        }
        Ok(true)
    }

    /// Whether `id` is running, waiting or waiting for its parent.
    fn is_held(&self, id: SeqId) -> bool {
        self.requests.0.contains_key(&id) || self.pending.values().flatten().any(|c| c.id == id)
    }

    /// Cancel a request, freeing its K/V. Returns its (prompt, generated)
    /// token counts if it was held. Choices still waiting for it as their
    /// parent queue to compute the prompt themselves.
    pub fn abort(&mut self, id: SeqId) -> Option<(usize, usize)> {
        for c in self.pending.remove(&id).into_iter().flatten() {
            self.enqueue(c);
        }
        if let Some(c) = self.take_pending(id) {
            self.kv.release(id);
            return Some((c.seq.prompt_tokens(), 0));
        }
        self.scheduler.remove(id);
        self.kv.release(id);
        let seq = self.requests.0.remove(&id)?;
        Some((seq.prompt_tokens(), seq.generated_tokens()))
    }

    /// Remove a choice waiting for its parent.
    fn take_pending(&mut self, id: SeqId) -> Option<Pending> {
        for children in self.pending.values_mut() {
            if let Some(i) = children.iter().position(|c| c.id == id) {
                return Some(children.remove(i));
            }
        }
        None
    }

    /// A choice that could not fork waits as an ordinary request (its
    /// prompt may still hit the prefix cache).
    fn enqueue(&mut self, c: Pending) {
        let tokens = c.seq.history().len();
        let capacity = self.kv.capacity_positions();
        // It fitted as its parent's twin, so it fits alone.
        if self
            .scheduler
            .add(c.id, tokens, c.max_len, capacity)
            .is_ok()
        {
            self.requests.0.insert(c.id, c.seq);
        }
    }

    /// Keep a copy of every sampling row's logits in [`StepOutput::logits`]
    /// (off by default: a row is vocab_size floats).
    pub fn record_logits(&mut self, on: bool) {
        self.record_logits = on;
    }

    pub fn has_work(&self) -> bool {
        !self.scheduler.is_idle()
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// The K/V backend (its own counters: blocks, prefix hits).
    pub fn kv(&self) -> &B {
        &self.kv
    }

    /// Bytes of K/V held by running sequences.
    pub fn kv_bytes(&self) -> usize {
        self.kv.used_bytes()
    }

    /// The K/V budget in bytes.
    pub fn kv_capacity_bytes(&self) -> usize {
        self.kv.capacity_bytes()
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
                let logits = self.recorded(&plan);
                let (outputs, forked) = self.postprocess(&plan);
                StepOutput {
                    plan,
                    outputs,
                    failed: Vec::new(),
                    forked,
                    logits,
                }
            }
            Err(e) => {
                // A fault of the step fails every sequence in it; the
                // others (waiting) are untouched.
                let e = std::sync::Arc::new(e);
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
                    failed,
                    ..StepOutput::default()
                }
            }
        }
    }

    /// Plan the step; the backend grants memory (and frees the preempted)
    /// as the scheduler asks.
    fn schedule(&mut self) -> StepPlan {
        self.scheduler.schedule(&mut self.kv, &self.requests)
    }

    /// One batched, ragged forward over every scheduled chunk: a decode
    /// token, a prompt chunk, or a preempted sequence's recomputation.
    fn run(&mut self, plan: &StepPlan) -> Result<(), StepError> {
        self.batch.clear();
        let mut chunks = Vec::with_capacity(plan.seqs.len());
        for s in &plan.seqs {
            let tokens = self
                .requests
                .0
                .get(&s.id)
                .and_then(|seq| seq.history().get(s.start..s.start + s.len))
                .ok_or(StepError::NoTokens(s.id))?;
            self.batch.push(tokens, s.start)?;
            chunks.push(Chunk {
                id: s.id,
                start: s.start,
                len: s.len,
            });
        }
        let vocab = self.model.info().vocab_size;
        self.logits.resize(plan.seqs.len() * vocab, 0.0);
        let mut stores = self
            .kv
            .stores(&chunks)
            .map_err(|e| StepError::Stores(Box::new(e)))?;
        let mut refs: Vec<&mut B::Store<'_>> = stores.iter_mut().collect();
        self.model
            .forward_batch(
                &self.batch,
                &mut refs,
                &mut self.workspace,
                &mut self.logits,
            )
            .map_err(|e| StepError::Model(Box::new(e)))
    }

    /// The sampling rows' logits, when recorded.
    fn recorded(&self, plan: &StepPlan) -> Vec<(SeqId, Vec<f32>)> {
        if !self.record_logits {
            return Vec::new();
        }
        let vocab = self.model.info().vocab_size;
        plan.seqs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.samples)
            .map(|(row, s)| (s.id, self.logits[row * vocab..(row + 1) * vocab].to_vec()))
            .collect()
    }

    /// Sample where a chunk reached the end of its sequence (and fork the
    /// waiting choices of a parent sampling its first token); retire the
    /// finished.
    fn postprocess(&mut self, plan: &StepPlan) -> (Vec<SeqOutput>, Vec<SeqId>) {
        let vocab = self.model.info().vocab_size;
        let mut outputs = Vec::new();
        let mut forked = Vec::new();
        for (row, s) in plan.seqs.iter().enumerate() {
            let Some(seq) = self.requests.0.get_mut(&s.id) else {
                continue;
            };
            self.kv.commit(s.id, seq.history(), s.start + s.len);
            if !s.samples {
                self.scheduler.on_step(s.id, s.len, false);
                continue;
            }
            let logits = &mut self.logits[row * vocab..(row + 1) * vocab];
            let children = self.pending.remove(&s.id).unwrap_or_default();
            // The choices sample from the logits as the model gave them.
            let shared = (!children.is_empty()).then(|| logits.to_vec());
            let out = sample(seq, s.id, logits, self.tok);
            self.scheduler.on_step(s.id, s.len, out.is_token);
            let parent_done = out.step.finish.is_some();
            outputs.push(out);
            let computed = s.start + s.len;
            for mut c in children {
                let fits = self.scheduler.has_running_room() && self.kv.fork(s.id, c.id);
                if !fits {
                    self.enqueue(c);
                    continue;
                }
                self.scheduler.fork(s.id, c.id, computed);
                let mut row = shared.clone().unwrap_or_default();
                let o = sample(&mut c.seq, c.id, &mut row, self.tok);
                self.scheduler.on_step(c.id, 0, o.is_token);
                self.requests.0.insert(c.id, c.seq);
                forked.push(c.id);
                if o.step.finish.is_some() {
                    self.abort(c.id);
                }
                outputs.push(o);
            }
            if parent_done {
                self.abort(s.id);
            }
        }
        (outputs, forked)
    }
}

/// Sample one token of `seq` from its logits row.
fn sample(seq: &mut Sequence, id: SeqId, logits: &mut [f32], tok: &Tokenizer) -> SeqOutput {
    let before = seq.generated_tokens();
    let step = seq.on_logits(logits, tok);
    SeqOutput {
        id,
        is_token: seq.generated_tokens() > before,
        prompt_tokens: seq.prompt_tokens(),
        completion_tokens: seq.generated_tokens(),
        step,
    }
}
