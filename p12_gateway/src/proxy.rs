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
use std::sync::atomic::{AtomicUsize, Ordering};
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

/// One attempt's hold on a backend: counts it in flight, and owns the
/// breaker verdict. Dropped without one (the client went away while the
/// attempt waited, or a stream's relay ended early), it releases a
/// half-open probe slot instead of leaking it, which would keep the
/// backend out of rotation for good.
struct Attempt {
    backend: Arc<Backend>,
    judged: bool,
}

impl Attempt {
    fn new(b: &Arc<Backend>) -> Attempt {
        b.outstanding.fetch_add(1, Ordering::Relaxed);
        Attempt {
            backend: b.clone(),
            judged: false,
        }
    }

    fn success(mut self) {
        self.judged = true;
        self.backend.breaker().success();
    }

    fn failure(mut self, now: Duration) {
        self.judged = true;
        self.backend.breaker().failure(now);
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        if !self.judged {
            self.backend.breaker().release();
        }
        self.backend.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A failed attempt: why, and the backend's answer when it gave one (the
/// last is passed on if no attempt succeeds).
enum Failed {
    Connect(String),
    Timeout(&'static str),
    Status(StatusCode, Bytes, HeaderPair),
}

/// The headers passed on with a backend's answer.
type HeaderPair = (Option<HeaderValue>, Option<HeaderValue>);

impl Failed {
    fn reason(&self) -> &'static str {
        match self {
            Failed::Connect(_) => "connect",
            Failed::Timeout(_) => "timeout",
            Failed::Status(s, ..) if *s == StatusCode::TOO_MANY_REQUESTS => "429",
            Failed::Status(s, ..) if *s == StatusCode::NOT_FOUND => "404",
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

/// A backend's answer as it was, with its content type and Retry-After.
fn passthrough(status: StatusCode, body: Bytes, (ct, retry): HeaderPair) -> Response {
    let mut resp = (status, body).into_response();
    if let Some(ct) = ct {
        resp.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    if let Some(r) = retry {
        resp.headers_mut().insert(header::RETRY_AFTER, r);
    }
    resp
}

/// With no backend in rotation: hold the request until one appears, for
/// at most the activator's hold (and the request's deadline), as
/// Knative's activator holds requests while a service scales from zero.
/// The backends then, or none.
async fn hold(g: &Gateway, pool: &Pool, out: &Outbound, deadline: Instant) -> Vec<Arc<Backend>> {
    let hold = Duration::from_millis(g.cfg.activator.hold_ms);
    if hold.is_zero() {
        return Vec::new();
    }
    let until = (out.arrived + hold).min(deadline);
    // Counted while held, also when the client goes away mid-wait (the
    // future is dropped): a leaked count would look like load forever.
    struct Held<'a>(&'a AtomicUsize);
    impl Drop for Held<'_> {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::Relaxed);
        }
    }
    pool.held.fetch_add(1, Ordering::Relaxed);
    let _held = Held(&pool.held);
    loop {
        let o = pool.order(&out.ids);
        if !o.is_empty() || Instant::now() >= until {
            return o;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
    let order = match pool.order(&out.ids) {
        o if o.is_empty() => hold(&g, pool, &out, deadline).await,
        o => o,
    };
    let status_of = |resp: &Response| resp.status().as_u16();
    if order.is_empty() {
        let e = ApiError::unavailable(format!("no healthy backend serves `{}`", out.model));
        g.metrics
            .request(&out.key, &out.model, "", e.status.as_u16());
        reservation.settle(0); // nothing was sent
        let mut resp = e.into_response();
        if g.cfg.activator.hold_ms > 0 {
            let after = HeaderValue::from(g.cfg.activator.retry_after_s);
            resp.headers_mut().insert(header::RETRY_AFTER, after);
        }
        return resp;
    }
    g.metrics.added(out.arrived.elapsed());
    let mut last: Option<Failed> = None;
    let mut timed_out = false;
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
            .map(|k| &order[(next + k) % order.len()])
            .position(|b| b.breaker().allow(now))
            .map(|k| {
                let i = (next + k) % order.len();
                next = i + 1;
                order[i].clone()
            })
        else {
            break;
        };
        let attempt_guard = Attempt::new(&b);
        let url = format!("{}{}", b.url, out.endpoint.path());
        let send = g
            .http
            .post(&url)
            .header(header::CONTENT_TYPE, "application/json")
            .body(out.body.clone())
            .send();
        // A stream's headers come at once; a non-streaming answer's only
        // when the whole generation is done, so it has the total deadline.
        let left = || deadline.saturating_duration_since(Instant::now());
        let wait = if out.stream {
            first_byte.min(left())
        } else {
            left()
        };
        let failed = match tokio::time::timeout(wait, send).await {
            Err(_) => Failed::Timeout("no response headers in time"),
            Ok(Err(e)) => Failed::Connect(e.to_string()),
            Ok(Ok(resp)) => {
                let status = resp.status();
                let headers = (
                    resp.headers().get(header::CONTENT_TYPE).cloned(),
                    resp.headers().get(header::RETRY_AFTER).cloned(),
                );
                if status.is_success() && out.stream {
                    match first_event(resp, first_byte.min(left())).await {
                        Ok((events, rest)) => {
                            let resp = stream(
                                g.clone(),
                                &out,
                                attempt_guard,
                                events,
                                rest,
                                reservation,
                                headers.0,
                            );
                            g.metrics.request(&out.key, &out.model, &b.url, 200);
                            return resp;
                        }
                        Err(f) => f,
                    }
                } else {
                    match tokio::time::timeout(left(), resp.bytes()).await {
                        Err(_) => Failed::Timeout("the answer did not finish in time"),
                        Ok(Err(e)) => Failed::Connect(e.to_string()),
                        // Busy, broken, or not serving this model: try another.
                        Ok(Ok(body))
                            if status == StatusCode::TOO_MANY_REQUESTS
                                || status == StatusCode::NOT_FOUND
                                || status.is_server_error() =>
                        {
                            Failed::Status(status, body, headers)
                        }
                        Ok(Ok(body)) => {
                            let used = if status.is_success() {
                                // The backend works; charge what it reports.
                                attempt_guard.success();
                                serde_json::from_slice(&body)
                                    .ok()
                                    .and_then(|v| sse::usage(&v))
                                    .map_or(reservation.reserved(), |(p, c)| p.saturating_add(c))
                            } else {
                                // A 4xx about the request: no verdict on the backend.
                                drop(attempt_guard);
                                0
                            };
                            g.metrics.tokens(&out.key, used);
                            reservation.settle(used);
                            let resp = passthrough(status, body, headers);
                            g.metrics
                                .request(&out.key, &out.model, &b.url, status_of(&resp));
                            return resp;
                        }
                    }
                }
            }
        };
        match &failed {
            // The backend shed load: not broken, just busy.
            Failed::Status(s, ..) if *s == StatusCode::TOO_MANY_REQUESTS => drop(attempt_guard),
            Failed::Timeout(_) => {
                // The backend may have done the work: charge it in the end.
                timed_out = true;
                attempt_guard.failure(g.clock.now());
            }
            _ => attempt_guard.failure(g.clock.now()),
        }
        g.metrics.retry(&out.model, &b.url, failed.reason());
        last = Some(failed);
    }
    // Nothing reached the client. Connect errors and refusals cost
    // nothing; an attempt that timed out may have generated its answer.
    if timed_out {
        let all = reservation.reserved();
        g.metrics.tokens(&out.key, all);
        reservation.settle(all);
    } else {
        reservation.settle(0);
    }
    let resp = match last {
        Some(Failed::Status(s, body, headers)) => passthrough(s, body, headers),
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

/// Read until the stream's first `data:` event, the commit point: comments
/// and keep-alives before it are held back (nothing is sent yet, so a
/// failure is still retried), and an error event as the first is a failed
/// attempt, not a stream.
async fn first_event(
    resp: reqwest::Response,
    within: Duration,
) -> Result<(Vec<Vec<u8>>, (ByteStream, sse::EventSplitter)), Failed> {
    let mut body: ByteStream = Box::pin(resp.bytes_stream());
    let mut split = sse::EventSplitter::default();
    let read = async {
        let mut held = Vec::new();
        loop {
            match body.next().await {
                Some(Ok(bytes)) => {
                    let events = split
                        .push(&bytes)
                        .map_err(|e| Failed::Connect(e.to_string()))?;
                    for ev in events {
                        match sse::classify(&ev) {
                            sse::Event::Other => held.push(ev),
                            sse::Event::Error => {
                                return Err(Failed::Status(
                                    StatusCode::BAD_GATEWAY,
                                    Bytes::from(sse::data(&ev).unwrap_or_default()),
                                    (Some(HeaderValue::from_static("application/json")), None),
                                ))
                            }
                            _ => {
                                held.push(ev);
                                return Ok(held);
                            }
                        }
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

/// Relay a committed stream event by event; settle when it ends. The
/// breaker's verdict waits for the end: a backend that always dies
/// mid-stream must open it.
fn stream(
    g: Arc<Gateway>,
    out: &Outbound,
    attempt: Attempt,
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
        let url = attempt.backend.url.clone();
        let mut usage: Option<u64> = None;
        let mut chunks = 0u64;
        let (mut done, mut backend_error, mut client_gone) = (false, false, false);
        let mut pending: std::collections::VecDeque<Vec<u8>> = first.into();
        let mut failure: Option<String> = None;
        'relay: loop {
            // Forward what has arrived, at the client's pace (but never
            // past the deadline: a client that stops reading lets go).
            while let Some(ev) = pending.pop_front() {
                let mut fwd = true;
                match sse::classify(&ev) {
                    Event::Chunk => chunks += 1,
                    Event::Usage(p, c) => {
                        usage = Some(p.saturating_add(c));
                        fwd = keep_usage;
                    }
                    Event::Done => done = true,
                    Event::Error => backend_error = true,
                    Event::Other => {}
                }
                if fwd {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match tokio::time::timeout(left, tx.send(Bytes::from(ev))).await {
                        Ok(Ok(())) => {}
                        Ok(Err(_)) => {
                            client_gone = true; // drop the backend's stream
                            break 'relay;
                        }
                        Err(_) => {
                            failure =
                                Some("the client read too slowly for the total timeout".into());
                            client_gone = true;
                            break 'relay;
                        }
                    }
                }
            }
            if done {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, body.next()).await {
                Err(_) => {
                    failure = Some("the stream ran past the gateway's total timeout".into());
                    break;
                }
                // After its own error event a backend may just close.
                Ok(None) if backend_error => break,
                Ok(None) => {
                    failure = Some("the backend's stream ended before [DONE]".into());
                    break;
                }
                Ok(Some(Err(e))) => {
                    failure = Some(format!("the backend's stream failed: {e}"));
                    break;
                }
                Ok(Some(Ok(bytes))) => match split.push(&bytes) {
                    Ok(events) => pending.extend(events),
                    Err(e) => {
                        failure = Some(e.to_string());
                        break;
                    }
                },
            }
        }
        let timed_out_on_client = client_gone && failure.is_some();
        if backend_error || (failure.is_some() && !timed_out_on_client) {
            attempt.failure(g.clock.now());
            g.metrics.stream_error(&model, &url);
        } else if done {
            attempt.success();
        } else {
            drop(attempt); // the client left: no verdict on the backend
        }
        if let (Some(msg), false) = (&failure, client_gone) {
            let _ = tx.send(Bytes::from(sse::error_event(msg))).await;
        }
        let used = usage.unwrap_or(prompt_tokens.saturating_add(chunks));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::{BreakerConfig, BreakerState};

    #[test]
    fn an_attempt_dropped_without_a_verdict_frees_the_probe_slot() {
        let b = Arc::new(Backend::new(
            "http://x",
            BreakerConfig {
                failures_to_open: 1,
                cooldown: Duration::from_secs(1),
                successes_to_close: 1,
            },
        ));
        b.breaker().failure(Duration::ZERO);
        let later = Duration::from_secs(2);
        assert!(b.breaker().allow(later), "half-open: the probe");
        let probe = Attempt::new(&b);
        assert_eq!(b.outstanding.load(Ordering::Relaxed), 1);
        assert!(!b.breaker().allow(later), "one probe at a time");
        drop(probe); // its client went away mid-wait
        assert_eq!(b.outstanding.load(Ordering::Relaxed), 0);
        assert!(b.breaker().allow(later), "the slot is free again");
        Attempt::new(&b).success();
        assert_eq!(b.breaker().state(), BreakerState::Closed);
    }
}
