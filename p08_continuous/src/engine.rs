//! The continuous batcher behind the `Engine` seam. The HTTP side prepares
//! requests (p06's input path) and hands them to one model thread, which
//! loops:
//!
//! 1. **intake**: take new requests (block only when there is no work);
//! 2. **cancel**: drop requests whose client left (their K/V is freed now,
//!    not at the end of a batch);
//! 3. **step**: [`EngineCore::step`] (schedule → run → post-process);
//! 4. **stream**: send each sampled token, and the end of each finished
//!    request, to its client.
//!
//! Requests join and leave between any two steps: there is no batch to
//! wait for (Project 07's lock-step), only a token budget to share.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use common::batch::BatchModel;
use common::engine::{
    Engine, EngineError, EngineEvent, EngineLoad, EngineRequest, EngineStream, Finish,
};
use common::ModelInfo;
use p04_transformer::Tokenizer;
use p05_kv_cache::generate::GenerateParams;
use p06_server::front::{EngineFront, QueueLimits};
use p06_server::gauges::EngineGauges;
use p06_server::input::{InputProcessor, Prepared};
use p06_server::serial::{engine_error, token_out};
use p06_server::StartError;
use tokio::sync::mpsc;

use crate::core::{AddError, ContinuousConfig, EngineCore, NewRequest, StepOutput};
use crate::kv_backend::{ContiguousKv, KvBackend};
use crate::runner::{LocalRunner, ModelRunner};
use crate::scheduler::{Scheduler, SchedulerError, SeqId};
use crate::stats::StepStats;

/// A request on its way to the model thread.
#[derive(Debug)]
struct Job {
    prompt: Vec<u32>,
    params: GenerateParams,
    /// One per choice (`n`).
    events: Vec<mpsc::UnboundedSender<EngineEvent>>,
    salt: Vec<u8>,
    arrival: Instant,
}

/// Counters shared by the HTTP side and the model thread.
#[derive(Debug, Default)]
struct Shared {
    gauges: Arc<EngineGauges>,
    stats: Mutex<StepStats>,
}

#[derive(Debug)]
pub struct ContinuousEngine {
    front: EngineFront<Job>,
    shared: Arc<Shared>,
}

impl ContinuousEngine {
    /// Check the configuration and start the model thread, on p08's
    /// contiguous caches within `config.kv_cache_bytes`.
    pub fn start<M>(
        model: Arc<M>,
        tokenizer: Arc<Tokenizer>,
        name: &str,
        config: ContinuousConfig,
    ) -> Result<ContinuousEngine, StartError>
    where
        M: BatchModel + 'static,
    {
        let kv = ContiguousKv::new(model.kv_shape(), config.kv_cache_bytes);
        ContinuousEngine::start_with_backend(model, tokenizer, name, config, kv)
    }

    /// The same on any K/V backend (Project 09: paged blocks).
    pub fn start_with_backend<M, B>(
        model: Arc<M>,
        tokenizer: Arc<Tokenizer>,
        name: &str,
        config: ContinuousConfig,
        kv: B,
    ) -> Result<ContinuousEngine, StartError>
    where
        M: BatchModel + 'static,
        B: KvBackend + Send + 'static,
    {
        let info = model.info().clone();
        ContinuousEngine::start_with_runner(&info, tokenizer, name, config, kv, move |storage| {
            LocalRunner::new(model, storage)
        })
    }

    /// The same with any model runner (Project 13's, which has every rank
    /// run each step's plan), made on the model thread by `make_runner`
    /// from a storage of the backend's layout.
    pub fn start_with_runner<B, R, F>(
        info: &ModelInfo,
        tokenizer: Arc<Tokenizer>,
        name: &str,
        config: ContinuousConfig,
        kv: B,
        make_runner: F,
    ) -> Result<ContinuousEngine, StartError>
    where
        B: KvBackend + Send + 'static,
        R: ModelRunner,
        F: FnOnce(B::Storage) -> R + Send + 'static,
    {
        // Fail here, not on the thread, when the knobs are inconsistent.
        Scheduler::<()>::check(&config.scheduler_config())
            .map_err(|e| StartError::Config(Box::new(e)))?;
        let input = InputProcessor::new(tokenizer.clone(), info)?;
        let shared = Arc::new(Shared::default());
        shared
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .kv_capacity_bytes = kv.capacity_bytes();
        // Each running slot frees in about one request's service time.
        let limits = QueueLimits {
            max_waiting: config.max_waiting,
            per_unit: config.max_num_seqs,
        };
        let thread_shared = shared.clone();
        let info = info.clone();
        let front = EngineFront::start(name, input, limits, shared.gauges.clone(), move |rx| {
            let runner = make_runner(kv.new_storage());
            let Ok(core) = EngineCore::with_runner(&info, &tokenizer, &config, kv, runner) else {
                return; // checked above
            };
            model_thread(core, &tokenizer, &rx, &thread_shared)
        })?;
        Ok(ContinuousEngine { front, shared })
    }

    /// The scheduler's statistics so far.
    pub fn stats(&self) -> StepStats {
        self.shared
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Engine for ContinuousEngine {
    fn model_name(&self) -> &str {
        self.front.model_name()
    }

    fn context_length(&self) -> Option<usize> {
        self.front.context_length()
    }

    fn load(&self) -> EngineLoad {
        self.front.load()
    }

    /// One choice (`request.n` is read by `submit_choices`).
    fn submit(&self, request: EngineRequest) -> Result<EngineStream, EngineError> {
        let request = EngineRequest { n: 1, ..request };
        let mut streams = self.submit_choices(request)?;
        streams
            .pop()
            .ok_or_else(|| EngineError::Internal("no stream for the request".into()))
    }

    /// `n` choices share the prompt's computation and K/V (see
    /// [`crate::core::NewRequest`]); each counts as a request in the gauges.
    fn submit_choices(&self, request: EngineRequest) -> Result<Vec<EngineStream>, EngineError> {
        let n = request.n.max(1);
        let salt = request.cache_salt.clone().unwrap_or_default().into_bytes();
        self.front
            .submit(request, n, |Prepared { prompt, params }, events| Job {
                prompt,
                params,
                events,
                salt,
                arrival: Instant::now(),
            })
    }

    fn abort_all(&self) {
        self.front.abort_all();
    }

    fn extra_metrics(&self, out: &mut String) {
        self.stats().render(out, self.front.labels());
    }
}

/// A request the model thread holds: where its events go, and when it came.
#[derive(Debug)]
struct Client {
    events: mpsc::UnboundedSender<EngineEvent>,
    arrival: Instant,
    /// Admitted and not preempted since (counts in the running gauge).
    running: bool,
}

fn model_thread<B: KvBackend, R: ModelRunner>(
    mut core: EngineCore<'_, B, R, Client>,
    tok: &Tokenizer,
    queue: &std_mpsc::Receiver<Job>,
    shared: &Shared,
) {
    let mut next_id: SeqId = 0;
    let gauges = &shared.gauges;
    loop {
        // 1. Intake: block only when there is nothing to do.
        let first = if core.has_work() {
            None
        } else {
            match queue.recv() {
                Ok(job) => Some(job),
                Err(_) => return, // the engine is gone
            }
        };
        for job in first
            .into_iter()
            .chain(std::iter::from_fn(|| queue.try_recv().ok()))
        {
            intake(&mut core, gauges, &mut next_id, job);
        }
        // 2. Cancel: clients that left, or everyone when the server is closing.
        let closing = gauges.is_closing();
        let gone: Vec<SeqId> = core
            .clients()
            .filter(|(_, c)| closing || c.events.is_closed())
            .map(|(id, _)| id)
            .collect();
        for id in gone {
            if let Some((prompt_tokens, completion_tokens, c)) = core.abort(id) {
                leave(gauges, &c);
                let _ = c.events.send(EngineEvent::Done {
                    finish: Finish::Abort,
                    prompt_tokens,
                    completion_tokens,
                });
            }
        }
        // 3. Step.
        let t0 = Instant::now();
        let mut out = core.step();
        let step_s = t0.elapsed().as_secs_f64();
        // 4. Stream.
        update_gauges(gauges, &mut core, &mut out);
        let kv_bytes = core.kv_bytes();
        gauges.kv_cache_bytes.store(kv_bytes, Ordering::SeqCst);
        shared
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .observe(&out, step_s, kv_bytes, {
                let mut m = core.kv().metrics();
                m.extend(core.runner().metrics());
                m
            });
        stream(tok, gauges, &core, out);
    }
}

/// Hand a job to the core as one request of `n` choices, or answer it at
/// once (nothing to generate, or refused).
fn intake<B: KvBackend, R: ModelRunner>(
    core: &mut EngineCore<'_, B, R, Client>,
    gauges: &EngineGauges,
    next_id: &mut SeqId,
    job: Job,
) {
    let n = job.events.len();
    let arrival = job.arrival;
    let choices = job
        .events
        .into_iter()
        .map(|events| {
            let id = *next_id;
            *next_id += 1;
            let running = false;
            (
                id,
                Client {
                    events,
                    arrival,
                    running,
                },
            )
        })
        .collect();
    let req = NewRequest {
        prompt: &job.prompt,
        params: &job.params,
        salt: &job.salt,
        output: &[],
        choices,
    };
    let (event, clients) = match core.submit(req) {
        Ok(None) => return,
        Ok(Some(clients)) => (
            EngineEvent::Done {
                finish: Finish::Length,
                prompt_tokens: job.prompt.len(),
                completion_tokens: 0,
            },
            clients,
        ),
        Err((e, clients)) => (EngineEvent::Error(add_error(e)), clients),
    };
    gauges.waiting.fetch_sub(n, Ordering::SeqCst);
    for (_, c) in clients {
        let _ = c.events.send(event.clone());
    }
}

/// Why a request was refused at admission, as the API says it: a request
/// too long for the cache or with bad settings is the request's fault
/// (400, naming the field); the others are this engine's bugs or
/// settings (500). Every engine front on the core maps errors here.
pub fn add_error(e: AddError) -> EngineError {
    match e {
        AddError::Request(e) => engine_error(e),
        AddError::Scheduler(e @ SchedulerError::TooLong { .. }) => EngineError::InvalidRequest {
            message: e.to_string(),
            param: Some("max_tokens".into()),
        },
        AddError::Continued => EngineError::InvalidRequest {
            message: e.to_string(),
            param: Some("n".into()),
        },
        AddError::Scheduler(e) => EngineError::Internal(e.to_string()),
    }
}

/// Running and waiting gauges from the step's admissions and preemptions
/// (a sequence admitted and finished in the same step is in `retired`).
fn update_gauges<B: KvBackend, R: ModelRunner>(
    gauges: &EngineGauges,
    core: &mut EngineCore<'_, B, R, Client>,
    out: &mut StepOutput<Client>,
) {
    let StepOutput {
        schedule,
        forked,
        retired,
        ..
    } = out;
    let started = schedule.admitted.iter().chain(forked.iter());
    let moves = started
        .map(|id| (id, true))
        .chain(schedule.preempted.iter().map(|id| (id, false)));
    for (id, running) in moves {
        let c = match core.client_mut(*id) {
            Some(c) => c,
            None => match retired.iter_mut().find(|(r, _)| r == id) {
                Some((_, c)) => c,
                None => continue,
            },
        };
        if c.running != running {
            c.running = running;
            let (from, to) = if running {
                (&gauges.waiting, &gauges.running)
            } else {
                (&gauges.running, &gauges.waiting)
            };
            from.fetch_sub(1, Ordering::SeqCst);
            to.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A request leaves the gauges (before its last event, so a client that
/// reads that event finds them updated).
fn leave(gauges: &EngineGauges, c: &Client) {
    if c.running {
        gauges.running.fetch_sub(1, Ordering::SeqCst);
    } else {
        gauges.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

fn stream<B: KvBackend, R: ModelRunner>(
    tok: &Tokenizer,
    gauges: &EngineGauges,
    core: &EngineCore<'_, B, R, Client>,
    out: StepOutput<Client>,
) {
    let mut retired: HashMap<SeqId, Client> = out.retired.into_iter().collect();
    for (id, message) in out.failed {
        if let Some(c) = retired.remove(&id) {
            leave(gauges, &c);
            let _ = c.events.send(EngineEvent::Error(EngineError::Internal(
                message.to_string(),
            )));
        }
    }
    for o in out.outputs {
        let Some(c) = core.client(o.id).or_else(|| retired.get(&o.id)) else {
            continue;
        };
        if o.is_token {
            let _ = c.events.send(EngineEvent::Token(token_out(tok, &o.step)));
        }
        if let Some(finish) = o.step.finish {
            if let Some(c) = retired.remove(&o.id) {
                leave(gauges, &c);
                gauges.observe_service(c.arrival.elapsed().as_secs_f64());
                let _ = c.events.send(EngineEvent::Done {
                    finish,
                    prompt_tokens: o.prompt_tokens,
                    completion_tokens: o.completion_tokens,
                });
            }
        }
    }
    // Anyone retired without an output or an error is told, not dropped.
    for (_, c) in retired {
        leave(gauges, &c);
        let _ = c.events.send(EngineEvent::Error(EngineError::Internal(
            "the sequence left the engine without a result".into(),
        )));
    }
}
