//! The engine core: requests, their K/V bookkeeping and a model runner,
//! driven one step at a time (nano-vllm's `LLMEngine.step()`, vLLM's
//! `EngineCore`).
//!
//! ```text
//! step():  schedule = scheduler.schedule()    which sequences, how many tokens each
//!          plan = plan(schedule)              tokens, positions, block tables, K/V work
//!          runner.execute(plan)               one batched, ragged forward (Project 07)
//!          postprocess(schedule, logits)      sample, stream, retire
//! ```
//!
//! The core owns no weights and no K/V: a [`ModelRunner`] does (in this
//! process, [`LocalRunner`]; on other ranks or hosts, Projects 13 and 14).
//! Each sequence is one record ([`crate::scheduler::Entry`] with [`SeqData`]) in the
//! scheduler's queues: tokens, sampler, salt, its client's stream and the
//! choices waiting to fork from it. No threads and no channels here: the
//! serving engine ([`crate::engine`]) calls [`EngineCore::step`] in a loop
//! on its model thread, and the tests call it directly to watch each step.

use std::time::Instant;

use common::batch::BatchModel;
use common::ModelInfo;
use p04_transformer::Tokenizer;
use p05_kv_cache::generate::{GenerateParams, Sequence};
use p05_kv_cache::sampling::Sampler;

use crate::contiguous::ContiguousStorage;
use crate::kv_backend::{ContiguousKv, KvBackend};
pub use crate::output::{AddError, SeqOutput, StepError, StepOutput, StepTiming};
use crate::runner::{LocalRunner, ModelRunner, PlannedSeq, RunnerError, StepPlan};
use crate::scheduler::{
    Schedule, Scheduler, SchedulerConfig, SchedulerError, SeqId, SeqTokens, StepCost,
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

/// The engine core's part of a sequence's record.
#[derive(Debug)]
pub struct SeqData<C> {
    /// Tokens, sampler, stop rules, text state.
    pub seq: Sequence,
    /// The prefix-cache key (`cache_salt`).
    pub salt: Vec<u8>,
    pub client: C,
    /// Choices of parallel sampling waiting for this one's first token.
    children: Vec<Child<C>>,
}

/// A choice of parallel sampling waiting for its parent's prompt.
#[derive(Debug)]
struct Child<C> {
    id: SeqId,
    seq: Sequence,
    client: C,
}

impl<C> SeqData<C> {
    pub(crate) fn new(seq: Sequence, salt: Vec<u8>, client: C) -> Self {
        SeqData {
            seq,
            salt,
            client,
            children: Vec::new(),
        }
    }
}

impl<C> SeqTokens for SeqData<C> {
    fn tokens(&self) -> &[u32] {
        self.seq.history()
    }

    fn salt(&self) -> &[u8] {
        &self.salt
    }
}

/// One request as the engine core takes it.
#[derive(Debug)]
pub struct NewRequest<'r, C> {
    pub prompt: &'r [u32],
    pub params: &'r GenerateParams,
    pub salt: &'r [u8],
    /// Tokens this request generated already, elsewhere (a request
    /// migrated from a lost worker: the client has them). Empty for a new
    /// request. The sequence continues after them: prompt and output are
    /// computed as one prefill, as after a preemption, and its sampler
    /// stands where it would after sampling them. One choice only.
    pub output: &'r [u32],
    /// One id and client per choice (`n`): the first computes the prompt;
    /// when it samples its first token, the others fork its K/V (shared
    /// blocks on a paged backend) and sample from the same logits, choice
    /// `i` with seed `seed + i`.
    pub choices: Vec<(SeqId, C)>,
}

pub struct EngineCore<'a, B: KvBackend, R: ModelRunner, C = ()> {
    pub(crate) info: ModelInfo,
    pub(crate) tok: &'a Tokenizer,
    /// The sequences' records, in its waiting and running queues.
    pub(crate) scheduler: Scheduler<SeqData<C>>,
    pub(crate) kv: B,
    pub(crate) runner: R,
    /// (logit rows, vocab), lent to the runner each step.
    logits: Vec<f32>,
    /// Copy each sampling row's logits into the step's output.
    record_logits: bool,
    steps: u64,
    /// The last step's plan (kept: its buffers are reused).
    plan: StepPlan,
    /// Imports whose K/V is allocated and still arriving ([`crate::reserved`]).
    pub(crate) reserved: std::collections::HashMap<SeqId, crate::reserved::Reservation>,
}

/// The core with its model in this process.
pub type LocalCore<'a, M, B = ContiguousKv, C = ()> =
    EngineCore<'a, B, LocalRunner<&'a M, <B as KvBackend>::Storage>, C>;

impl<B: KvBackend, R: ModelRunner, C> std::fmt::Debug for EngineCore<'_, B, R, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineCore")
            .field("running", &self.scheduler.num_running())
            .field("waiting", &self.scheduler.num_waiting())
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

impl<'a, M: BatchModel, C> EngineCore<'a, ContiguousKv, LocalRunner<&'a M, ContiguousStorage>, C> {
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

impl<'a, M: BatchModel, B: KvBackend, C> EngineCore<'a, B, LocalRunner<&'a M, B::Storage>, C> {
    /// A core on any K/V bookkeeping (Project 09 brings paged blocks), with
    /// an in-process runner on a storage of its layout.
    pub fn with_backend(
        model: &'a M,
        tok: &'a Tokenizer,
        config: &ContinuousConfig,
        kv: B,
    ) -> Result<Self, SchedulerError> {
        let runner = LocalRunner::new(model, kv.new_storage());
        EngineCore::with_runner(model.info(), tok, config, kv, runner)
    }
}

impl<'a, B: KvBackend, R: ModelRunner, C> EngineCore<'a, B, R, C> {
    /// A core driving any runner (one that broadcasts to ranks, or ships
    /// plans to a worker).
    pub fn with_runner(
        info: &ModelInfo,
        tok: &'a Tokenizer,
        config: &ContinuousConfig,
        kv: B,
        runner: R,
    ) -> Result<Self, SchedulerError> {
        let scheduler = Scheduler::new(config.scheduler_config())?;
        Ok(EngineCore {
            info: info.clone(),
            tok,
            scheduler,
            kv,
            runner,
            logits: Vec::new(),
            record_logits: false,
            steps: 0,
            plan: StepPlan::default(),
            reserved: Default::default(),
        })
    }

    /// Queue a request whose `choices` share the prompt. Returns the
    /// choices back when the request is finished before it starts
    /// (`max_tokens == 0`): nothing is then held. On an error the clients
    /// come back too, for the caller to tell.
    #[allow(clippy::type_complexity)]
    pub fn submit(
        &mut self,
        req: NewRequest<'_, C>,
    ) -> Result<Option<Vec<(SeqId, C)>>, (AddError, Vec<(SeqId, C)>)> {
        let NewRequest {
            prompt,
            params,
            salt,
            output,
            choices,
        } = req;
        let checked = self.check_new(prompt, output, params, &choices);
        let (seq, children) = match checked {
            Ok(Some(x)) => x,
            Ok(None) => return Ok(Some(choices)),
            Err(e) => return Err((e, choices)),
        };
        let mut choices = choices.into_iter();
        let Some((parent, client)) = choices.next() else {
            return Ok(Some(Vec::new()));
        };
        let children = children
            .into_iter()
            .zip(choices)
            .map(|(seq, (id, client))| Child { id, seq, client })
            .collect();
        let data = SeqData {
            seq,
            salt: salt.to_vec(),
            client,
            children,
        };
        let max_len = prompt.len().saturating_add(params.max_tokens);
        let capacity = self.kv.capacity_positions();
        // Checked by `check_new`: it cannot be refused here.
        let _ = self
            .scheduler
            .add(parent, prompt.len() + output.len(), max_len, capacity, data);
        Ok(None)
    }

    /// The request's sequences, or None when it finishes before it starts.
    #[allow(clippy::type_complexity)]
    fn check_new(
        &self,
        prompt: &[u32],
        output: &[u32],
        params: &GenerateParams,
        choices: &[(SeqId, C)],
    ) -> Result<Option<(Sequence, Vec<Sequence>)>, AddError> {
        let Some(((parent, _), others)) = choices.split_first() else {
            return Ok(None);
        };
        let seq = match output.is_empty() {
            true => Sequence::new::<std::convert::Infallible>(&self.info, prompt, params)?,
            false if !others.is_empty() => return Err(AddError::Continued),
            false => {
                let at = Sampler::state_after(&params.sampling, output.len());
                Sequence::resume::<std::convert::Infallible>(
                    &self.info, prompt, output, params, at, self.tok,
                )?
            }
        };
        if seq.is_finished() {
            return Ok(None);
        }
        let mut children = Vec::with_capacity(others.len());
        for (i, (id, _)) in (1u64..).zip(others) {
            if id == parent
                || self.is_held(*id)
                || others[..i as usize - 1].iter().any(|c| c.0 == *id)
            {
                return Err(SchedulerError::Duplicate(*id).into());
            }
            let mut p = params.clone();
            p.sampling = params.sampling.of_choice(i);
            children.push(Sequence::new::<std::convert::Infallible>(
                &self.info, prompt, &p,
            )?);
        }
        let max_len = prompt.len().saturating_add(params.max_tokens);
        self.scheduler
            .can_add(*parent, prompt.len(), max_len, self.kv.capacity_positions())?;
        Ok(Some((seq, children)))
    }

    /// Whether `id` is running, waiting or waiting for its parent.
    pub fn is_held(&self, id: SeqId) -> bool {
        self.scheduler
            .entries()
            .any(|e| e.id == id || e.data.children.iter().any(|c| c.id == id))
    }

    /// Cancel a request, freeing its K/V. Returns its (prompt, generated)
    /// token counts and its client if it was held. Choices still waiting
    /// for it as their parent queue to compute the prompt themselves.
    pub fn abort(&mut self, id: SeqId) -> Option<(usize, usize, C)> {
        if let Some(c) = self.take_child(id) {
            return Some((c.seq.prompt_tokens(), 0, c.client));
        }
        let entry = self.scheduler.remove(id)?;
        self.kv.free(id);
        let SeqData {
            seq,
            salt,
            client,
            children,
        } = entry.data;
        for c in children {
            self.enqueue(c, &salt, entry.max_len);
        }
        Some((seq.prompt_tokens(), seq.generated_tokens(), client))
    }

    /// Remove a choice waiting for its parent.
    fn take_child(&mut self, id: SeqId) -> Option<Child<C>> {
        for e in self.scheduler.entries_mut() {
            if let Some(i) = e.data.children.iter().position(|c| c.id == id) {
                return Some(e.data.children.remove(i));
            }
        }
        None
    }

    /// A choice that could not fork waits as an ordinary request (its
    /// prompt may still hit the prefix cache).
    fn enqueue(&mut self, c: Child<C>, salt: &[u8], max_len: usize) {
        let tokens = c.seq.history().len();
        let capacity = self.kv.capacity_positions();
        let data = SeqData::new(c.seq, salt.to_vec(), c.client);
        // It fitted as its parent's twin, so it fits alone.
        let _ = self.scheduler.add(c.id, tokens, max_len, capacity, data);
    }

    /// A held sequence's client (a waiting choice's included).
    pub fn client(&self, id: SeqId) -> Option<&C> {
        self.clients().find(|(i, _)| *i == id).map(|(_, c)| c)
    }

    /// Every held sequence's client, waiting choices included.
    pub fn clients(&self) -> impl Iterator<Item = (SeqId, &C)> {
        self.scheduler.entries().flat_map(|e| {
            std::iter::once((e.id, &e.data.client))
                .chain(e.data.children.iter().map(|c| (c.id, &c.client)))
        })
    }

    pub fn client_mut(&mut self, id: SeqId) -> Option<&mut C> {
        for e in self.scheduler.entries_mut() {
            if e.id == id {
                return Some(&mut e.data.client);
            }
            if let Some(c) = e.data.children.iter_mut().find(|c| c.id == id) {
                return Some(&mut c.client);
            }
        }
        None
    }

    /// Keep a copy of every sampling row's logits in [`StepOutput::logits`]
    /// (off by default: a row is vocab_size floats).
    pub fn record_logits(&mut self, on: bool) {
        self.record_logits = on;
    }

    pub fn has_work(&self) -> bool {
        !self.scheduler.is_idle()
    }

    pub fn scheduler(&self) -> &Scheduler<SeqData<C>> {
        &self.scheduler
    }

    /// The K/V bookkeeping (its own counters: blocks, prefix hits).
    pub fn kv(&self) -> &B {
        &self.kv
    }

    pub fn runner(&self) -> &R {
        &self.runner
    }

    /// The last step's plan, as the runner received it.
    pub fn last_plan(&self) -> &StepPlan {
        &self.plan
    }

    /// Bytes of K/V held by running sequences.
    pub fn kv_bytes(&self) -> usize {
        self.kv.used_bytes()
    }

    /// The K/V budget in bytes.
    pub fn kv_capacity_bytes(&self) -> usize {
        self.kv.capacity_bytes()
    }

    /// One iteration: schedule → plan → execute → post-process.
    pub fn step(&mut self) -> StepOutput<C> {
        let t0 = Instant::now();
        let schedule = self.scheduler.schedule(&mut self.kv);
        let t1 = Instant::now();
        let mut out = StepOutput::default();
        if schedule.is_empty() {
            out.schedule = schedule;
            // Frees of finished sequences still reach the storage.
            self.plan.seqs.clear();
            self.plan.ops.clear();
            self.kv.take_ops(&mut self.plan.ops);
            if !self.plan.ops.is_empty() {
                let _ = self.runner.apply(&self.plan.ops);
            }
            return out;
        }
        let planned = self.build_plan(&schedule);
        if planned.is_err() {
            // The recorded storage work still happens (the frees and
            // copies of sequences outside this step).
            let _ = self.runner.apply(&self.plan.ops);
        }
        let t2 = Instant::now();
        let ran = planned.and_then(|()| {
            self.runner
                .execute(&self.plan, &mut self.logits)
                .map_err(StepError::from)
        });
        let t3 = Instant::now();
        match ran {
            Ok(()) => {
                out.logits = self.recorded(&schedule);
                self.postprocess(&schedule, &mut out);
            }
            Err(StepError::Runner(RunnerError::Recovered(_))) => {
                // Nothing ran and the runner's K/V is gone: every running
                // sequence recomputes, as after a preemption; its client
                // sees a pause, not an error.
                self.kv.forget_cached();
                let mut preempted = self.scheduler.preempt_all(&mut self.kv);
                let mut schedule = schedule;
                schedule.preempted.append(&mut preempted);
                out.schedule = schedule;
                return out;
            }
            Err(e) => {
                // A fault of the step fails every sequence in it; the
                // others (waiting) are untouched.
                let e = std::sync::Arc::new(e);
                for s in &schedule.seqs {
                    if let Some((_, _, client)) = self.abort(s.id) {
                        out.failed.push((s.id, e.clone()));
                        out.retired.push((s.id, client));
                    }
                }
            }
        }
        out.schedule = schedule;
        out.timing = StepTiming {
            schedule_s: (t1 - t0).as_secs_f64(),
            plan_s: (t2 - t1).as_secs_f64(),
            execute_s: (t3 - t2).as_secs_f64(),
            postprocess_s: t3.elapsed().as_secs_f64(),
        };
        out
    }

    /// The runner's plan for a schedule: each chunk's tokens and where its
    /// K/V lives, and the storage work the bookkeeping recorded.
    fn build_plan(&mut self, schedule: &Schedule) -> Result<(), StepError> {
        self.steps += 1;
        let plan = &mut self.plan;
        plan.step = self.steps;
        plan.ops.clear();
        self.kv.take_ops(&mut plan.ops);
        plan.seqs.clear();
        for s in &schedule.seqs {
            let tokens = self
                .scheduler
                .find(s.id)
                .and_then(|e| e.data.seq.history().get(s.start..s.start + s.len))
                .ok_or(StepError::NoTokens(s.id))?;
            let kv = self.kv.seq_kv(s.id).ok_or(StepError::NoKv(s.id))?;
            plan.seqs.push(PlannedSeq {
                id: s.id,
                start: s.start,
                tokens: tokens.to_vec(),
                kv,
                logits: s.samples,
            });
        }
        Ok(())
    }

    /// The sampling rows' logits, when recorded.
    fn recorded(&self, schedule: &Schedule) -> Vec<(SeqId, Vec<f32>)> {
        if !self.record_logits {
            return Vec::new();
        }
        let vocab = self.info.vocab_size;
        schedule
            .seqs
            .iter()
            .filter(|s| s.samples)
            .zip(self.logits.chunks_exact(vocab))
            .map(|(s, row)| (s.id, row.to_vec()))
            .collect()
    }

    /// Sample where a chunk reached the end of its sequence (and fork the
    /// waiting choices of a parent sampling its first token); retire the
    /// finished.
    fn postprocess(&mut self, schedule: &Schedule, out: &mut StepOutput<C>) {
        let vocab = self.info.vocab_size;
        let mut row = 0;
        for s in &schedule.seqs {
            let Some(e) = self.scheduler.find_mut(s.id) else {
                continue;
            };
            let computed = s.start + s.len;
            self.kv
                .commit(s.id, e.data.seq.history(), &e.data.salt, computed);
            if !s.samples {
                self.scheduler.on_step(s.id, s.len, false);
                continue;
            }
            let logits = &mut self.logits[row * vocab..(row + 1) * vocab];
            row += 1;
            let children = std::mem::take(&mut e.data.children);
            // The choices sample from the logits as the model gave them.
            let shared = (!children.is_empty()).then(|| logits.to_vec());
            let o = sample(&mut e.data.seq, s.id, logits, self.tok);
            let (salt, max_len) = (e.data.salt.clone(), e.max_len);
            self.scheduler.on_step(s.id, s.len, o.is_token);
            let parent_done = o.step.finish.is_some();
            out.outputs.push(o);
            for mut c in children {
                let fits = self.scheduler.has_running_room() && self.kv.fork(s.id, c.id);
                if !fits {
                    self.enqueue(c, &salt, max_len);
                    continue;
                }
                let mut logits = shared.clone().unwrap_or_default();
                let o = sample(&mut c.seq, c.id, &mut logits, self.tok);
                let data = SeqData::new(c.seq, salt.clone(), c.client);
                if let Err(data) = self.scheduler.fork(s.id, c.id, computed, data) {
                    // Room was checked: not reached; the client is told.
                    self.kv.free(c.id);
                    out.retired.push((c.id, data.client));
                    continue;
                }
                self.scheduler.on_step(c.id, 0, o.is_token);
                out.forked.push(c.id);
                if o.step.finish.is_some() {
                    self.retire(c.id, out);
                }
                out.outputs.push(o);
            }
            if parent_done {
                self.retire(s.id, out);
            }
        }
    }

    /// A finished sequence leaves; its client goes out with the step.
    fn retire(&mut self, id: SeqId, out: &mut StepOutput<C>) {
        if let Some((_, _, client)) = self.abort(id) {
            out.retired.push((id, client));
        }
    }

    /// The model's facts (vocabulary, context, stop ids).
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }
}

impl<B: KvBackend, R: ModelRunner> EngineCore<'_, B, R, ()> {
    /// Queue a request. Returns false when it is finished before it starts
    /// (`max_tokens == 0`); it is then not held.
    pub fn add(
        &mut self,
        id: SeqId,
        prompt: &[u32],
        params: &GenerateParams,
    ) -> Result<bool, AddError> {
        self.add_choices(&[id], prompt, params, b"")
    }

    /// Queue `ids.len()` choices of one prompt (parallel sampling, `n`);
    /// see [`NewRequest::choices`]. `salt` keys the prefix cache. False
    /// when all are finished before they start.
    pub fn add_choices(
        &mut self,
        ids: &[SeqId],
        prompt: &[u32],
        params: &GenerateParams,
        salt: &[u8],
    ) -> Result<bool, AddError> {
        let req = NewRequest {
            prompt,
            params,
            salt,
            output: &[],
            choices: ids.iter().map(|&id| (id, ())).collect(),
        };
        match self.submit(req) {
            Ok(None) => Ok(true),
            Ok(Some(_)) => Ok(false),
            Err((e, _)) => Err(e),
        }
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
