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
//! Memory is a byte budget of contiguous K/V caches: a sequence is admitted
//! with room for its known tokens (+1), and its cache grows by doubling
//! (copying, as a contiguous buffer must; Project 09's pages avoid both).
//! When a growth does not fit, the running sequence that has computed the
//! fewest tokens (the least work lost) is **preempted**: its K/V is freed and
//! it returns to the waiting queue, to be recomputed from its prompt and the
//! tokens it already sampled, so its output does not change. No sequence is
//! admitted in a step that preempted one.

use std::collections::VecDeque;

use thiserror::Error;

/// A sequence's id, chosen by the caller.
pub type SeqId = u64;

/// Caches grow in multiples of this many positions.
pub const GRAIN: usize = 16;

/// A step's time in units of one prefill token's cost: fixed (reading the
/// weights, launching the work) plus each decode token (its attention over
/// its whole history makes it dearer than a prompt token). Measured by
/// `p08_continuous bench-budget`: t(d, c) = k·(fixed_tokens + decode_tokens·d + c).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepCost {
    /// The allowed slow-down of a decode-only step by prefill work (> 1).
    pub itl_factor: f64,
    pub fixed_tokens: f64,
    pub decode_tokens: f64,
}

impl StepCost {
    /// Prefill tokens a step with `decodes` decode tokens may carry:
    /// (itl_factor − 1) × (fixed + decode × d), at least one.
    pub fn prefill_allowance(&self, decodes: usize) -> usize {
        let t = (self.itl_factor - 1.0) * (self.fixed_tokens + self.decode_tokens * decodes as f64);
        if t.is_finite() {
            (t.floor() as usize).max(1)
        } else {
            usize::MAX
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Token budget of one step: decode tokens plus prefill chunks.
    pub max_num_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// K/V memory for every running sequence, in positions (bytes divided
    /// by the bytes one position takes).
    pub kv_positions: usize,
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

/// What the scheduler tracks of one sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub id: SeqId,
    /// Arrival order (FCFS; preempted sequences keep theirs).
    arrival: u64,
    /// Prompt plus sampled tokens.
    pub num_tokens: usize,
    /// Tokens whose K/V the model holds (0 while waiting).
    pub computed: usize,
    /// The most positions it can ever need: prompt + max_tokens.
    pub max_len: usize,
    /// K/V positions allocated to it (0 while waiting).
    pub allocated: usize,
    /// Steps in which a later arrival was admitted while it could not be.
    pub passed_over: usize,
    pub preemptions: usize,
}

/// One sequence's part of a step: tokens `start..start + len` of its
/// history, with K/V room for `allocated` positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduled {
    pub id: SeqId,
    pub start: usize,
    pub len: usize,
    pub allocated: usize,
    /// The chunk ends at the last known token: sample from its logits.
    pub samples: bool,
}

/// The plan of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// In batch order: decodes, then prefill chunks, then admitted prompts.
    pub seqs: Vec<Scheduled>,
    /// Admitted this step (they were waiting).
    pub admitted: Vec<SeqId>,
    /// Preempted this step: free their K/V; they are waiting again.
    pub preempted: Vec<SeqId>,
}

impl StepPlan {
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
}

#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    /// Sorted by arrival.
    waiting: VecDeque<Entry>,
    /// In admission order.
    running: Vec<Entry>,
    next_arrival: u64,
    preemptions: u64,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Result<Scheduler, SchedulerError> {
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

    /// Queue a sequence of `num_tokens` prompt tokens that may grow to
    /// `max_len`. Refused when even alone it could not fit in memory.
    pub fn add(
        &mut self,
        id: SeqId,
        num_tokens: usize,
        max_len: usize,
    ) -> Result<(), SchedulerError> {
        let max_len = max_len.max(num_tokens);
        if max_len > self.config.kv_positions {
            return Err(SchedulerError::TooLong {
                id,
                needs: max_len,
                capacity: self.config.kv_positions,
            });
        }
        if self.find(id).is_some() {
            return Err(SchedulerError::Duplicate(id));
        }
        self.waiting.push_back(Entry {
            id,
            arrival: self.next_arrival,
            num_tokens,
            computed: 0,
            max_len,
            allocated: 0,
            passed_over: 0,
            preemptions: 0,
        });
        self.next_arrival += 1;
        Ok(())
    }

    /// Forget a sequence (finished or cancelled), freeing its memory.
    pub fn remove(&mut self, id: SeqId) -> Option<Entry> {
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

    pub fn find(&self, id: SeqId) -> Option<&Entry> {
        self.running
            .iter()
            .chain(self.waiting.iter())
            .find(|e| e.id == id)
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

    /// K/V positions allocated to running sequences.
    pub fn used_positions(&self) -> usize {
        self.running.iter().map(|e| e.allocated).sum()
    }

    fn free_positions(&self) -> usize {
        self.config
            .kv_positions
            .saturating_sub(self.used_positions())
    }

    /// Plan the next step (see the module comment for the policy).
    pub fn schedule(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.config.max_num_batched_tokens;
        // 1. and 2.: running sequences, decodes before prefill chunks. Once
        // the decodes are in, prefill work is capped by the step-time model.
        let mut prefill_left = usize::MAX;
        for decodes in [true, false] {
            if !decodes {
                prefill_left = match (&self.config.step_cost, plan.seqs.len()) {
                    (Some(cost), d) if d > 0 => cost.prefill_allowance(d),
                    _ => usize::MAX,
                };
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
                let n = (e.num_tokens - e.computed).min(budget).min(prefill_left);
                if n == 0 {
                    continue;
                }
                let (start, total) = (e.computed, e.num_tokens);
                if let Some(allocated) = self.make_room(id, start + n, &mut plan, &mut budget) {
                    if !decodes {
                        prefill_left -= n;
                    }
                    let samples = start + n == total;
                    plan.seqs.push(Scheduled {
                        id,
                        start,
                        len: n,
                        allocated,
                        samples,
                    });
                    budget -= n;
                }
            }
        }
        // 3. admission, unless memory ran short this step.
        if plan.preempted.is_empty() {
            let mut left = budget.min(prefill_left);
            self.admit(&mut plan, &mut left);
        }
        plan
    }

    /// Give running sequence `id` room for `needed` positions, growing its
    /// cache (doubling, else exactly) or preempting others. Returns its new
    /// allocation, or None when it was itself the cheapest to preempt.
    fn make_room(
        &mut self,
        id: SeqId,
        needed: usize,
        plan: &mut StepPlan,
        budget: &mut usize,
    ) -> Option<usize> {
        loop {
            let free = self.free_positions();
            let e = self.running.iter_mut().find(|e| e.id == id)?;
            if needed <= e.allocated {
                return Some(e.allocated);
            }
            let exact = round_up(needed).min(e.max_len).max(needed);
            let doubled = (2 * e.allocated).min(e.max_len).max(exact);
            for target in [doubled, exact] {
                if target - e.allocated <= free {
                    e.allocated = target;
                    return Some(target);
                }
            }
            // Memory is short: preempt the sequence that loses the least
            // work (fewest computed tokens; the latest admitted on a tie).
            let victim = self
                .running
                .iter()
                .enumerate()
                .min_by_key(|(i, e)| (e.computed, std::cmp::Reverse(*i)))
                .map(|(_, e)| e.id)?;
            self.preempt(victim, plan, budget);
            if victim == id {
                return None;
            }
        }
    }

    fn preempt(&mut self, id: SeqId, plan: &mut StepPlan, budget: &mut usize) {
        let Some(i) = self.running.iter().position(|e| e.id == id) else {
            return;
        };
        let mut e = self.running.remove(i);
        if let Some(k) = plan.seqs.iter().position(|s| s.id == id) {
            *budget += plan.seqs.remove(k).len;
        }
        e.computed = 0;
        e.allocated = 0;
        e.preemptions += 1;
        self.preemptions += 1;
        plan.preempted.push(id);
        let at = self.waiting.partition_point(|w| w.arrival < e.arrival);
        self.waiting.insert(at, e);
    }

    /// Admit waiting sequences in arrival order (step 3).
    fn admit(&mut self, plan: &mut StepPlan, budget: &mut usize) {
        // Waiting sequences that did not fit, and whether a later one got in.
        let mut skipped: Vec<(SeqId, bool)> = Vec::new();
        let mut k = 0;
        while k < self.waiting.len() {
            if self.running.len() >= self.config.max_num_seqs || *budget == 0 {
                break;
            }
            let e = &self.waiting[k];
            // Room for the known tokens and the first decode.
            let need = round_up(e.num_tokens + 1).min(e.max_len).max(e.num_tokens);
            if need > self.free_positions() {
                if e.passed_over >= self.config.max_passed_over {
                    break; // its bound is reached: nobody goes ahead of it
                }
                skipped.push((e.id, false));
                k += 1;
                continue;
            }
            let Some(mut e) = self.waiting.remove(k) else {
                break;
            };
            let n = e.num_tokens.min(*budget);
            e.allocated = need;
            plan.seqs.push(Scheduled {
                id: e.id,
                start: 0,
                len: n,
                allocated: need,
                samples: n == e.num_tokens,
            });
            plan.admitted.push(e.id);
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

fn round_up(n: usize) -> usize {
    n.div_ceil(GRAIN) * GRAIN
}

#[cfg(test)]
mod tests;
