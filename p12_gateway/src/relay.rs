//! A committed stream, relayed event by event from its backend to the
//! client. A backend that dies mid-stream is replaced where the request
//! can be continued ([`crate::resume`]): the continuation's events join
//! the same client stream. Otherwise the stream ends with an error event
//! (never a replay: the client has already shown those tokens).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use futures_util::StreamExt;
use tokio::sync::mpsc;

use crate::limits::Reservation;
use crate::proxy::{backoff, describe, order_or_hold, pick, post, Attempt, Failed, Outbound};
use crate::resume::Resume;
use crate::routing::Backend;
use crate::sse::{self, Event};
use crate::state::Gateway;

pub(crate) type ByteStream =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// A stream read up to its first event: that event (and what came before
/// it), and the rest of the body with the splitter's state.
pub(crate) type Opened = (Vec<Vec<u8>>, (ByteStream, sse::EventSplitter));

/// Resumes of one stream at most (a request that kills every backend it
/// reaches must not walk the whole fleet).
const MAX_RESUMES: u32 = 3;

/// Read until the stream's first `data:` event, the commit point: comments
/// and keep-alives before it are held back (nothing is sent yet, so a
/// failure is still retried), and an error event as the first is a failed
/// attempt, not a stream.
pub(crate) async fn first_event(
    resp: reqwest::Response,
    within: Duration,
) -> Result<Opened, Failed> {
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

/// What the relay needs of the request, owned (it outlives the handler).
struct Request {
    key: String,
    model: String,
    path: &'static str,
    ids: Vec<u32>,
    arrived: Instant,
    deadline: Instant,
    keep_usage: bool,
    prompt_tokens: u64,
}

/// Send a continuation (`body`) to a backend of the model's pool that has
/// not failed this stream (`failed`), retrying as a request is retried;
/// the attempt and the opened stream, or why there is none.
async fn reopen(
    g: &Arc<Gateway>,
    req: &Request,
    body: Bytes,
    failed: &[Arc<Backend>],
) -> Result<(Attempt, Opened), String> {
    let none = || format!("no other backend of `{}` is in rotation", req.model);
    let Some(route) = g.routes.get(&req.model) else {
        return Err(none());
    };
    let pool = &route.pool;
    let mut last = none();
    let first_byte = Duration::from_millis(g.cfg.timeouts.first_byte_ms);
    let mut tried: Vec<Arc<Backend>> = failed.to_vec();
    for attempt in 0..g.cfg.retry.max_attempts {
        if attempt > 0 {
            let wait = backoff(g, attempt);
            if Instant::now() + wait >= req.deadline {
                return Err(format!("{last} (and no time left to retry)"));
            }
            tokio::time::sleep(wait).await;
        }
        let mut order = order_or_hold(g, pool, &req.ids, req.arrived, req.deadline).await;
        order.retain(|b| !failed.iter().any(|f| Arc::ptr_eq(f, b)));
        let Some(b) = pick(&order, &tried, g.clock.now()) else {
            return Err(last);
        };
        let guard = Attempt::new(&b);
        let left = req.deadline.saturating_duration_since(Instant::now());
        let opened = match post(g, &b, req.path, body.clone(), first_byte.min(left)).await {
            Ok(resp) if resp.status().is_success() => first_event(resp, first_byte.min(left)).await,
            Ok(resp) => Err(Failed::Status(resp.status(), Bytes::new(), (None, None))),
            Err(f) => Err(f),
        };
        match opened {
            Ok(o) => return Ok((guard, o)),
            Err(f) => {
                guard.failure(g.clock.now());
                g.metrics.retry(&req.model, &b.url, f.reason());
                last = format!("{}: {}", b.url, f.describe());
                tried.retain(|t| !Arc::ptr_eq(t, &b));
                tried.push(b);
            }
        }
    }
    Err(last)
}

/// Relay a committed stream event by event; settle when it ends. The
/// breaker's verdict waits for the end: a backend that always dies
/// mid-stream must open it.
pub(crate) fn relay(
    g: Arc<Gateway>,
    out: &Outbound,
    attempt: Attempt,
    first: Vec<Vec<u8>>,
    (body, split): (ByteStream, sse::EventSplitter),
    reservation: Reservation,
    content_type: Option<HeaderValue>,
) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let req = Request {
        key: out.key.clone(),
        model: out.model.clone(),
        path: out.endpoint.path(),
        ids: out.ids.clone(),
        arrived: out.arrived,
        deadline: out.arrived + Duration::from_millis(g.cfg.timeouts.total_ms),
        keep_usage: out.client_wants_usage,
        prompt_tokens: out.prompt_tokens,
    };
    let mut resume = Resume::new(out.endpoint, &out.body);
    tokio::spawn(async move {
        let (mut body, mut split) = (body, split);
        let mut attempt = Some(attempt);
        // Backends this stream ran on that failed it.
        let mut failed: Vec<Arc<Backend>> = Vec::new();
        let mut resumed = 0u32;
        let mut usage: Option<u64> = None;
        let mut chunks = 0u64;
        let (mut done, mut backend_error, mut client_gone) = (false, false, false);
        let mut pending: VecDeque<Vec<u8>> = first.into();
        let mut failure: Option<String> = None;
        'relay: loop {
            // Forward what has arrived, at the client's pace (but never
            // past the deadline: a client that stops reading lets go).
            while let Some(ev) = pending.pop_front() {
                let mut fwd = true;
                let (kind, payload) = sse::parse(&ev);
                match kind {
                    Event::Chunk => chunks += 1,
                    Event::Usage(p, c) => {
                        usage = Some(p.saturating_add(c));
                        fwd = req.keep_usage;
                    }
                    Event::Done => done = true,
                    Event::Error => backend_error = true,
                    Event::Other => {}
                }
                if let (Some(r), Some(v)) = (resume.as_mut(), &payload) {
                    r.sent(v);
                }
                if fwd {
                    let left = req.deadline.saturating_duration_since(Instant::now());
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
            let left = req.deadline.saturating_duration_since(Instant::now());
            let broke = match tokio::time::timeout(left, body.next()).await {
                Err(_) => {
                    failure = Some("the stream ran past the gateway's total timeout".into());
                    break;
                }
                // After its own error event a backend may just close.
                Ok(None) if backend_error => break,
                Ok(None) => "the backend's stream ended before [DONE]".to_string(),
                Ok(Some(Err(e))) => format!("the backend's stream failed: {}", describe(&e)),
                Ok(Some(Ok(bytes))) => match split.push(&bytes) {
                    Ok(events) => {
                        let again = resume.as_ref().filter(|_| resumed > 0);
                        pending.extend(events.into_iter().filter_map(|e| match again {
                            Some(r) => r.rewrite(e),
                            None => Some(e),
                        }));
                        continue;
                    }
                    Err(e) => e.to_string(),
                },
            };
            // The backend failed mid-stream: its verdict now.
            if let Some(a) = attempt.take() {
                failed.push(a.backend().clone());
                a.failure(g.clock.now());
            }
            g.metrics
                .stream_error(&req.model, &failed[failed.len() - 1].url);
            let why = match resume.as_mut() {
                // The answer is whole but for its closing events.
                Some(r) if r.finished() || r.spent() => {
                    pending.extend(r.closing(req.prompt_tokens));
                    continue;
                }
                Some(r) if resumed < MAX_RESUMES => match r.continuation() {
                    None => "nothing left to ask for".to_string(),
                    Some(cont) => match reopen(&g, &req, cont, &failed).await {
                        Ok((a, (first, rest))) => {
                            g.metrics.stream_resumed(&req.model, &a.backend().url);
                            resumed += 1;
                            attempt = Some(a);
                            (body, split) = rest;
                            pending.extend(first.into_iter().filter_map(|e| r.rewrite(e)));
                            continue;
                        }
                        Err(why) => why,
                    },
                },
                Some(_) => format!("resumed {MAX_RESUMES} times already"),
                None => "only a single-choice completion with a text prompt, or a \
                         single-choice chat without tools or logprobs, can be"
                    .into(),
            };
            failure = Some(format!("{broke}; not continued elsewhere: {why}"));
            break;
        }
        if let Some(a) = attempt {
            let timed_out_on_client = client_gone && failure.is_some();
            if backend_error || (failure.is_some() && !timed_out_on_client) {
                g.metrics.stream_error(&req.model, &a.backend().url);
                a.failure(g.clock.now());
            } else if done {
                a.success();
            } else {
                drop(a); // the client left: no verdict on the backend
            }
        }
        if let (Some(msg), false) = (&failure, client_gone) {
            let _ = tx.send(Bytes::from(sse::error_event(msg))).await;
        }
        let used = usage.unwrap_or(req.prompt_tokens.saturating_add(chunks));
        g.metrics.tokens(&req.key, used);
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
