//! Forwarding one admitted request: pick a backend, send, and retry on a
//! connect error, a timeout, 429 or 5xx, with jittered exponential backoff,
//! but only while nothing has been sent to the client. A non-streaming
//! answer is read whole before it is answered, so a backend that dies
//! mid-answer is retried invisibly; a stream is committed at its first
//! event, and relayed from then on by [`crate::relay`] (which continues it
//! elsewhere if its backend dies, where it can).
//!
//! Each retry reads the pool's order afresh (a platform may have withdrawn
//! a dead server and published its replacement meanwhile) and tries a
//! backend this request has not tried first. A backend that refuses the
//! connection leaves rotation at once; with none left, the request is held
//! as the activator holds one at zero.
//!
//! The reservation is settled when the answer ends: at the backend's
//! `usage` (asked for on every stream, and dropped from the client's stream
//! when the client did not ask), else at the prompt plus the chunks
//! delivered.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use p06_server::error::ApiError;

use crate::count::Endpoint;
use crate::limits::Reservation;
use crate::relay::{first_event, relay};
use crate::routing::{Backend, Pool};
use crate::sse;
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
pub(crate) struct Attempt {
    backend: Arc<Backend>,
    judged: bool,
}

impl Attempt {
    pub(crate) fn backend(&self) -> &Arc<Backend> {
        &self.backend
    }

    pub(crate) fn new(b: &Arc<Backend>) -> Attempt {
        b.outstanding.fetch_add(1, Ordering::Relaxed);
        Attempt {
            backend: b.clone(),
            judged: false,
        }
    }

    pub(crate) fn success(mut self) {
        self.judged = true;
        self.backend.breaker().success();
    }

    pub(crate) fn failure(mut self, now: Duration) {
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
pub(crate) enum Failed {
    Connect(String),
    Timeout(&'static str),
    Status(StatusCode, Bytes, HeaderPair),
}

/// The headers passed on with a backend's answer.
pub(crate) type HeaderPair = (Option<HeaderValue>, Option<HeaderValue>);

impl Failed {
    /// What went wrong, in words.
    pub(crate) fn describe(&self) -> String {
        match self {
            Failed::Connect(e) => e.clone(),
            Failed::Timeout(what) => what.to_string(),
            Failed::Status(s, body, _) => {
                format!(
                    "{s} {}",
                    String::from_utf8_lossy(&body[..body.len().min(200)])
                )
            }
        }
    }

    pub(crate) fn reason(&self) -> &'static str {
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
pub(crate) fn backoff(g: &Gateway, attempt: u32) -> Duration {
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

/// The pool's order for a prompt of `ids`; with no backend in rotation,
/// the request is held until one appears, for at most the activator's hold
/// (and the request's deadline), as Knative's activator holds requests
/// while a service scales from zero. The backends then, or none.
pub(crate) async fn order_or_hold(
    g: &Gateway,
    pool: &Pool,
    ids: &[u32],
    arrived: Instant,
    deadline: Instant,
) -> Vec<Arc<Backend>> {
    let order = pool.order(ids);
    let hold = Duration::from_millis(g.cfg.activator.hold_ms);
    if !order.is_empty() || hold.is_zero() {
        return order;
    }
    let until = (arrived + hold).min(deadline);
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
        let o = pool.order(ids);
        if !o.is_empty() || Instant::now() >= until {
            return o;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The backend for the next attempt: the first in the policy's order that
/// this request has not tried and whose breaker lets it through; else the
/// one it tried the longest ago that is still in the order (and allowed).
pub(crate) fn pick(
    order: &[Arc<Backend>],
    tried: &[Arc<Backend>],
    now: Duration,
) -> Option<Arc<Backend>> {
    let was_tried = |b: &Arc<Backend>| tried.iter().any(|t| Arc::ptr_eq(t, b));
    order
        .iter()
        .filter(|b| !was_tried(b))
        .find(|b| b.breaker().allow(now))
        .or_else(|| {
            tried
                .iter()
                .filter(|t| order.iter().any(|b| Arc::ptr_eq(t, b)))
                .find(|t| t.breaker().allow(now))
        })
        .cloned()
}

/// A backend that refused the connection has nothing listening: out of
/// rotation at once, not after `failures_to_eject` checks (Envoy's
/// outlier ejection on connect failures). Only where health checks run,
/// since one passing check is what brings it back.
pub(crate) fn eject(g: &Gateway, b: &Backend) {
    if g.cfg.health.interval_ms > 0 {
        b.health_failures
            .store(g.cfg.health.failures_to_eject, Ordering::Relaxed);
        b.healthy.store(false, Ordering::Relaxed);
    }
}

/// POST `body` to `path` on `b`, waiting `wait` for the response headers;
/// a backend that refuses the connection is ejected ([`eject`]).
pub(crate) async fn post(
    g: &Gateway,
    b: &Backend,
    path: &str,
    body: Bytes,
    wait: Duration,
) -> Result<reqwest::Response, Failed> {
    let send = g
        .http
        .post(format!("{}{path}", b.url))
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .send();
    match tokio::time::timeout(wait, send).await {
        Err(_) => Err(Failed::Timeout("no response headers in time")),
        Ok(Err(e)) => {
            if e.is_connect() {
                eject(g, b);
            }
            Err(Failed::Connect(describe(&e)))
        }
        Ok(Ok(resp)) => Ok(resp),
    }
}

/// An HTTP client error with its causes ("error sending request ...:
/// client error (Connect): tcp connect error: Connection refused").
pub(crate) fn describe(e: &reqwest::Error) -> String {
    let mut s = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let c_s = c.to_string();
        if !s.contains(&c_s) {
            s += ": ";
            s += &c_s;
        }
        cause = c.source();
    }
    s
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
    let mut order = order_or_hold(&g, pool, &out.ids, out.arrived, deadline).await;
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
    // Backends that failed this request, the longest ago first.
    let mut tried: Vec<Arc<Backend>> = Vec::new();
    for attempt in 0..g.cfg.retry.max_attempts {
        if attempt > 0 {
            let wait = backoff(&g, attempt);
            if Instant::now() + wait >= deadline {
                break;
            }
            tokio::time::sleep(wait).await;
            // The pool may have changed meanwhile (a platform publishes and
            // withdraws servers, checks eject them): read the order afresh;
            // with nothing left in rotation, hold as a pool at zero does.
            order = order_or_hold(&g, pool, &out.ids, out.arrived, deadline).await;
        }
        let Some(b) = pick(&order, &tried, g.clock.now()) else {
            break;
        };
        let attempt_guard = Attempt::new(&b);
        // A stream's headers come at once; a non-streaming answer's only
        // when the whole generation is done, so it has the total deadline.
        let left = || deadline.saturating_duration_since(Instant::now());
        let wait = if out.stream {
            first_byte.min(left())
        } else {
            left()
        };
        let failed = match post(&g, &b, out.endpoint.path(), out.body.clone(), wait).await {
            Err(f) => f,
            Ok(resp) => {
                let status = resp.status();
                let headers = (
                    resp.headers().get(header::CONTENT_TYPE).cloned(),
                    resp.headers().get(header::RETRY_AFTER).cloned(),
                );
                if status.is_success() && out.stream {
                    match first_event(resp, first_byte.min(left())).await {
                        Ok((events, rest)) => {
                            let resp = relay(
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
        tried.retain(|t| !Arc::ptr_eq(t, &b));
        tried.push(b);
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
