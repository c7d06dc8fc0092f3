//! A worker's model thread: Project 08's engine core on Project 09's paged
//! K/V, with the two jobs disaggregation adds.
//!
//! - **Prefill**: run a prompt, sample its first token, export the
//!   sequence (its K/V and sampler state, [`EngineCore::export`]), drop it
//!   from the core (its blocks free at once) and hold the export on the
//!   K/V server under a lease for a decode worker to pull.
//! - **Streamed prefill**: the same, but the prompt's K/V goes out while
//!   it is computed: the storage's tap writes each layer's new positions
//!   into a live transfer the decode worker is already pulling; the first
//!   token and sampler state follow in the transfer's trailer.
//! - **Import**: lend blocks to a pull, take them back filled, admit the
//!   sequence as running with its prompt computed and stream the rest of
//!   its tokens ([`import`]).
//! - **Recompute**: the load failed (the policy says recompute): run the
//!   request from its prompt here, not streaming again the tokens the
//!   client already has.
//!
//! The thread never reads a socket: pulls happen on their own threads,
//! into blocks this thread lent them, and come back finished.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Instant;

use common::batch::BatchModel;
use common::engine::EngineError;
use p04_transformer::Tokenizer;
use p06_server::serial::token_out;
use p08_continuous::engine::add_error;
use p08_continuous::kv_backend::KvBackend;
use p08_continuous::kv_transfer::KvLease;
use p08_continuous::output::StepOutput;
use p08_continuous::scheduler::SeqId;
use p08_continuous::{ContinuousConfig, EngineCore, LocalRunner, NewRequest};
use p09_kv_manager::prefix_hash::{block_hashes, Xxh3BlockHasher};
use p09_kv_manager::PagedKv;
use tokio::sync::{mpsc, oneshot};

use crate::kv_client::RecvPool;
use crate::kv_server::KvServer;
use crate::live::Live;
use crate::protocol::prompt_hash;
use crate::tap::{TapStorage, Taps};
use crate::wire::{PrefillReply, SeqMeta, TransferHandle, WireEvent, WirePrepared, WireToken};

mod import;
pub use import::{Landed, Reserved};

/// Work for the model thread.
#[derive(Debug)]
pub enum Job {
    Prefill {
        prep: WirePrepared,
        arrival: Instant,
        /// The answer (a plain prefill), or the live transfer to fill (a
        /// streamed one, whose handle was answered already).
        reply: Result<oneshot::Sender<PrefillReply>, Arc<Live>>,
    },
    /// Allocate blocks for an import's `prompt` positions and lend them
    /// to the pull thread asking (None: none free now, or none to lend).
    Reserve {
        prompt: Vec<u32>,
        max_len: usize,
        reply: std_mpsc::SyncSender<Option<(SeqId, KvLease)>>,
    },
    /// A reservation whose pull failed, or that has nothing to decode: its
    /// blocks come home and free.
    Release { id: SeqId, lease: KvLease },
    Import {
        prep: WirePrepared,
        kv: Landed,
        meta: Box<SeqMeta>,
        /// Payload bytes the pull read, and its seconds.
        bytes: usize,
        pull_s: f64,
        /// A streamed prefill's first token: the client does not have it.
        first: Option<WireToken>,
        events: mpsc::UnboundedSender<WireEvent>,
    },
    Recompute {
        prep: WirePrepared,
        skip: usize,
        events: mpsc::UnboundedSender<WireEvent>,
    },
}

/// A streamed prefill's live transfer, ended as failed if it is dropped
/// before it ended (a path that forgets it, or the thread unwinding): a
/// decode worker pulling it then hears so, instead of heartbeats forever.
#[derive(Debug)]
struct Streamed(Arc<Live>);

impl Drop for Streamed {
    fn drop(&mut self) {
        if !self.0.ended() {
            self.0
                .fail("the prefill was dropped before its first token".into());
        }
    }
}

/// What the thread holds per sequence.
#[derive(Debug)]
enum Client {
    Prefill {
        reply: Option<oneshot::Sender<PrefillReply>>,
        /// Streamed: the transfer its layers are written into.
        live: Option<Streamed>,
        arrival: Instant,
        started: Option<Instant>,
    },
    Stream {
        events: mpsc::UnboundedSender<WireEvent>,
        /// Sampled tokens not to stream (the client has them).
        skip: usize,
    },
}

impl Client {
    fn is_gone(&self) -> bool {
        match self {
            // A streamed prefill runs to its end (a decode worker waits)
            // unless its transfer was cancelled (the client left).
            Client::Prefill { live: Some(s), .. } => s.0.ended(),
            Client::Prefill { reply, .. } => reply.as_ref().is_none_or(|r| r.is_closed()),
            Client::Stream { events, .. } => events.is_closed(),
        }
    }
}

/// Load the proxy routes by (published to NATS, served on `/load`).
#[derive(Debug, Default)]
pub struct WorkerLoad {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    /// Blocks lent to pulls not yet admitted.
    pub reserved: AtomicUsize,
    pub kv_used_blocks: AtomicUsize,
    pub kv_total_blocks: AtomicUsize,
    pub imported: AtomicU64,
    /// Of those, pulled straight into their reserved blocks.
    pub imported_in_blocks: AtomicU64,
    pub recomputed: AtomicU64,
    pub prefilled: AtomicU64,
    /// Block hashes cached by prefills since the last K/V event.
    pub stored: std::sync::Mutex<Vec<u64>>,
}

/// The handle the HTTP side holds.
#[derive(Clone, Debug)]
pub struct WorkerHandle {
    pub jobs: std_mpsc::Sender<Job>,
    pub load: Arc<WorkerLoad>,
    /// Buffers pulls land in; an imported one comes back here.
    pub pool: Arc<RecvPool>,
}

/// Start the model thread on `model` with paged K/V `kv`; prefill workers
/// pass the K/V server their exports go to.
pub fn start<M: BatchModel + Send + Sync + 'static>(
    model: Arc<M>,
    tok: Arc<Tokenizer>,
    config: ContinuousConfig,
    kv: PagedKv,
    server: Option<Arc<KvServer>>,
) -> std::io::Result<WorkerHandle> {
    let (tx, rx) = std_mpsc::channel();
    let load = Arc::new(WorkerLoad::default());
    load.kv_total_blocks
        .store(kv.manager().pool().num_blocks(), Ordering::SeqCst);
    let l = load.clone();
    let pool = Arc::new(RecvPool::new(2));
    let p = pool.clone();
    std::thread::Builder::new()
        .name("model".into())
        .spawn(move || {
            let info = model.info().clone();
            let taps = Taps::default();
            let runner = LocalRunner::new(model, TapStorage::new(kv.new_storage(), taps.clone()));
            let core = match EngineCore::with_runner(&info, &tok, &config, kv, runner) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("worker: {e}");
                    return;
                }
            };
            Thread {
                core,
                tok: &tok,
                server,
                load: l,
                pool: p,
                taps,
                next_id: 0,
                pending: VecDeque::new(),
            }
            .run(&rx)
        })?;
    Ok(WorkerHandle {
        jobs: tx,
        load,
        pool,
    })
}

type Storage = TapStorage<p09_kv_manager::BlockStorage>;
type Core<'a, M> = EngineCore<'a, PagedKv, LocalRunner<Arc<M>, Storage>, Client>;

struct Thread<'a, M: BatchModel> {
    core: Core<'a, M>,
    tok: &'a Tokenizer,
    server: Option<Arc<KvServer>>,
    load: Arc<WorkerLoad>,
    pool: Arc<RecvPool>,
    /// Streamed prefills' live transfers, by sequence (the storage's taps).
    taps: Taps,
    next_id: SeqId,
    /// Imports that found no room yet (retried after every step).
    pending: VecDeque<import::Pending>,
}

impl<M: BatchModel> Thread<'_, M> {
    fn run(mut self, rx: &std_mpsc::Receiver<Job>) {
        loop {
            let first = if self.core.has_work() || !self.pending.is_empty() {
                None
            } else {
                match rx.recv() {
                    Ok(j) => Some(j),
                    Err(_) => return,
                }
            };
            for job in first
                .into_iter()
                .chain(std::iter::from_fn(|| rx.try_recv().ok()))
            {
                self.intake(job);
            }
            self.retry_pending();
            let gone: Vec<SeqId> = self
                .core
                .clients()
                .filter(|(_, c)| c.is_gone())
                .map(|(id, _)| id)
                .collect();
            for id in gone {
                self.core.abort(id);
            }
            // What it admitted counts from now, not after its (maybe long)
            // first step.
            self.publish_load();
            let t0 = Instant::now();
            let out = self.core.step();
            self.post(out, t0);
            self.taps
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|_, l| !l.ended());
            self.publish_load();
            if !self.core.has_work() && !self.pending.is_empty() {
                // Nothing runs and the imports still find no room: the pool
                // is held by something else; do not spin.
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
    }

    fn publish_load(&self) {
        let s = self.core.scheduler();
        self.load.running.store(s.num_running(), Ordering::SeqCst);
        self.load
            .waiting
            .store(s.num_waiting() + self.pending.len(), Ordering::SeqCst);
        self.load
            .reserved
            .store(self.core.num_reserved(), Ordering::SeqCst);
        self.load
            .kv_used_blocks
            .store(self.core.kv().manager().used_blocks(), Ordering::SeqCst);
    }

    fn id(&mut self) -> SeqId {
        self.next_id += 1;
        self.next_id
    }

    fn intake(&mut self, job: Job) {
        match job {
            Job::Prefill {
                prep,
                arrival,
                reply,
            } => {
                let (reply, live) = match reply {
                    Ok(r) => (Some(r), None),
                    Err(l) => (None, Some(l)),
                };
                let client = Client::Prefill {
                    reply,
                    live: live.clone().map(Streamed),
                    arrival,
                    started: None,
                };
                match self.submit(&prep, client) {
                    Ok(Some(id)) => {
                        if let Some(l) = live {
                            self.taps
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .insert(id, l);
                        }
                    }
                    Ok(None) => {}
                    Err((e, c)) => fail(c, e),
                }
            }
            Job::Recompute { prep, skip, events } => {
                self.load.recomputed.fetch_add(1, Ordering::SeqCst);
                let _ = events.send(WireEvent::Admitted {
                    recomputed: true,
                    kv_bytes: 0,
                    pull_s: 0.0,
                });
                // A continued request samples after its output: of what the
                // client has, only what comes after that is sampled again.
                let client = Client::Stream {
                    events: events.clone(),
                    skip: skip.saturating_sub(prep.output.len()),
                };
                if let Err((e, c)) = self.submit(&prep, client) {
                    fail(c, e);
                }
            }
            Job::Reserve {
                prompt,
                max_len,
                reply,
            } => self.reserve(&prompt, max_len, reply),
            Job::Release { id, lease } => self.release(id, Some(lease)),
            job @ Job::Import { .. } => self.land(job),
        }
    }

    /// Queue a request from its prompt: its id (None: it finished before
    /// it started); an error comes back with the client.
    #[allow(clippy::result_large_err)] // the client comes back to be told
    fn submit(
        &mut self,
        prep: &WirePrepared,
        client: Client,
    ) -> Result<Option<SeqId>, (EngineError, Client)> {
        let id = self.id();
        let params = prep.params();
        let req = NewRequest {
            prompt: &prep.prompt,
            params: &params,
            salt: &prep.salt,
            output: &prep.output,
            choices: vec![(id, client)],
        };
        match self.core.submit(req) {
            Ok(None) => Ok(Some(id)),
            Ok(Some(mut c)) => {
                // Finished before it started (max_tokens 0).
                let (_, client) = c.pop().expect("one choice");
                finish_unstarted(client, prep.prompt.len());
                Ok(None)
            }
            Err((e, mut c)) => {
                let (_, client) = c.pop().expect("one choice");
                Err((add_error(e), client))
            }
        }
    }

    fn post(&mut self, out: StepOutput<Client>, step_start: Instant) {
        for id in &out.schedule.admitted {
            if let Some(Client::Prefill { started, .. }) = self.core.client_mut(*id) {
                started.get_or_insert(step_start);
            }
        }
        let mut retired: std::collections::HashMap<SeqId, Client> =
            out.retired.into_iter().collect();
        for (id, e) in out.failed {
            if let Some(c) = retired.remove(&id) {
                fail(c, EngineError::Internal(e.to_string()));
            }
        }
        for o in out.outputs {
            let token = o
                .is_token
                .then(|| WireToken::new(o.step.token, &token_out(self.tok, &o.step)));
            if let Some(c) = retired.remove(&o.id) {
                // Finished this step.
                let finish = o.step.finish.map_or("abort", |f| f.as_str());
                match c {
                    Client::Prefill { live: Some(l), .. } => {
                        // Streamed: the decode worker gets the whole answer
                        // in the trailer and imports nothing.
                        let meta = SeqMeta {
                            first: token.clone(),
                            finish: Some(finish.into()),
                            prompt_tokens: o.prompt_tokens,
                            completion_tokens: o.completion_tokens,
                            ..SeqMeta::default()
                        };
                        l.0.finish(serde_json::to_vec(&meta).unwrap_or_default());
                    }
                    Client::Prefill { reply: Some(r), .. } => {
                        let _ = r.send(PrefillReply::Finished {
                            first: token.clone(),
                            finish: finish.into(),
                            prompt_tokens: o.prompt_tokens,
                            completion_tokens: o.completion_tokens,
                        });
                    }
                    Client::Prefill { reply: None, .. } => {}
                    Client::Stream { events, skip } => {
                        if let Some(t) = token {
                            if skip == 0 {
                                let _ = events.send(WireEvent::Token(t));
                            }
                        }
                        let _ = events.send(WireEvent::Done {
                            finish: finish.into(),
                            prompt_tokens: o.prompt_tokens,
                            completion_tokens: o.completion_tokens,
                        });
                    }
                }
                continue;
            }
            let Some(c) = self.core.client_mut(o.id) else {
                continue;
            };
            match c {
                Client::Stream { events, skip } => {
                    if let Some(t) = token {
                        if *skip > 0 {
                            *skip -= 1;
                        } else {
                            let _ = events.send(WireEvent::Token(t));
                        }
                    }
                }
                Client::Prefill { .. } => self.hand_off(o.id, token),
            }
        }
        for (_, c) in retired {
            fail(
                c,
                EngineError::Internal("the sequence ended without output".into()),
            );
        }
    }

    /// A prefill's first token is out: hand the sequence off (export and
    /// hold it; or, streamed, end its live transfer with the sequence's
    /// state), drop it here (its blocks free at once), answer.
    fn hand_off(&mut self, id: SeqId, first: Option<WireToken>) {
        let streamed = matches!(
            self.core.client(id),
            Some(Client::Prefill { live: Some(_), .. })
        );
        let exported = match streamed {
            true => self.core.export_state(id),
            false => self.core.export(id),
        };
        let Some((_, _, client)) = self.core.abort(id) else {
            return;
        };
        let Client::Prefill {
            reply,
            live,
            arrival,
            started,
        } = client
        else {
            return;
        };
        let (Some(server), Ok(state)) = (&self.server, exported) else {
            let why = "this worker cannot hold K/V for a transfer".to_string();
            return fail_prefill(reply, live, EngineError::Internal(why));
        };
        self.load.prefilled.fetch_add(1, Ordering::SeqCst);
        let block_size = self.core.kv().manager().block_size();
        let hashes = block_hashes(&Xxh3BlockHasher, &state.prompt, block_size, &state.salt);
        self.load
            .stored
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(hashes);
        let started = started.unwrap_or(arrival);
        // A sequence handed off has sampled a token that joins its output
        // (a stop token would have ended it); the stand-in is never sent.
        let first: WireToken = first.unwrap_or_else(|| WireToken {
            id: state.output.last().copied().unwrap_or(0),
            text: String::new(),
            logprob: None,
            top_logprobs: vec![],
        });
        let mut meta = SeqMeta {
            output: state.output.clone(),
            sampler_seed: state.sampler.seed,
            sampler_draws: state.sampler.draws,
            queue_s: (started - arrival).as_secs_f64(),
            prefill_s: started.elapsed().as_secs_f64(),
            ..SeqMeta::default()
        };
        if let Some(live) = live {
            meta.first = Some(first);
            return live.0.finish(serde_json::to_vec(&meta).unwrap_or_default());
        }
        let Some(reply) = reply else { return };
        let (queue_s, prefill_s) = (meta.queue_s, meta.prefill_s);
        let hash = prompt_hash(&state.prompt);
        let tokens = state.kv.tokens;
        let meta = serde_json::to_vec(&meta).unwrap_or_default();
        let transfer_id = server.hold(state.kv, hash, meta);
        let sent = reply.send(PrefillReply::Transfer {
            first,
            handle: TransferHandle {
                kv_addr: server.addr.clone(),
                transfer_id,
                prompt_hash: hash,
                tokens,
                lease_ms: server.lease.as_millis() as u64,
            },
            queue_s,
            prefill_s,
        });
        if sent.is_err() {
            // The proxy left (its client did) as the prefill ended: no one
            // will pull this.
            server.cancel(transfer_id);
        }
    }
}

/// A prefill that cannot go on: its answer, or its live transfer, says why.
fn fail_prefill(
    reply: Option<oneshot::Sender<PrefillReply>>,
    live: Option<Streamed>,
    e: EngineError,
) {
    if let Some(l) = live {
        l.0.fail(e.to_string());
    }
    if let Some(r) = reply {
        let _ = r.send(PrefillReply::Error((&e).into()));
    }
}

fn finish_unstarted(c: Client, prompt_tokens: usize) {
    match c {
        Client::Prefill { live: Some(l), .. } => {
            l.0.fail("the request finished before it started (max_tokens 0)".into())
        }
        Client::Prefill { reply: Some(r), .. } => {
            let _ = r.send(PrefillReply::Finished {
                first: None,
                finish: "length".into(),
                prompt_tokens,
                completion_tokens: 0,
            });
        }
        Client::Prefill { reply: None, .. } => {}
        Client::Stream { events, .. } => {
            let _ = events.send(WireEvent::Done {
                finish: "length".into(),
                prompt_tokens,
                completion_tokens: 0,
            });
        }
    }
}

fn fail(c: Client, e: EngineError) {
    match c {
        Client::Prefill { reply, live, .. } => fail_prefill(reply, live, e),
        Client::Stream { events, .. } => {
            let _ = events.send(WireEvent::Error((&e).into()));
        }
    }
}
