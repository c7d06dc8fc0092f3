//! A dynamic (request-level) batcher. One OS thread owns the model; the
//! HTTP side tokenizes and queues (bounded: a full queue is a 429).
//!
//! The model thread, in a loop:
//! 1. **collect**: wait for a request; take whatever else is queued, up to
//!    `max_batch`. If the first request queued while a batch was running
//!    (the engine is busy, so load is present), wait up to `max_wait` more
//!    to fill the batch; a request that finds the engine idle goes at once.
//! 2. **prefill** every member's prompt in one batched, ragged step.
//! 3. **decode in lock-step**: one step runs one token of every member
//!    still running, until the last one finishes. A finished member leaves
//!    its slot empty (the waste Project 08 removes); a cancelled one frees
//!    its K/V at the next step without disturbing the others.
//!
//! Each step reads schedule → run → post-process: build the [`Batch`] from
//! the live members, run [`BatchModel::forward_batch`], then
//! [`Sequence::on_logits`] for each member's row.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self as std_mpsc, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::batch::{Batch, BatchModel, KvStore};
use common::engine::{
    Engine, EngineError, EngineEvent, EngineLoad, EngineRequest, EngineStream, Finish,
};
use p04_transformer::Tokenizer;
use p05_kv_cache::generate::{GenerateParams, Sequence, Step};
use p05_kv_cache::kv_cache::KvCache;
use p06_server::front::{EngineFront, QueueLimits};
use p06_server::gauges::EngineGauges;
use p06_server::input::{InputProcessor, Prepared};
use p06_server::serial::{engine_error, token_out};
use p06_server::StartError;
use tokio::sync::mpsc;

use crate::stats::BatchStats;

/// The batcher's knobs.
#[derive(Clone, Copy, Debug)]
pub struct BatchConfig {
    /// Most requests in one batch (≥ 1).
    pub max_batch: usize,
    /// How long a busy batcher may wait to fill a batch.
    pub max_wait: Duration,
    /// Requests that may wait for a batch; more get 429.
    pub max_waiting: usize,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            max_batch: 16,
            max_wait: Duration::from_millis(5),
            max_waiting: 256,
        }
    }
}

/// A queued request.
#[derive(Debug)]
struct Job {
    prompt: Vec<u32>,
    params: GenerateParams,
    events: mpsc::UnboundedSender<EngineEvent>,
    arrival: Instant,
    /// Whether a batch was running when it arrived (then the batcher may
    /// wait `max_wait` to fill the next one).
    behind_batch: bool,
}

/// Counters shared by the HTTP side and the model thread.
#[derive(Debug, Default)]
struct Shared {
    /// Waiting, running, K/V bytes, closing; service time per batch.
    gauges: Arc<EngineGauges>,
    /// A batch is running (cleared before its last member's final event, so
    /// a client that answers it at once finds the engine idle).
    busy: AtomicBool,
    stats: Mutex<BatchStats>,
}

#[derive(Debug)]
pub struct BatchingEngine {
    front: EngineFront<Job>,
    shared: Arc<Shared>,
}

impl BatchingEngine {
    /// Start the model thread.
    pub fn start<M>(
        model: Arc<M>,
        tokenizer: Arc<Tokenizer>,
        name: &str,
        config: BatchConfig,
    ) -> Result<BatchingEngine, StartError>
    where
        M: BatchModel + 'static,
    {
        let config = BatchConfig {
            max_batch: config.max_batch.max(1),
            max_waiting: config.max_waiting.max(1),
            ..config
        };
        let input = InputProcessor::new(tokenizer.clone(), model.info())?;
        let shared = Arc::new(Shared::default());
        let limits = QueueLimits {
            max_waiting: config.max_waiting,
            per_unit: config.max_batch,
        };
        let thread_shared = shared.clone();
        let front = EngineFront::start(name, input, limits, shared.gauges.clone(), move |rx| {
            model_thread(&*model, &tokenizer, &rx, &thread_shared, config)
        })?;
        Ok(BatchingEngine { front, shared })
    }

    /// The batcher's statistics so far.
    pub fn stats(&self) -> BatchStats {
        self.shared
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Engine for BatchingEngine {
    fn model_name(&self) -> &str {
        self.front.model_name()
    }

    fn context_length(&self) -> Option<usize> {
        self.front.context_length()
    }

    fn load(&self) -> EngineLoad {
        self.front.load()
    }

    fn submit(&self, request: EngineRequest) -> Result<EngineStream, EngineError> {
        let behind_batch = self.shared.busy.load(Ordering::SeqCst);
        self.front
            .submit_one(request, |Prepared { prompt, params }, mut events| Job {
                prompt,
                params,
                events: events.remove(0),
                arrival: Instant::now(),
                behind_batch,
            })
    }

    fn abort_all(&self) {
        self.front.abort_all();
    }

    fn extra_metrics(&self, out: &mut String) {
        self.stats().render(out, self.front.labels());
    }
}

fn model_thread<M: BatchModel>(
    model: &M,
    tok: &Tokenizer,
    queue: &std_mpsc::Receiver<Job>,
    shared: &Shared,
    config: BatchConfig,
) {
    let mut ws = model.new_workspace();
    while let Some(jobs) = collect(queue, config) {
        let t0 = Instant::now();
        shared
            .gauges
            .waiting
            .fetch_sub(jobs.len(), Ordering::SeqCst);
        {
            let mut st = shared.stats.lock().unwrap_or_else(|e| e.into_inner());
            st.batches += 1;
            st.batch_size.observe(jobs.len() as f64);
            for j in &jobs {
                st.queue_time.observe((t0 - j.arrival).as_secs_f64());
            }
        }
        shared.busy.store(true, Ordering::SeqCst);
        run_batch(model, tok, &mut ws, jobs, shared);
        shared.busy.store(false, Ordering::SeqCst);
        shared.gauges.observe_service(t0.elapsed().as_secs_f64());
    }
}

/// Step 1: the next batch, or None once the queue is closed. A request that
/// arrived while a batch ran may wait up to `max_wait` for others to join;
/// one that found the engine idle does not.
fn collect(queue: &std_mpsc::Receiver<Job>, config: BatchConfig) -> Option<Vec<Job>> {
    let first = queue.recv().ok()?;
    let busy = first.behind_batch;
    let mut jobs = vec![first];
    while jobs.len() < config.max_batch {
        match queue.try_recv() {
            Ok(j) => jobs.push(j),
            Err(_) => break,
        }
    }
    if busy {
        let deadline = Instant::now() + config.max_wait;
        while jobs.len() < config.max_batch {
            let left = deadline.saturating_duration_since(Instant::now());
            match queue.recv_timeout(left) {
                Ok(j) => jobs.push(j),
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => break,
            }
        }
    }
    Some(jobs)
}

/// One member of a running batch. `kv` is None once it has finished or
/// was cancelled (its K/V freed, its slot empty).
#[derive(Debug)]
struct Member {
    job: Job,
    seq: Sequence,
    kv: Option<KvCache>,
}

impl Member {
    /// Free the K/V and leave the running count, then send the last event
    /// (so a client that reads it finds the gauges already updated).
    fn end(&mut self, event: EngineEvent, gauges: &EngineGauges) {
        self.kv = None;
        gauges.running.fetch_sub(1, Ordering::SeqCst);
        let _ = self.job.events.send(event);
    }

    fn done(&mut self, finish: Finish, gauges: &EngineGauges) {
        let event = EngineEvent::Done {
            finish,
            prompt_tokens: self.seq.prompt_tokens(),
            completion_tokens: self.seq.generated_tokens(),
        };
        self.end(event, gauges);
    }
}

/// Steps 2 and 3: prefill the batch together, then decode in lock-step
/// until every member has finished or left.
fn run_batch<M: BatchModel>(
    model: &M,
    tok: &Tokenizer,
    ws: &mut M::Workspace,
    jobs: Vec<Job>,
    shared: &Shared,
) {
    let shape = model.kv_shape();
    let vocab = model.info().vocab_size;
    let mut members: Vec<Member> = Vec::with_capacity(jobs.len());
    for job in jobs {
        match Sequence::new::<M::Error>(model.info(), &job.prompt, &job.params) {
            Ok(seq) => {
                let max_len = job.prompt.len() + job.params.max_tokens;
                let kv = KvCache::new(shape.n_layer, shape.n_kv_head, shape.head_dim, max_len);
                members.push(Member {
                    job,
                    seq,
                    kv: Some(kv),
                });
            }
            Err(e) => {
                let _ = job.events.send(EngineEvent::Error(engine_error(e)));
            }
        }
    }
    let slots = members.len() as u64;
    shared
        .gauges
        .running
        .fetch_add(members.len(), Ordering::SeqCst);
    let mut batch = Batch::new();
    let mut logits: Vec<f32> = Vec::new();
    let mut prefill = true;
    loop {
        // Schedule: drop members whose client left; the rest bring their next token.
        let closing = shared.gauges.is_closing();
        for m in members.iter_mut().filter(|m| m.kv.is_some()) {
            if closing || m.job.events.is_closed() {
                m.done(Finish::Abort, &shared.gauges);
            }
        }
        batch.clear();
        let mut stores: Vec<&mut KvCache> = Vec::with_capacity(members.len());
        let mut rows: Vec<usize> = Vec::with_capacity(members.len());
        for (i, m) in members.iter_mut().enumerate() {
            let Some(len) = m.kv.as_ref().map(|kv| kv.len()) else {
                continue;
            };
            let pushed = match m.seq.next_input() {
                Some(t) if !prefill => batch.push(&[t], len),
                _ => batch.push(m.seq.prompt(), len),
            };
            if let Err(e) = pushed {
                // Unreachable for a checked request (no empty prompt), but a
                // member that cannot join the step must not wait forever.
                m.end(
                    EngineEvent::Error(EngineError::Internal(e.to_string())),
                    &shared.gauges,
                );
                continue;
            }
            if let Some(kv) = m.kv.as_mut() {
                stores.push(kv);
                rows.push(i);
            }
        }
        if rows.is_empty() {
            break;
        }
        shared
            .gauges
            .kv_cache_bytes
            .store(stores.iter().map(|s| s.bytes()).sum(), Ordering::SeqCst);
        if !prefill {
            let mut st = shared.stats.lock().unwrap_or_else(|e| e.into_inner());
            st.slot_steps += slots;
            st.empty_slot_steps += slots - rows.len() as u64;
        }
        // Run: one batched, ragged step for every live member.
        logits.resize(rows.len() * vocab, 0.0);
        if let Err(e) = model.forward_batch(&batch, &mut stores, ws, &mut logits) {
            let err = EngineError::Internal(e.to_string());
            for &i in &rows {
                members[i].end(EngineEvent::Error(err.clone()), &shared.gauges);
            }
            break;
        }
        drop(stores);
        prefill = false;
        // Post-process: sample each member's row, then stream and retire.
        let steps: Vec<(usize, bool, Step)> = rows
            .iter()
            .enumerate()
            .map(|(r, &i)| {
                let m = &mut members[i];
                let before = m.seq.generated_tokens();
                let step = m
                    .seq
                    .on_logits(&mut logits[r * vocab..(r + 1) * vocab], tok);
                (i, m.seq.generated_tokens() > before, step)
            })
            .collect();
        if members
            .iter()
            .all(|m| m.kv.is_none() || m.seq.is_finished())
        {
            shared.busy.store(false, Ordering::SeqCst);
            shared.gauges.kv_cache_bytes.store(0, Ordering::SeqCst);
        }
        for (i, is_token, step) in steps {
            let m = &mut members[i];
            if is_token {
                let _ = m.job.events.send(EngineEvent::Token(token_out(tok, &step)));
            }
            if let Some(finish) = step.finish {
                m.done(finish, &shared.gauges);
            }
        }
    }
    shared.gauges.kv_cache_bytes.store(0, Ordering::SeqCst);
}
