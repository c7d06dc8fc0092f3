//! The proxy: Project 06's OpenAI API in front, disaggregated serving
//! behind (vLLM's P/D proxy, Dynamo's frontend). It tokenizes (so a bad
//! request is a 400 at once and the router sees the prompt's blocks),
//! then for each request:
//!
//! 1. **prefill**: picks a prefill worker (longest cached prefix, then
//!    load) and posts the prepared request; the answer is the first token
//!    and a handle on the prompt's K/V, held there under a lease;
//! 2. **decode**: picks a decode worker (most free K/V) and orders it to
//!    pull the K/V and continue; its stream starts with `admitted`, then
//!    the proxy sends the client the first token and relays the rest.
//!
//! Layer-wise (`--layerwise`): the prefill worker answers at once with the
//! handle, and the decode worker pulls while the prompt is computed, each
//! layer as soon as it is written; the first token then comes from the
//! decode worker, in the transfer's trailer.
//!
//! Failures: a prefill worker that cannot be reached is passed over for
//! the next; with none left the decode worker recomputes the prompt. A
//! decode worker lost before its stream started is replaced (the next
//! one pulls the K/V if it is still held, or recomputes). One lost after
//! (its connection reset, its stream cut, or silent past
//! [`CHUNK_GAP`]) costs the client nothing: the proxy owns the request
//! and the ids of every token it streamed, so it **migrates** it: the
//! prompt and those tokens go through a prefill again (prefix-cached
//! where a worker still holds the prompt), the sampler standing where it
//! would after them, and another decode worker continues with the next
//! token: the same tokens as an uncut run, none lost, none repeated
//! (NVIDIA Dynamo's request migration).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::engine::{Engine, EngineError, EngineEvent, EngineLoad, EngineRequest, EngineStream};
use futures_util::StreamExt;
use p06_server::input::InputProcessor;
use p09_kv_manager::prefix_hash::{block_hashes, Xxh3BlockHasher};
use tokio::sync::mpsc;

use crate::registry::{Role, View, WorkerRecord};
use crate::routing::{Basis, Board};
use crate::wire::{
    finish_from, DecodeOrder, LoadFailurePolicy, PrefillReply, TransferHandle, WireEvent,
    WirePrepared, WireToken,
};

/// Most times one request moves on after losing its decode worker
/// mid-stream.
pub const MAX_MIGRATIONS: usize = 3;

/// A decode worker's answer must start (its headers) within this.
pub const HEADERS_WAIT: Duration = Duration::from_secs(10);

/// A decode worker silent this long mid-stream (no event and no keepalive,
/// which come every second) is taken as lost: a link gone without a
/// reset, a worker wedged inside its lease.
pub const CHUNK_GAP: Duration = Duration::from_secs(15);

/// A decode worker whose etcd lease is gone (it left the view) and that
/// has been silent this long is taken as lost: a stopped process. One
/// that left the registry to drain keeps streaming (and its keepalives
/// come every second), so it is not cut.
pub const LEASE_GONE_GAP: Duration = Duration::from_secs(3);

/// A cancel of a gone client's transfer must be answered within this
/// (else the transfer's lease frees it).
pub const CANCEL_WAIT: Duration = Duration::from_secs(1);

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct ProxyStats {
    pub requests: AtomicU64,
    pub prefill_retries: AtomicU64,
    pub decode_retries: AtomicU64,
    /// Requests moved to another decode worker mid-stream.
    pub migrated: AtomicU64,
    /// Requests whose prompt the decode worker recomputed.
    pub recomputed: AtomicU64,
    /// Requests that went straight to a decode worker (no prefill worker).
    pub no_prefill: AtomicU64,
    pub kv_bytes: AtomicU64,
    pub errors: AtomicU64,
    pub by_prefix: AtomicU64,
    pub by_report: AtomicU64,
    pub by_inflight: AtomicU64,
    /// Requests submitted and not yet finished (the proxy's `running`:
    /// what an autoscaler on concurrency counts).
    pub in_flight: AtomicUsize,
}

/// A request counted in `in_flight` from its submission until its last
/// event is sent (so a client that has its answer never reads itself as
/// still running), or until its trip ends, however.
#[derive(Debug)]
struct Live {
    stats: Arc<ProxyStats>,
    ended: AtomicBool,
}

impl Live {
    fn start(stats: Arc<ProxyStats>) -> Live {
        stats.in_flight.fetch_add(1, Ordering::SeqCst);
        Live {
            stats,
            ended: AtomicBool::new(false),
        }
    }

    /// Counts the request out, once.
    fn end(&self) {
        if !self.ended.swap(true, Ordering::SeqCst) {
            self.stats.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.end();
    }
}

#[derive(Debug)]
pub struct Proxy {
    name: String,
    context: usize,
    input: InputProcessor,
    view: Arc<View>,
    pub board: Arc<Board>,
    http: reqwest::Client,
    policy: LoadFailurePolicy,
    pub stats: Arc<ProxyStats>,
    closing: AtomicBool,
    rt: tokio::runtime::Handle,
    /// Stream each prompt's K/V while it is prefilled (`/prefill_stream`):
    /// the decode worker pulls layer by layer as they are computed.
    layerwise: bool,
    /// How long a request waits for a decode worker when none it has not
    /// tried is registered (one being replaced) before it fails.
    worker_wait: Duration,
}

/// One request's journey (cloned into its task).
struct Trip {
    view: Arc<View>,
    board: Arc<Board>,
    http: reqwest::Client,
    policy: LoadFailurePolicy,
    stats: Arc<ProxyStats>,
    live: Live,
    events: mpsc::UnboundedSender<EngineEvent>,
    id: String,
    layerwise: bool,
    /// How long a request waits for a decode worker when none it has not
    /// tried is registered (one being replaced) before it fails.
    worker_wait: Duration,
}

impl Proxy {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: String,
        context: usize,
        input: InputProcessor,
        view: Arc<View>,
        board: Arc<Board>,
        policy: LoadFailurePolicy,
        rt: tokio::runtime::Handle,
    ) -> Proxy {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .build()
            .unwrap_or_default();
        Proxy {
            name,
            context,
            input,
            view,
            board,
            http,
            policy,
            stats: Arc::default(),
            closing: AtomicBool::new(false),
            rt,
            layerwise: false,
            worker_wait: Duration::ZERO,
        }
    }

    /// Stream prompts' K/V while they are prefilled (or not).
    pub fn layerwise(mut self, on: bool) -> Proxy {
        self.layerwise = on;
        self
    }

    /// Hold a request up to `wait` for a decode worker to register when
    /// none is (instead of failing it at once).
    pub fn worker_wait(mut self, wait: Duration) -> Proxy {
        self.worker_wait = wait;
        self
    }
}

impl Engine for Proxy {
    fn model_name(&self) -> &str {
        &self.name
    }

    fn context_length(&self) -> Option<usize> {
        Some(self.context)
    }

    /// Requests in flight through the proxy; the queues and the K/V are
    /// the workers' (their NATS reports).
    fn load(&self) -> EngineLoad {
        EngineLoad {
            running: self.stats.in_flight.load(Ordering::SeqCst),
            ..EngineLoad::default()
        }
    }

    fn submit(&self, request: EngineRequest) -> Result<EngineStream, EngineError> {
        if self.closing.load(Ordering::SeqCst) {
            return Err(EngineError::Unavailable(
                "the proxy is shutting down".into(),
            ));
        }
        let salt = request.cache_salt.clone().unwrap_or_default().into_bytes();
        let id = request.id.clone();
        let prepared = self.input.prepare(request)?;
        let prep = WirePrepared::new(prepared.prompt, &prepared.params, salt);
        let (tx, rx) = mpsc::unbounded_channel();
        self.stats.requests.fetch_add(1, Ordering::SeqCst);
        let trip = Trip {
            view: self.view.clone(),
            board: self.board.clone(),
            http: self.http.clone(),
            policy: self.policy,
            stats: self.stats.clone(),
            live: Live::start(self.stats.clone()),
            events: tx,
            id,
            layerwise: self.layerwise,
            worker_wait: self.worker_wait,
        };
        self.rt.spawn(trip.run(prep));
        Ok(rx)
    }

    /// `n` choices as `n` requests through the workers, each seeded as
    /// the single server seeds the sequences it forks for them
    /// ([`common::sampling::SamplingParams::of_choice`]), so each choice is the one the
    /// single server gives.
    fn submit_choices(&self, request: EngineRequest) -> Result<Vec<EngineStream>, EngineError> {
        let n = request.n.max(1);
        (0..n as u64)
            .map(|i| {
                let mut r = request.clone();
                r.n = 1;
                r.sampling = request.sampling.of_choice(i);
                if i > 0 {
                    r.id = format!("{}-{i}", request.id);
                }
                self.submit(r)
            })
            .collect()
    }

    fn abort_all(&self) {
        self.closing.store(true, Ordering::SeqCst);
    }

    fn extra_metrics(&self, out: &mut String) {
        let s = &self.stats;
        let counters = [
            ("p14_proxy_requests_total", &s.requests),
            ("p14_proxy_prefill_retries_total", &s.prefill_retries),
            ("p14_proxy_decode_retries_total", &s.decode_retries),
            ("p14_proxy_migrated_total", &s.migrated),
            ("p14_proxy_recomputed_total", &s.recomputed),
            ("p14_proxy_no_prefill_total", &s.no_prefill),
            ("p14_proxy_kv_transfer_bytes_total", &s.kv_bytes),
            ("p14_proxy_errors_total", &s.errors),
            ("p14_proxy_routed_by_prefix_total", &s.by_prefix),
            ("p14_proxy_routed_by_report_total", &s.by_report),
            ("p14_proxy_routed_by_inflight_total", &s.by_inflight),
        ];
        for (name, c) in counters {
            out.push_str(&format!(
                "# TYPE {name} counter\n{name} {}\n",
                c.load(Ordering::SeqCst)
            ));
        }
        for role in [Role::Prefill, Role::Decode] {
            out.push_str(&format!(
                "p14_proxy_workers{{role=\"{}\"}} {}\n",
                role.as_str(),
                self.view.workers(role).len()
            ));
        }
    }
}

/// A prefill worker counted in flight until its prefill is known done:
/// a streamed prefill answers at once, so it stays counted until the
/// decode worker's stream starts (its first token exists by then), or the
/// request ends. Routing by in-flight work then sees a worker busy with
/// streamed prefills as busy.
struct Counted {
    board: Arc<Board>,
    id: Option<String>,
}

impl Counted {
    fn end(&mut self) {
        if let Some(id) = self.id.take() {
            self.board.end(&id);
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.end();
    }
}

/// How a prefill ended.
enum Prefilled {
    /// A worker's answer, that worker still counted (if streamed), and its
    /// control URL.
    Reply(Box<PrefillReply>, Counted, String),
    /// No prefill worker answered: the decode worker recomputes.
    NoWorker,
    /// The client left while it ran.
    ClientGone,
}

/// Why a decode attempt ended without a result.
enum Lost {
    /// Before `admitted`: another worker may take the request.
    BeforeStart(String),
    /// After: the stream is cut.
    Started(String),
}

impl Trip {
    fn count(&self, basis: Basis) {
        let c = match basis {
            Basis::Prefix => &self.stats.by_prefix,
            Basis::Reported => &self.stats.by_report,
            Basis::InFlight => &self.stats.by_inflight,
        };
        c.fetch_add(1, Ordering::SeqCst);
    }

    fn error(&self, e: EngineError) {
        self.stats.errors.fetch_add(1, Ordering::SeqCst);
        self.last(EngineEvent::Error(e));
    }

    /// The request's last event (`Done` or `Error`): counted out of
    /// `in_flight` first.
    fn last(&self, event: EngineEvent) {
        self.live.end();
        let _ = self.events.send(event);
    }

    /// The request from its prompt to its last token, moved on (at most
    /// [`MAX_MIGRATIONS`] times) when a decode worker is lost mid-stream.
    async fn run(self, mut prep: WirePrepared) {
        // The ids of the tokens the client has, in order.
        let mut sent: Vec<u32> = Vec::new();
        let mut moves = 0;
        loop {
            let cut = match self.attempt(&prep, &mut sent).await {
                Ok(()) => return,
                Err(cut) => cut,
            };
            if self.events.is_closed() {
                return;
            }
            if moves == MAX_MIGRATIONS {
                return self.error(EngineError::Internal(format!(
                    "{cut}; moved {moves} times already, not again"
                )));
            }
            moves += 1;
            self.stats.migrated.fetch_add(1, Ordering::SeqCst);
            eprintln!(
                "proxy {}: {cut}; continuing after its {} tokens elsewhere",
                self.id,
                sent.len()
            );
            prep.output = sent.clone();
        }
    }

    /// One pass: prefill (of the prompt and the tokens `sent` so far),
    /// then decode; Err when the stream was cut after it started (the
    /// request can move on from `sent`).
    async fn attempt(&self, prep: &WirePrepared, sent: &mut Vec<u32>) -> Result<(), String> {
        let (reply, counted, at) = match self.prefill(prep).await {
            Prefilled::Reply(r, c, at) => (Some(*r), c, at),
            Prefilled::NoWorker => (None, self.uncounted(), String::new()),
            // The client left: the prefill worker dropped it with our
            // request (its handler's answer has no one to go to).
            Prefilled::ClientGone => return Ok(()),
        };
        match reply {
            Some(PrefillReply::Transfer { first, handle, .. }) => {
                let r = self
                    .decode(prep, Some(handle.clone()), Some(first), counted, sent)
                    .await;
                self.cancel_if_gone(&at, &handle).await;
                r
            }
            // Streamed: the decode worker sends the first token on.
            Some(PrefillReply::Started { handle }) => {
                let r = self
                    .decode(prep, Some(handle.clone()), None, counted, sent)
                    .await;
                self.cancel_if_gone(&at, &handle).await;
                r
            }
            Some(PrefillReply::Finished {
                first,
                finish,
                prompt_tokens,
                completion_tokens,
            }) => {
                if let Some(t) = first {
                    sent.push(t.id);
                    let _ = self.events.send(EngineEvent::Token(t.into()));
                }
                self.last(EngineEvent::Done {
                    finish: finish_from(&finish),
                    prompt_tokens,
                    completion_tokens,
                });
                Ok(())
            }
            Some(PrefillReply::Error(e)) => {
                self.error(e.into());
                Ok(())
            }
            None => {
                self.stats.no_prefill.fetch_add(1, Ordering::SeqCst);
                self.decode(prep, None, None, counted, sent).await
            }
        }
    }

    fn uncounted(&self) -> Counted {
        Counted {
            board: self.board.clone(),
            id: None,
        }
    }

    /// A client gone with its prompt's K/V still held for it (its stream
    /// ended before a decode worker took the transfer, or while one pulled
    /// it): the prefill worker at `at` frees it now, and stops the prefill
    /// if it is still being streamed, instead of holding it to its lease.
    async fn cancel_if_gone(&self, at: &str, handle: &TransferHandle) {
        if !self.events.is_closed() || at.is_empty() {
            return;
        }
        let r = self
            .http
            .post(format!("{at}/cancel"))
            .json(&serde_json::json!({ "transfer_id": handle.transfer_id }))
            .timeout(CANCEL_WAIT)
            .send()
            .await;
        if let Err(e) = r {
            // Its lease frees it then.
            eprintln!("proxy {}: cancelling transfer at {at}: {e}", self.id);
        }
    }

    /// The prefill's answer (and the worker's control URL); a streamed
    /// prefill's worker still counted in flight.
    async fn prefill(&self, prep: &WirePrepared) -> Prefilled {
        let mut tried: Vec<String> = Vec::new();
        loop {
            let workers = self.view.workers(Role::Prefill);
            let block_size = workers.first().map_or(16, |w| w.block_size);
            let hashes = block_hashes(&Xxh3BlockHasher, &prep.prompt, block_size, &prep.salt);
            let Some((w, basis)) = self.board.pick_prefill(&workers, &hashes, &tried) else {
                return Prefilled::NoWorker;
            };
            self.board.begin(&w.id);
            let mut counted = Counted {
                board: self.board.clone(),
                id: Some(w.id.clone()),
            };
            let path = match self.layerwise {
                true => "prefill_stream",
                false => "prefill",
            };
            let ask = async {
                let r = self
                    .http
                    .post(format!("{}/{path}", w.http))
                    .json(prep)
                    // A long prompt queued behind others can take a while;
                    // a dead worker fails at once (its socket closes).
                    .timeout(Duration::from_secs(300))
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status().is_success() => r.json::<PrefillReply>().await.ok(),
                    _ => None,
                }
            };
            let reply = tokio::select! {
                r = ask => r,
                // The client left: dropping the request's connection makes
                // the worker drop the prefill at its next step.
                _ = self.events.closed() => return Prefilled::ClientGone,
            };
            let streaming = matches!(reply, Some(PrefillReply::Started { .. }));
            if !streaming {
                counted.end();
            }
            match reply {
                Some(reply) => {
                    self.count(basis);
                    return Prefilled::Reply(Box::new(reply), counted, w.http);
                }
                None => {
                    eprintln!("proxy {}: prefill worker {} failed; next", self.id, w.id);
                    self.stats.prefill_retries.fetch_add(1, Ordering::SeqCst);
                    self.board.mark_suspect(&w);
                    tried.push(w.id);
                }
            }
        }
    }

    /// Decode on one worker after another until the stream starts; Err
    /// when it is cut after that (see [`Trip::run`]).
    async fn decode(
        &self,
        prepared: &WirePrepared,
        handle: Option<TransferHandle>,
        first: Option<WireToken>,
        mut counted: Counted,
        sent: &mut Vec<u32>,
    ) -> Result<(), String> {
        let mut tried: Vec<String> = Vec::new();
        let mut policy = self.policy;
        let since = std::time::Instant::now();
        loop {
            // Tried by instance: a worker restarted under its old id is
            // another process, worth a try.
            let workers: Vec<WorkerRecord> = self
                .view
                .workers(Role::Decode)
                .into_iter()
                .filter(|w| !tried.contains(&w.instance()))
                .collect();
            if workers.is_empty() && since.elapsed() < self.worker_wait {
                if self.events.is_closed() {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            let Some((w, basis)) = self.board.pick_decode(&workers, &[]) else {
                let why = match tried.is_empty() {
                    true => "no decode worker is registered".to_string(),
                    false => format!("every decode worker failed ({})", tried.join(", ")),
                };
                self.error(EngineError::Unavailable(why));
                return Ok(());
            };
            self.count(basis);
            let order = DecodeOrder {
                request_id: self.id.clone(),
                prepared: prepared.clone(),
                handle: handle.clone(),
                already_sent: prepared.output.len() + first.is_some() as usize,
                policy,
            };
            self.board.begin(&w.id);
            let r = self
                .stream_from(&w, &order, first.clone(), &mut counted, sent)
                .await;
            self.board.end(&w.id);
            match r {
                Ok(()) => return Ok(()),
                Err(Lost::Started(why)) => {
                    self.board.mark_suspect(&w);
                    return Err(format!("decode worker {} was lost mid-stream: {why}", w.id));
                }
                Err(Lost::BeforeStart(why)) => {
                    eprintln!(
                        "proxy {}: decode worker {} failed before its stream ({why}); next",
                        self.id, w.id
                    );
                    self.stats.decode_retries.fetch_add(1, Ordering::SeqCst);
                    self.board.mark_suspect(&w);
                    tried.push(w.instance());
                    // The K/V may be gone with the pull; the next worker
                    // recomputes if the prefill's copy is.
                    policy = LoadFailurePolicy::Recompute;
                }
            }
        }
    }

    /// Relay one decode worker's stream to the client, each token's id
    /// into `sent`.
    async fn stream_from(
        &self,
        w: &WorkerRecord,
        order: &DecodeOrder,
        mut first: Option<WireToken>,
        counted: &mut Counted,
        sent: &mut Vec<u32>,
    ) -> Result<(), Lost> {
        let post = self
            .http
            .post(format!("{}/decode", w.http))
            .json(order)
            .send();
        let r = match tokio::time::timeout(HEADERS_WAIT, post).await {
            Ok(r) => r.map_err(|e| Lost::BeforeStart(e.to_string()))?,
            Err(_) => {
                return Err(Lost::BeforeStart(format!(
                    "no answer in {} s",
                    HEADERS_WAIT.as_secs()
                )))
            }
        };
        if !r.status().is_success() {
            return Err(Lost::BeforeStart(format!("status {}", r.status())));
        }
        let mut body = r.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        let mut started = false;
        let lost = |started: bool, why: String| match started {
            true => Lost::Started(why),
            false => Lost::BeforeStart(why),
        };
        let mut heard = std::time::Instant::now();
        loop {
            let next = tokio::select! {
                n = tokio::time::timeout(Duration::from_millis(500), body.next()) => n,
                // The client left: dropping the body cancels the decode.
                _ = self.events.closed() => return Ok(()),
            };
            let chunk = match next {
                Ok(Some(Ok(c))) => c,
                Ok(Some(Err(e))) => return Err(lost(started, e.to_string())),
                Ok(None) => return Err(lost(started, "its stream ended early".into())),
                Err(_) => {
                    let silent = heard.elapsed();
                    let me = w.instance();
                    let leased = self
                        .view
                        .workers(Role::Decode)
                        .iter()
                        .any(|r| r.instance() == me);
                    if silent >= CHUNK_GAP || (!leased && silent >= LEASE_GONE_GAP) {
                        let why = match leased {
                            true => format!("nothing heard for {} s", silent.as_secs()),
                            false => format!(
                                "its lease is gone and nothing heard for {} s",
                                silent.as_secs()
                            ),
                        };
                        return Err(lost(started, why));
                    }
                    continue;
                }
            };
            heard = std::time::Instant::now();
            buf.extend_from_slice(&chunk);
            while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue; // a keepalive: the decode worker lives
                }
                let ev: WireEvent = serde_json::from_slice(&line)
                    .map_err(|e| lost(started, format!("an unreadable event ({e})")))?;
                if self.events.is_closed() {
                    return Ok(()); // the client left; dropping the body cancels
                }
                match ev {
                    WireEvent::Admitted {
                        recomputed,
                        kv_bytes,
                        ..
                    } => {
                        started = true;
                        counted.end();
                        if recomputed {
                            self.stats.recomputed.fetch_add(1, Ordering::SeqCst);
                        }
                        self.stats
                            .kv_bytes
                            .fetch_add(kv_bytes as u64, Ordering::SeqCst);
                        if let Some(t) = first.take() {
                            sent.push(t.id);
                            let _ = self.events.send(EngineEvent::Token(t.into()));
                        }
                    }
                    WireEvent::Token(t) => {
                        sent.push(t.id);
                        let _ = self.events.send(EngineEvent::Token(t.into()));
                    }
                    WireEvent::Done {
                        finish,
                        prompt_tokens,
                        completion_tokens,
                    } => {
                        self.last(EngineEvent::Done {
                            finish: finish_from(&finish),
                            prompt_tokens,
                            completion_tokens,
                        });
                        return Ok(());
                    }
                    WireEvent::Error(e) => {
                        self.error(e.into());
                        return Ok(());
                    }
                }
            }
        }
    }
}
