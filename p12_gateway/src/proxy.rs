//! Forwarding one admitted request: pick a backend, send, and retry on a
//! connect error, a timeout, 429 or 5xx, with jittered exponential backoff,
//! but only while nothing has been sent to the client. A non-streaming
//! answer is read whole before it is answered, so a backend that dies
//! mid-answer is retried invisibly; a stream is committed at its first
//! event, and a failure after that ends it with an error event (never a
//! replay: the client has already shown those tokens).
//!
//! The reservation is settled when the answer ends: at the backend's
//! `usage` (asked for on every stream, and dropped from the client's stream
//! when the client did not ask), else at the prompt plus the chunks
//! delivered.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use p06_server::error::ApiError;
use tokio::sync::mpsc;

use crate::count::Endpoint;
use crate::limits::Reservation;
use crate::routing::{Backend, Pool};
use crate::sse::{self, Event};
use crate::state::Gateway;

/// One request on its way to a backend.
#[derive(Debug)]
pub struct Outbound {
    pub key: String,
    pub model: String,
    pub endpoint: Endpoint,
    /// The body to send (the client's, plus `include_usage` on a stream).
    pub body: Bytes,
    pub stream: bool,
    /// Whether the client asked for the usage chunk itself.
    pub client_wants_usage: bool,
    pub prompt_tokens: u64,
    /// The first prompt's token ids (prefix affinity).
    pub ids: Vec<u32>,
    pub arrived: Instant,
}

/// Counts a backend's request in flight until dropped.
struct InFlight(Arc<Backend>);

impl InFlight {
    fn new(b: &Arc<Backend>) -> InFlight {
        b.outstanding.fetch_add(1, Ordering::Relaxed);
        InFlight(b.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A failed attempt: why, and the backend's answer when it gave one (the
/// last is passed on if no attempt succeeds).
enum Failed {
    Connect(String),
    Timeout(&'static str),
    Status(StatusCode, Bytes, Option<HeaderValue>),
}

impl Failed {
    fn reason(&self) -> &'static str {
        match self {
            Failed::Connect(_) => "connect",
            Failed::Timeout(_) => "timeout",
            Failed::Status(s, ..) if *s == StatusCode::TOO_MANY_REQUESTS => "429",
            Failed::Status(..) => "5xx",
        }
    }
}

/// Full jitter: uniform in [0, min(max, base * 2^(attempt-1))].
fn backoff(g: &Gateway, attempt: u32) -> Duration {
    let r = &g.cfg.retry;
    let cap = r
        .base_ms
        .saturating_mul(1u64 << (attempt.saturating_sub(1)).min(20))
        .min(r.max_ms);
    Duration::from_millis((g.random() * cap as f64) as u64)
}

fn passthrough(status: StatusCode, body: Bytes, content_type: Option<HeaderValue>) -> Response {
    let mut resp = (status, body).into_response();
    if let Some(ct) = content_type {
        resp.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    resp
}

/// Send `out` through `pool`, retrying before the first byte; answer the client.
pub async fn forward(
    g: Arc<Gateway>,
    pool: &Pool,
    out: Outbound,
    reservation: Reservation,
) -> Response {
    let t = g.cfg.timeouts;
    let deadline = out.arrived + Duration::from_millis(t.total_ms);
    let first_byte = Duration::from_millis(t.first_byte_ms);
    let order = pool.order(&out.ids);
    let status_of = |resp: &Response| resp.status().as_u16();
    if order.is_empty() {
        let e = ApiError::unavailable(format!("no healthy backend serves `{}`", out.model));
        g.metrics
            .request(&out.key, &out.model, "", e.status.as_u16());
        return e.into_response();
    }
    g.metrics.added(out.arrived.elapsed());
    let mut last: Option<Failed> = None;
    let mut next = 0usize;
    for attempt in 0..g.cfg.retry.max_attempts {
        if attempt > 0 {
            let wait = backoff(&g, attempt);
            if Instant::now() + wait >= deadline {
                break;
            }
            tokio::time::sleep(wait).await;
        }
        // The next backend in the policy's order whose breaker lets it through.
        let now = g.clock.now();
        let Some(b) = (0..order.len())
            .map(|k| &pool.backends[order[(next + k) % order.len()]])
            .position(|b| b.breaker().allow(now))
            .map(|k| {
                let i = (next + k) % order.len();
                next = i + 1;
                pool.backends[order[i]].clone()
            })
        else {
            break;
        };
        let flight = InFlight::new(&b);
        let url = format!("{}{}", b.url, out.endpoint.path());
        let send = g
            .http
            .post(&url)
            .header(header::CONTENT_TYPE, "application/json")
            .body(out.body.clone())
            .send();
        let remaining = deadline.saturating_duration_since(Instant::now());
        let failed = match tokio::time::timeout(first_byte.min(remaining), send).await {
            Err(_) => Failed::Timeout("no response headers in time"),
            Ok(Err(e)) => Failed::Connect(e.to_string()),
            Ok(Ok(resp)) => {
                let status = resp.status();
                let ct = resp.headers().get(header::CONTENT_TYPE).cloned();
                if status.is_success() && out.stream {
                    match first_event(resp, first_byte.min(remaining)).await {
                        Ok((events, rest)) => {
                            b.breaker().success();
                            let resp = stream(
                                g.clone(),
                                &out,
                                b.clone(),
                                flight,
                                events,
                                rest,
                                reservation,
                                ct,
                            );
                            g.metrics.request(&out.key, &out.model, &b.url, 200);
                            return resp;
                        }
                        Err(f) => f,
                    }
                } else {
                    let body = tokio::time::timeout(remaining, resp.bytes()).await;
                    match body {
                        Err(_) => Failed::Timeout("the answer did not finish in time"),
                        Ok(Err(e)) => Failed::Connect(e.to_string()),
                        Ok(Ok(body))
                            if status == StatusCode::TOO_MANY_REQUESTS
                                || status.is_server_error() =>
                        {
                            Failed::Status(status, body, ct)
                        }
                        Ok(Ok(body)) => {
                            // 2xx or a 4xx the backend chose: the backend works.
                            b.breaker().success();
                            let used = serde_json::from_slice(&body)
                                .ok()
                                .and_then(|v| sse::usage(&v))
                                .map_or(
                                    if status.is_success() {
                                        reservation.reserved()
                                    } else {
                                        0
                                    },
                                    |(p, c)| p + c,
                                );
                            g.metrics.tokens(&out.key, used);
                            reservation.settle(used);
                            let resp = passthrough(status, body, ct);
                            g.metrics
                                .request(&out.key, &out.model, &b.url, status_of(&resp));
                            return resp;
                        }
                    }
                }
            }
        };
        drop(flight);
        {
            let mut br = b.breaker();
            match &failed {
                // The backend shed load: not broken, just busy.
                Failed::Status(s, ..) if *s == StatusCode::TOO_MANY_REQUESTS => br.release(),
                _ => br.failure(g.clock.now()),
            }
        }
        g.metrics.retry(&out.model, &b.url, failed.reason());
        last = Some(failed);
    }
    // Nothing was sent, so nothing was generated for the client.
    reservation.settle(0);
    let resp = match last {
        Some(Failed::Status(s, body, ct)) => passthrough(s, body, ct),
        Some(Failed::Connect(e)) => ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            format!("no backend of `{}` answered: {e}", out.model),
        )
        .into_response(),
        Some(Failed::Timeout(what)) => ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_error",
            format!("no backend of `{}` answered: {what}", out.model),
        )
        .into_response(),
        None => ApiError::unavailable(format!(
            "every backend of `{}` is failing (circuit open)",
            out.model
        ))
        .into_response(),
    };
    g.metrics
        .request(&out.key, &out.model, "", status_of(&resp));
    resp
}

type ByteStream =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// Read until the stream's first whole event (the commit point).
async fn first_event(
    resp: reqwest::Response,
    within: Duration,
) -> Result<(Vec<Vec<u8>>, (ByteStream, sse::EventSplitter)), Failed> {
    let mut body: ByteStream = Box::pin(resp.bytes_stream());
    let mut split = sse::EventSplitter::default();
    let read = async {
        loop {
            match body.next().await {
                Some(Ok(bytes)) => {
                    let events = split.push(&bytes);
                    if !events.is_empty() {
                        return Ok(events);
                    }
                }
                Some(Err(e)) => return Err(Failed::Connect(e.to_string())),
                None => {
                    return Err(Failed::Connect(
                        "the stream ended before its first event".into(),
                    ))
                }
            }
        }
    };
    match tokio::time::timeout(within, read).await {
        Err(_) => Err(Failed::Timeout("no first event in time")),
        Ok(Err(f)) => Err(f),
        Ok(Ok(events)) => Ok((events, (body, split))),
    }
}

/// Relay a committed stream event by event; settle when it ends.
#[allow(clippy::too_many_arguments)]
fn stream(
    g: Arc<Gateway>,
    out: &Outbound,
    backend: Arc<Backend>,
    flight: InFlight,
    first: Vec<Vec<u8>>,
    (mut body, mut split): (ByteStream, sse::EventSplitter),
    reservation: Reservation,
    content_type: Option<HeaderValue>,
) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let deadline = out.arrived + Duration::from_millis(g.cfg.timeouts.total_ms);
    let (key, keep_usage, prompt_tokens) =
        (out.key.clone(), out.client_wants_usage, out.prompt_tokens);
    let model = out.model.clone();
    tokio::spawn(async move {
        let _flight = flight;
        let mut usage: Option<u64> = None;
        let mut chunks = 0u64;
        let mut done = false;
        let mut pending: std::collections::VecDeque<Vec<u8>> = first.into();
        let mut failure: Option<String> = None;
        'relay: loop {
            // Forward what has arrived, at the client's pace.
            while let Some(ev) = pending.pop_front() {
                let mut fwd = true;
                match sse::classify(&ev) {
                    Event::Chunk => chunks += 1,
                    Event::Usage(p, c) => {
                        usage = Some(p + c);
                        fwd = keep_usage;
                    }
                    Event::Done | Event::Error => done = true,
                    Event::Other => {}
                }
                if fwd && tx.send(Bytes::from(ev)).await.is_err() {
                    break 'relay; // the client has gone: drop the backend's stream
                }
            }
            if done {
                break;
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(remaining, body.next()).await {
                Err(_) => {
                    failure = Some("the stream ran past the gateway's total timeout".into());
                    break;
                }
                Ok(None) => {
                    failure = Some("the backend's stream ended before [DONE]".into());
                    break;
                }
                Ok(Some(Err(e))) => {
                    failure = Some(format!("the backend's stream failed: {e}"));
                    break;
                }
                Ok(Some(Ok(bytes))) => pending.extend(split.push(&bytes)),
            }
        }
        if let Some(msg) = &failure {
            backend.breaker().failure(g.clock.now());
            g.metrics.stream_error(&model, &backend.url);
            let _ = tx.send(Bytes::from(sse::error_event(msg))).await;
        }
        let used = usage.unwrap_or(prompt_tokens + chunks);
        g.metrics.tokens(&key, used);
        reservation.settle(used);
    });
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<Bytes, Infallible>(b), rx))
    }));
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        content_type.unwrap_or(HeaderValue::from_static("text/event-stream")),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}
