//! The HTTP layer: routes, and one handler that turns a request into an
//! engine submission and the engine's events into a JSON response or a
//! stream of server-sent events. It holds no model state: everything
//! behind [`Engine`] can be swapped (serial, batching, remote).

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use common::engine::{Engine, EngineError, EngineEvent, EngineStream, Finish, TokenOut};
use common::openai::{ModelCard, ModelList, Usage};
use futures_util::stream::{select_all, BoxStream, SelectAll};
use futures_util::StreamExt;
use serde_json::Value;

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::request::{self, Endpoint, Parsed};
use crate::response::Builder;

/// Everything the handlers share.
#[derive(Clone, Debug)]
pub struct AppState {
    pub engine: Arc<dyn Engine>,
    pub metrics: Arc<Metrics>,
    /// False until the model is loaded (`/health` answers 503).
    pub ready: Arc<AtomicBool>,
    /// Set at shutdown: new requests get 503 while in-flight ones finish.
    pub draining: Arc<AtomicBool>,
    pub max_body_bytes: usize,
}

impl AppState {
    pub fn new(engine: Arc<dyn Engine>, max_body_bytes: usize) -> AppState {
        let metrics = Arc::new(Metrics::new(engine.model_name()));
        AppState {
            engine,
            metrics,
            ready: Arc::new(AtomicBool::new(true)),
            draining: Arc::new(AtomicBool::new(false)),
            max_body_bytes,
        }
    }
}

/// The whole API, without a socket (tests can call it directly).
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|uri: Uri| async move { ApiError::not_found(uri.path()) })
        .with_state(state)
}

async fn health(State(st): State<AppState>) -> Response {
    if !st.ready.load(Ordering::SeqCst) {
        return ApiError::unavailable("the model is loading").into_response();
    }
    if st.draining.load(Ordering::SeqCst) {
        return ApiError::unavailable("the server is shutting down").into_response();
    }
    (StatusCode::OK, "ok").into_response()
}

async fn metrics(State(st): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        {
            let mut text = st.metrics.render(st.engine.load());
            st.engine.extra_metrics(&mut text);
            text
        },
    )
        .into_response()
}

async fn models(State(st): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list".into(),
        data: vec![ModelCard {
            id: st.engine.model_name().to_string(),
            object: "model".into(),
            created: common::openai::unix_now(),
            owned_by: "inference-lab".into(),
            max_model_len: st.engine.context_length(),
        }],
    })
}

async fn completions(State(st): State<AppState>, body: Body) -> Response {
    handle(st, Endpoint::Completions, body).await
}

async fn chat_completions(State(st): State<AppState>, body: Body) -> Response {
    handle(st, Endpoint::Chat, body).await
}

/// Read (with the size limit), parse, submit, answer.
async fn handle(st: AppState, endpoint: Endpoint, body: Body) -> Response {
    match serve_request(st, endpoint, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// Requests being tokenized at once: one per core.
fn preparing() -> &'static tokio::sync::Semaphore {
    static PREPARING: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    PREPARING.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        tokio::sync::Semaphore::new(cores)
    })
}

async fn serve_request(st: AppState, endpoint: Endpoint, body: Body) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let bytes = axum::body::to_bytes(body, st.max_body_bytes)
        .await
        .map_err(|_| ApiError::too_large(st.max_body_bytes))?;
    if !st.ready.load(Ordering::SeqCst) {
        return Err(ApiError::unavailable("the model is loading"));
    }
    if st.draining.load(Ordering::SeqCst) {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    let served = st.engine.model_name().to_string();
    let Parsed {
        engine: request,
        stream,
        include_usage,
        ..
    } = match endpoint {
        Endpoint::Completions => request::completion(&bytes, &served)?,
        Endpoint::Chat => request::chat(&bytes, &served)?,
    };
    let builder = Builder {
        endpoint,
        id: request.id.clone(),
        created: common::openai::unix_now(),
        model: served,
        logprobs: request.logprobs.is_some(),
    };
    // Template rendering and tokenization are CPU work (up to tenths of a
    // second for a prompt near the context's byte cap): off the async
    // workers, so one large prompt does not stall other connections, and
    // at most one per core at a time, so a burst of them cannot take
    // every core from the model.
    let permit = preparing()
        .acquire()
        .await
        .map_err(|_| ApiError::unavailable("the server is shutting down"))?;
    let engine = st.engine.clone();
    let mut choices = tokio::task::spawn_blocking(move || engine.submit_choices(request))
        .await
        .map_err(|e| ApiError::internal(format!("request preparation failed: {e}")))??;
    drop(permit);
    let mut tracker = Tracker::new(st.metrics.clone(), arrival);
    let Some(events) = choices.first_mut() else {
        return Err(ApiError::unavailable("the engine returned no choices"));
    };
    // Wait for the first event (of choice 0), so that a refusal becomes a
    // status code rather than an error inside a 200 stream.
    let first = match events.recv().await {
        Some(EngineEvent::Error(e)) => {
            tracker.done = true;
            return Err(e.into());
        }
        Some(ev) => ev,
        None => return Err(ApiError::unavailable("the engine stopped")),
    };
    if stream {
        Ok(stream_response(
            include_usage,
            builder,
            tracker,
            first,
            choices,
        ))
    } else {
        collect_response(builder, tracker, first, choices).await
    }
}

/// Records a request's latencies as its events pass; if it is dropped before
/// the end (the client left) it records the request as aborted.
#[derive(Debug)]
struct Tracker {
    metrics: Arc<Metrics>,
    arrival: Instant,
    last_token: Option<Instant>,
    generated: usize,
    done: bool,
}

impl Tracker {
    fn new(metrics: Arc<Metrics>, arrival: Instant) -> Tracker {
        Tracker {
            metrics,
            arrival,
            last_token: None,
            generated: 0,
            done: false,
        }
    }

    /// A token of choice `index`: latencies are those of choice 0 (the
    /// others' tokens come in the same steps).
    fn token(&mut self, index: usize) {
        self.generated += 1;
        if index != 0 {
            return;
        }
        let now = Instant::now();
        match self.last_token {
            None => self.metrics.first_token((now - self.arrival).as_secs_f64()),
            Some(t) => self.metrics.inter_token((now - t).as_secs_f64()),
        }
        self.last_token = Some(now);
    }

    fn finish(&mut self, finish: Finish, prompt_tokens: usize, generated: usize) {
        self.done = true;
        let e2e = self.arrival.elapsed().as_secs_f64();
        self.metrics.finished(finish, prompt_tokens, generated, e2e);
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        if !self.done {
            self.finish(Finish::Abort, 0, self.generated);
        }
    }
}

/// Read every choice to its end (choice 0's first event is `first`).
async fn collect_response(
    builder: Builder,
    mut tracker: Tracker,
    first: EngineEvent,
    streams: Vec<EngineStream>,
) -> Result<Response, ApiError> {
    let mut choices: Vec<(Vec<TokenOut>, Finish)> = Vec::with_capacity(streams.len());
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    let mut first = Some(first);
    for (i, mut events) in streams.into_iter().enumerate() {
        let mut tokens = Vec::new();
        loop {
            let ev = match first.take() {
                Some(ev) => ev,
                None => events
                    .recv()
                    .await
                    .ok_or_else(|| ApiError::unavailable("the engine stopped mid-request"))?,
            };
            match ev {
                EngineEvent::Token(t) => {
                    tracker.token(i);
                    tokens.push(t);
                }
                EngineEvent::Done {
                    finish,
                    prompt_tokens: p,
                    completion_tokens: c,
                } => {
                    prompt_tokens = p;
                    completion_tokens += c;
                    choices.push((tokens, finish));
                    break;
                }
                EngineEvent::Error(e) => {
                    tracker.finish(Finish::Abort, 0, tracker.generated);
                    return Err(e.into());
                }
            }
        }
    }
    let finish = choices.first().map_or(Finish::Abort, |c| c.1);
    tracker.finish(finish, prompt_tokens, completion_tokens);
    let usage = Usage::new(prompt_tokens, completion_tokens);
    Ok(Json(builder.full(&choices, usage)).into_response())
}

type Merged = SelectAll<BoxStream<'static, (usize, EngineEvent)>>;

/// Every choice's events as they come, tagged with the choice's index
/// (choice 0 starts with `first`, already received); a stream that ends
/// without its `Done` yields an error event.
fn merge(first: EngineEvent, streams: Vec<EngineStream>) -> Merged {
    let mut first = Some(first);
    select_all(streams.into_iter().enumerate().map(|(i, rx)| {
        let start = (first.take(), Some(rx));
        futures_util::stream::unfold(start, move |(pending, rx)| async move {
            let mut rx = rx?;
            let ev = match pending {
                Some(ev) => ev,
                None => rx.recv().await.unwrap_or_else(|| {
                    EngineEvent::Error(EngineError::Internal(
                        "the engine stopped mid-request".into(),
                    ))
                }),
            };
            let last = !matches!(ev, EngineEvent::Token(_));
            Some(((i, ev), (None, (!last).then_some(rx))))
        })
        .boxed()
    }))
}

/// What the SSE stream still has to send.
struct StreamState {
    builder: Builder,
    tracker: Tracker,
    events: Merged,
    include_usage: bool,
    /// Frames ready to go, in order.
    queue: std::collections::VecDeque<Event>,
    /// Per choice: byte offset of the next text.
    offsets: Vec<usize>,
    /// Choices not yet done.
    open: usize,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Choice 0's finish reason (the request's, in the metrics).
    finish: Option<Finish>,
    finished: bool,
}

fn data(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

impl StreamState {
    /// Turn one event of choice `i` into frames.
    fn push(&mut self, i: usize, ev: EngineEvent) {
        match ev {
            EngineEvent::Token(t) => {
                self.tracker.token(i);
                let offset = self.offsets.get(i).copied().unwrap_or(0);
                if !t.text.is_empty() || t.logprob.is_some() {
                    let v = self.builder.token_chunk(i, &t, offset);
                    self.queue.push_back(data(&v));
                }
                if let Some(o) = self.offsets.get_mut(i) {
                    *o += t.text.len();
                }
            }
            EngineEvent::Done {
                finish,
                prompt_tokens,
                completion_tokens,
            } => {
                self.queue
                    .push_back(data(&self.builder.finish_chunk(i, finish)));
                self.prompt_tokens = prompt_tokens;
                self.completion_tokens += completion_tokens;
                if i == 0 {
                    self.finish = Some(finish);
                }
                self.open = self.open.saturating_sub(1);
                if self.open > 0 {
                    return;
                }
                let (p, c) = (self.prompt_tokens, self.completion_tokens);
                self.tracker.finish(self.finish.unwrap_or(finish), p, c);
                if self.include_usage {
                    let u = Usage::new(p, c);
                    self.queue.push_back(data(&self.builder.usage_chunk(u)));
                }
                self.queue.push_back(Event::default().data("[DONE]"));
                self.finished = true;
            }
            EngineEvent::Error(e) => {
                self.tracker
                    .finish(Finish::Abort, 0, self.tracker.generated);
                let body = serde_json::to_value(ApiError::from(e).body()).unwrap_or(Value::Null);
                self.queue.push_back(data(&body));
                self.queue.push_back(Event::default().data("[DONE]"));
                self.finished = true;
            }
        }
    }
}

fn stream_response(
    include_usage: bool,
    builder: Builder,
    tracker: Tracker,
    first: EngineEvent,
    streams: Vec<EngineStream>,
) -> Response {
    let n = streams.len();
    let mut state = StreamState {
        builder,
        tracker,
        events: merge(first, streams),
        include_usage,
        queue: Default::default(),
        offsets: vec![0; n],
        open: n,
        prompt_tokens: 0,
        completion_tokens: 0,
        finish: None,
        finished: false,
    };
    for i in 0..n {
        if let Some(role) = state.builder.role_chunk(i) {
            state.queue.push_back(data(&role));
        }
    }
    // When the client disconnects, hyper drops this stream, and with it the
    // engine's receivers: the engine sees that before its next step.
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(ev) = s.queue.pop_front() {
                return Some((Ok::<Event, Infallible>(ev), s));
            }
            if s.finished {
                return None;
            }
            match s.events.next().await {
                Some((i, ev)) => s.push(i, ev),
                None => s.push(
                    0,
                    EngineEvent::Error(EngineError::Internal(
                        "the engine stopped mid-request".into(),
                    )),
                ),
            }
        }
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}
