//! The iteration-level scheduler (Orca; vLLM's scheduler; nano-vllm's
//! `scheduler.py`). It knows no model and no tensors: only, per sequence, how
//! many tokens it has (`num_tokens`: prompt plus sampled), how many of them
//! the model has seen (`computed`, the K/V it holds) and how much K/V memory
//! it has been given. Each call to [`Scheduler::schedule`] plans one step:
//!
//! 1. **decodes first**: every running sequence with exactly one unseen
//!    token brings it (1 token each), so streams that are generating keep
//!    receiving a token every step, whatever else arrives;
//! 2. **prefill chunks** of running sequences still reading their prompt
//!    (oldest first), each cut to what is left of the step's token budget
//!    (`max_num_batched_tokens`: Sarathi-Serve's chunked prefill). While
//!    streams are decoding, prefill tokens are further capped by a step-time
//!    model ([`StepCost`]) so that the step takes at most `itl_factor` times
//!    a decode-only step: the running streams' inter-token latency stays
//!    bounded while a long prompt is read;
//! 3. **admission**: waiting sequences in arrival order, while the sequence
//!    cap (`max_num_seqs`), the token budget and K/V memory allow. A request
//!    at the head that does not fit in memory may be passed over by smaller
//!    ones behind it, but at most `max_passed_over` times; after that nobody
//!    goes ahead of it (it waits only for running sequences to free memory).
//!
//! Memory is asked of a [`KvAllocator`] (Project 08: contiguous caches in a
//! byte budget, growing by doubling; Project 09: paged blocks with a prefix
//! cache, whose hits make an admitted sequence start with tokens already
//! computed). When a sequence cannot grow, the running sequence that has
//! computed the fewest tokens (the least work lost) is **preempted**: its
//! K/V is freed and it returns to the waiting queue, to be recomputed from
//! its prompt and the tokens it already sampled, so its output does not
//! change. No sequence is admitted in a step that preempted one.

use std::collections::VecDeque;

use thiserror::Error;

use crate::kv_backend::KvAllocator;

/// A sequence's id, chosen by the caller.
pub type SeqId = u64;

/// What the scheduler reads of a sequence's own record: its known tokens
/// and its prefix-cache salt (an allocator with a prefix cache hashes them
/// at admission).
pub trait SeqTokens {
    /// At least the sequence's `num_tokens` known tokens.
    fn tokens(&self) -> &[u32];

    fn salt(&self) -> &[u8] {
        &[]
    }
}

/// A step's time in units of one prompt token's cost (at position 0):
/// fixed (reading the weights, starting the work) plus each decode token
/// (its attention over its history makes it dearer than a prompt token),
/// plus each prompt token, which costs more the later its position (its
/// attention reads every earlier key). Measured by `p08_continuous
/// bench-budget`: t(d, chunk) = k·(fixed_tokens + decode_tokens·d + Σ_p (1 + p / attn_positions)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepCost {
    /// The allowed slow-down of a decode-only step by prefill work (> 1).
    pub itl_factor: f64,
    pub fixed_tokens: f64,
    pub decode_tokens: f64,
    /// The position at which a prompt token's attention costs as much as
    /// the rest of its work.
    pub attn_positions: f64,
}

impl StepCost {
    /// Prefill work (in prompt-token units) a step with `decodes` decode
    /// tokens may carry: (itl_factor − 1) × (fixed + decode × d).
    pub fn prefill_units(&self, decodes: usize) -> f64 {
        (self.itl_factor - 1.0) * (self.fixed_tokens + self.decode_tokens * decodes as f64)
    }

    /// Units of a chunk of `n` prompt tokens at positions `start..start + n`.
    pub fn chunk_units(&self, start: usize, n: usize) -> f64 {
        let (s, n) = (start as f64, n as f64);
        n + (n * s + n * (n - 1.0) / 2.0) / self.attn_positions
    }

    /// The longest chunk from `start` that fits in `units` (may be 0).
    pub fn chunk_tokens(&self, start: usize, units: f64) -> usize {
        // n²/(2A) + n (1 + (start − ½)/A) − units = 0, positive root.
        let a = 0.5 / self.attn_positions;
        let b = 1.0 + (start as f64 - 0.5) / self.attn_positions;
        let units = units.max(0.0);
        let n = if a > 0.0 {
            (-b + (b * b + 4.0 * a * units).sqrt()) / (2.0 * a)
        } else {
            units / b
        };
        if n.is_finite() && n > 0.0 {
            n.floor() as usize
        } else {
            0
        }
    }
}

/// What is left of a step's prefill allowance.
#[derive(Clone, Copy, Debug)]
struct PrefillCap {
    cost: Option<StepCost>,
    units: f64,
    /// Some prefill was taken this step.
    taken: bool,
}

impl PrefillCap {
    fn new(cost: Option<StepCost>, units: f64) -> PrefillCap {
        PrefillCap {
            cost,
            units,
            taken: false,
        }
    }

    /// How many of `want` tokens from `start` fit (charged when taken).
    /// The first chunk of a step gets at least one token, so prefill
    /// always moves.
    fn fit(&self, start: usize, want: usize) -> usize {
        match self.cost {
            Some(c) => {
                let n = c.chunk_tokens(start, self.units);
                want.min(if self.taken { n } else { n.max(1) })
            }
            None => want,
        }
    }

    fn take(&mut self, start: usize, n: usize) {
        self.taken = true;
        if let Some(c) = self.cost {
            self.units -= c.chunk_units(start, n);
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Token budget of one step: decode tokens plus prefill chunks.
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// How many steps a waiting request that does not fit may see later
    /// arrivals admitted ahead of it.
    pub max_passed_over: usize,
    /// Cap on prefill tokens while streams decode (None: the budget only).
    pub step_cost: Option<StepCost>,
}

#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum SchedulerError {
    #[error("max_num_seqs must be at least 1")]
    NoSeqs,
    #[error("max_num_batched_tokens ({tokens}) must be at least max_num_seqs ({seqs}), so every running sequence can decode in every step")]
    BudgetBelowSeqs { tokens: usize, seqs: usize },
    #[error("sequence {id} needs up to {needs} K/V positions; the cache holds {capacity}")]
    TooLong {
        id: SeqId,
        needs: usize,
        capacity: usize,
    },
    #[error("sequence {0} is already scheduled")]
    Duplicate(SeqId),
    #[error("sequence {0} has no tokens")]
    Empty(SeqId),
}

impl SchedulerConfig {
    pub fn check(&self) -> Result<(), SchedulerError> {
        if self.max_num_seqs == 0 {
            return Err(SchedulerError::NoSeqs);
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return Err(SchedulerError::BudgetBelowSeqs {
                tokens: self.max_num_batched_tokens,
                seqs: self.max_num_seqs,
            });
        }
        Ok(())
    }
}

/// One sequence's record: what the scheduler tracks, and the rest of the
/// sequence (`data`: for the engine core its tokens, sampler, salt, output
/// stream and waiting choices). The scheduler's queues hold the records
/// themselves (nano-vllm's `Sequence` in its `waiting` and `running`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry<T> {
    pub id: SeqId,
    /// Arrival order (FCFS; preempted sequences keep theirs).
    arrival: u64,
    /// Prompt plus sampled tokens.
    pub num_tokens: usize,
    /// Tokens whose K/V the model holds (0 while waiting).
    pub computed: usize,
    /// The most positions it can ever need: prompt + max_tokens.
    pub max_len: usize,
    /// Steps in which a later arrival was admitted while it could not be.
    pub passed_over: usize,
    pub preemptions: usize,
    pub data: T,
}

/// One sequence's part of a step: tokens `start..start + len` of its
/// history (the K/V memory has made those positions writable).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduled {
    pub id: SeqId,
    pub start: usize,
    pub len: usize,
    /// A running stream's one decode token (not a prompt chunk).
    pub decode: bool,
    /// The chunk ends at the last known token: sample from its logits.
    pub samples: bool,
}

/// What the scheduler decided for one step (the engine core turns it into
/// the runner's [`crate::runner::StepPlan`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    /// In batch order: decodes, then prefill chunks, then admitted prompts.
    pub seqs: Vec<Scheduled>,
    /// Admitted this step (they were waiting).
    pub admitted: Vec<SeqId>,
    /// Preempted this step: free their K/V; they are waiting again.
    pub preempted: Vec<SeqId>,
}

impl Schedule {
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
}

#[derive(Debug)]
pub struct Scheduler<T> {
    config: SchedulerConfig,
    /// Sorted by arrival.
    waiting: VecDeque<Entry<T>>,
    /// In admission order.
    running: Vec<Entry<T>>,
    next_arrival: u64,
    preemptions: u64,
}

impl<T> Scheduler<T> {
    /// Refuse inconsistent knobs (what `new` checks, without a scheduler).
    pub fn check(config: &SchedulerConfig) -> Result<(), SchedulerError> {
        config.check()
    }
}

impl<T: SeqTokens> Scheduler<T> {
    pub fn new(config: SchedulerConfig) -> Result<Scheduler<T>, SchedulerError> {
        config.check()?;
        Ok(Scheduler {
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_arrival: 0,
            preemptions: 0,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Whether [`Scheduler::add`] would take this sequence.
    pub fn can_add(
        &self,
        id: SeqId,
        num_tokens: usize,
        max_len: usize,
        capacity: usize,
    ) -> Result<(), SchedulerError> {
        let max_len = max_len.max(num_tokens);
        if num_tokens == 0 {
            return Err(SchedulerError::Empty(id));
        }
        if max_len > capacity {
            return Err(SchedulerError::TooLong {
                id,
                needs: max_len,
                capacity,
            });
        }
        if self.find(id).is_some() {
            return Err(SchedulerError::Duplicate(id));
        }
        Ok(())
    }

    /// Queue a sequence of `num_tokens` prompt tokens that may grow to
    /// `max_len` positions. Refused when even alone it could not fit in
    /// `capacity` positions of K/V memory.
    pub fn add(
        &mut self,
        id: SeqId,
        num_tokens: usize,
        max_len: usize,
        capacity: usize,
        data: T,
    ) -> Result<(), SchedulerError> {
        self.can_add(id, num_tokens, max_len, capacity)?;
        let e = self.entry(id, num_tokens, 0, max_len, data);
        self.waiting.push_back(e);
        Ok(())
    }

    /// A new record, next in arrival order.
    fn entry(
        &mut self,
        id: SeqId,
        num_tokens: usize,
        computed: usize,
        max_len: usize,
        data: T,
    ) -> Entry<T> {
        self.next_arrival += 1;
        Entry {
            id,
            arrival: self.next_arrival - 1,
            num_tokens,
            computed,
            max_len: max_len.max(num_tokens),
            passed_over: 0,
            preemptions: 0,
            data,
        }
    }

    /// Run a sequence whose first `computed` tokens already have their K/V
    /// (imported from another engine; the caller has allocated it), from
    /// its next step on. False (nothing changed) when the running set is
    /// full or `id` is known; `data` comes back.
    pub fn add_running(
        &mut self,
        id: SeqId,
        num_tokens: usize,
        computed: usize,
        max_len: usize,
        data: T,
    ) -> Result<(), T> {
        if !self.has_running_room() || self.find(id).is_some() || computed >= num_tokens {
            return Err(data);
        }
        let e = self.entry(id, num_tokens, computed, max_len, data);
        self.running.push(e);
        Ok(())
    }

    /// Whether one more sequence may run now (parallel sampling's children
    /// join the running set only within `max_num_seqs`).
    pub fn has_running_room(&self) -> bool {
        self.running.len() < self.config.max_num_seqs
    }

    /// Run `child` beside running `parent` from the same `computed` tokens,
    /// whose K/V the caller has forked (a child of parallel sampling skips
    /// the prompt). False (nothing changed) when `parent` is not running,
    /// `child` is known or the running set is full.
    pub fn fork(&mut self, parent: SeqId, child: SeqId, computed: usize, data: T) -> Result<(), T> {
        if !self.has_running_room() || self.find(child).is_some() {
            return Err(data);
        }
        let Some(p) = self.running.iter().find(|e| e.id == parent) else {
            return Err(data);
        };
        let entry = Entry {
            id: child,
            arrival: p.arrival,
            num_tokens: computed,
            computed,
            max_len: p.max_len,
            passed_over: 0,
            preemptions: 0,
            data,
        };
        self.running.push(entry);
        Ok(())
    }

    /// Forget a sequence (finished or cancelled); the caller frees its memory.
    pub fn remove(&mut self, id: SeqId) -> Option<Entry<T>> {
        if let Some(i) = self.running.iter().position(|e| e.id == id) {
            return Some(self.running.remove(i));
        }
        let i = self.waiting.iter().position(|e| e.id == id)?;
        self.waiting.remove(i)
    }

    /// After the step ran: `id` computed the `len` tokens it was given, and
    /// `sampled` says whether a new token joined its history.
    pub fn on_step(&mut self, id: SeqId, len: usize, sampled: bool) {
        if let Some(e) = self.running.iter_mut().find(|e| e.id == id) {
            e.computed += len;
            if sampled {
                e.num_tokens += 1;
            }
        }
    }

    pub fn find(&self, id: SeqId) -> Option<&Entry<T>> {
        self.running
            .iter()
            .chain(self.waiting.iter())
            .find(|e| e.id == id)
    }

    pub fn find_mut(&mut self, id: SeqId) -> Option<&mut Entry<T>> {
        self.running
            .iter_mut()
            .chain(self.waiting.iter_mut())
            .find(|e| e.id == id)
    }

    /// Every record, running then waiting.
    pub fn entries(&self) -> impl Iterator<Item = &Entry<T>> {
        self.running.iter().chain(self.waiting.iter())
    }

    pub fn entries_mut(&mut self) -> impl Iterator<Item = &mut Entry<T>> {
        self.running.iter_mut().chain(self.waiting.iter_mut())
    }

    /// Whether `id` is running.
    pub fn is_running(&self, id: SeqId) -> bool {
        self.running.iter().any(|e| e.id == id)
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Plan the next step (see the module comment for the policy), asking
    /// `kv` for memory.
    pub fn schedule<A>(&mut self, kv: &mut A) -> Schedule
    where
        A: KvAllocator + ?Sized,
    {
        let mut plan = Schedule::default();
        let mut budget = self.config.max_num_batched_tokens;
        let mut cap = PrefillCap::new(None, f64::INFINITY);
        // 1. and 2.: running sequences, decodes before prefill chunks. Once
        // the decodes are in, prefill work is capped by the step-time model.
        for decodes in [true, false] {
            if !decodes {
                if let (Some(cost), d) = (self.config.step_cost, plan.seqs.len()) {
                    if d > 0 {
                        cap = PrefillCap::new(Some(cost), cost.prefill_units(d));
                    }
                }
            }
            let ids: Vec<SeqId> = self
                .running
                .iter()
                .filter(|e| (e.num_tokens - e.computed == 1) == decodes)
                .map(|e| e.id)
                .collect();
            for id in ids {
                let Some(e) = self.running.iter().find(|e| e.id == id) else {
                    continue; // preempted earlier in this step
                };
                let (start, total, max_len) = (e.computed, e.num_tokens, e.max_len);
                let want = (total - start).min(budget);
                let n = if decodes { want } else { cap.fit(start, want) };
                if n == 0 {
                    continue;
                }
                if self.make_room(kv, id, start, start + n, max_len, &mut plan, &mut budget) {
                    if !decodes {
                        cap.take(start, n);
                    }
                    plan.seqs.push(Scheduled {
                        id,
                        start,
                        len: n,
                        decode: decodes,
                        samples: start + n == total,
                    });
                    budget -= n;
                }
            }
        }
        // 3. admission, unless memory ran short this step.
        if plan.preempted.is_empty() {
            self.admit(kv, &mut plan, &mut budget, &mut cap);
        }
        plan
    }

    /// Make positions `start..end` of running sequence `id` writable,
    /// preempting others while memory is short. False when `id` was itself
    /// the cheapest to preempt.
    #[allow(clippy::too_many_arguments)]
    fn make_room<A: KvAllocator + ?Sized>(
        &mut self,
        kv: &mut A,
        id: SeqId,
        start: usize,
        end: usize,
        max_len: usize,
        plan: &mut Schedule,
        budget: &mut usize,
    ) -> bool {
        loop {
            if kv.grow(id, start, end, max_len) {
                return true;
            }
            // Memory is short: preempt the sequence that loses the least
            // work (fewest computed tokens; the latest admitted on a tie).
            let Some(victim) = self
                .running
                .iter()
                .enumerate()
                .min_by_key(|(i, e)| (e.computed, std::cmp::Reverse(*i)))
                .map(|(_, e)| e.id)
            else {
                return false;
            };
            self.preempt(kv, victim, plan, budget);
            if victim == id {
                return false;
            }
        }
    }

    /// Preempt every running sequence (their K/V is lost: a runner that
    /// recovered from a lost rank): each goes back to the waiting queue in
    /// arrival order, to recompute its tokens so far. Returns their ids.
    pub fn preempt_all<A: KvAllocator + ?Sized>(&mut self, kv: &mut A) -> Vec<SeqId> {
        let mut plan = Schedule::default();
        let mut budget = 0;
        let ids: Vec<SeqId> = self.running.iter().map(|e| e.id).collect();
        for &id in &ids {
            self.preempt(kv, id, &mut plan, &mut budget);
        }
        ids
    }

    fn preempt<A: KvAllocator + ?Sized>(
        &mut self,
        kv: &mut A,
        id: SeqId,
        plan: &mut Schedule,
        budget: &mut usize,
    ) {
        let Some(i) = self.running.iter().position(|e| e.id == id) else {
            return;
        };
        let mut e = self.running.remove(i);
        kv.free(id);
        if let Some(k) = plan.seqs.iter().position(|s| s.id == id) {
            *budget += plan.seqs.remove(k).len;
        }
        e.computed = 0;
        e.preemptions += 1;
        self.preemptions += 1;
        plan.preempted.push(id);
        let at = self.waiting.partition_point(|w| w.arrival < e.arrival);
        self.waiting.insert(at, e);
    }

    /// Admit waiting sequences in arrival order (step 3).
    fn admit<A>(
        &mut self,
        kv: &mut A,
        plan: &mut Schedule,
        budget: &mut usize,
        cap: &mut PrefillCap,
    ) where
        A: KvAllocator + ?Sized,
    {
        // Waiting sequences that did not fit, and whether a later one got in.
        let mut skipped: Vec<(SeqId, bool)> = Vec::new();
        let mut k = 0;
        while k < self.waiting.len() {
            if self.running.len() >= self.config.max_num_seqs || *budget == 0 {
                break;
            }
            let e = &self.waiting[k];
            let (id, num_tokens, max_len) = (e.id, e.num_tokens, e.max_len);
            if cap.fit(0, 1) == 0 {
                break; // the prefill allowance is spent: for everyone
            }
            let Some(known) = e.data.tokens().get(..num_tokens) else {
                k += 1; // its tokens are not there (a caller's bug): leave it
                continue;
            };
            // Memory for the known tokens (a prefix cache may hold some;
            // the last token is always computed, for its logits).
            let cached = match kv.admit(id, known, e.data.salt(), max_len) {
                Some(c) => c.min(num_tokens - 1),
                None => {
                    if e.passed_over >= self.config.max_passed_over {
                        break; // its bound is reached: nobody goes ahead of it
                    }
                    skipped.push((id, false));
                    k += 1;
                    continue;
                }
            };
            let n = cap.fit(cached, (num_tokens - cached).min(*budget));
            if n == 0 {
                kv.free(id);
                break; // the prefill allowance is spent: for everyone
            }
            let Some(mut e) = self.waiting.remove(k) else {
                break;
            };
            cap.take(cached, n);
            e.computed = cached;
            plan.seqs.push(Scheduled {
                id,
                start: cached,
                len: n,
                decode: false,
                samples: cached + n == num_tokens,
            });
            plan.admitted.push(id);
            *budget -= n;
            self.running.push(e);
            for s in &mut skipped {
                s.1 = true;
            }
        }
        for (id, passed) in skipped {
            if passed {
                if let Some(e) = self.waiting.iter_mut().find(|e| e.id == id) {
                    e.passed_over += 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
