//! The gateway's HTTP face: the backends' API (`/v1/completions`,
//! `/v1/chat/completions`, `/v1/models`) behind keys and limits, and its own
//! `/health` and `/metrics`. A request reads as: authenticate → peek at the
//! body → model allowed? → count the prompt (off the async workers) →
//! admit against the key's limits → forward (routing, retries, breaker).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use common::openai::{ModelCard, ModelList};
use p06_server::error::ApiError;

use crate::auth::{AuthError, Caller};
use crate::count::{peek, Endpoint};
use crate::limits::Refusal;
use crate::proxy::{forward, Outbound};
use crate::state::Gateway;

/// The app without a socket (tests call it directly).
pub fn router(g: Arc<Gateway>) -> Router {
    let limit = g.cfg.max_body_bytes;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|uri: axum::http::Uri| async move { ApiError::not_found(uri.path()) })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(g)
}

fn unauthorized(e: AuthError) -> ApiError {
    let message = match e {
        AuthError::Missing => "no API key: send `Authorization: Bearer <key>`",
        AuthError::Malformed => "the Authorization header must be `Bearer <key>`",
        AuthError::Unknown => "the API key is not valid",
    };
    ApiError {
        code: Some("invalid_api_key"),
        ..ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
    }
}

/// Whole seconds, at least 1 (the header's unit).
fn retry_secs(d: Duration) -> u64 {
    d.as_secs_f64().ceil().max(1.0) as u64
}

fn refused(r: &Refusal) -> ApiError {
    let rate = |kind: &'static str, message: String, after: u64| ApiError {
        code: Some("rate_limit_exceeded"),
        retry_after_s: Some(after),
        ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, kind, message)
    };
    match *r {
        Refusal::Requests { retry_after } => rate(
            "requests",
            "this key's requests-per-minute limit is reached".into(),
            retry_secs(retry_after),
        ),
        Refusal::Tokens { retry_after } => rate(
            "tokens",
            "this key's tokens-per-minute limit is reached".into(),
            retry_secs(retry_after),
        ),
        Refusal::Concurrency { limit } => rate(
            "requests",
            format!("this key already has {limit} requests in flight"),
            1,
        ),
        Refusal::TooLarge { need, limit } => ApiError {
            param: Some("max_tokens".into()),
            code: Some("tokens_exceed_limit"),
            ..ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!(
                    "the request may use {need} tokens (prompt + n x max_tokens), more than this \
                     key's limit of {limit} tokens per minute: lower max_tokens"
                ),
            )
        },
    }
}

fn decision(r: &Refusal) -> &'static str {
    match r {
        Refusal::Requests { .. } => "requests",
        Refusal::Tokens { .. } => "tokens",
        Refusal::Concurrency { .. } => "concurrency",
        Refusal::TooLarge { .. } => "too_large",
    }
}

fn authenticate<'g>(g: &'g Gateway, headers: &HeaderMap) -> Result<&'g Caller, ApiError> {
    let value = headers
        .get(header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or(""));
    g.keys.authenticate(value).map_err(unauthorized)
}

async fn completions(State(g): State<Arc<Gateway>>, headers: HeaderMap, body: Bytes) -> Response {
    handle(g, Endpoint::Completions, headers, body).await
}

async fn chat(State(g): State<Arc<Gateway>>, headers: HeaderMap, body: Bytes) -> Response {
    handle(g, Endpoint::Chat, headers, body).await
}

async fn handle(g: Arc<Gateway>, endpoint: Endpoint, headers: HeaderMap, body: Bytes) -> Response {
    let arrived = Instant::now();
    let caller = match authenticate(&g, &headers) {
        Ok(c) => c.clone(),
        Err(e) => {
            g.metrics.request("", "", "", 401);
            return e.into_response();
        }
    };
    match admit_and_forward(g.clone(), endpoint, &caller, body, arrived).await {
        Ok(resp) => resp,
        Err((model, e)) => {
            g.metrics
                .request(&caller.key, &model, "", e.status.as_u16());
            e.into_response()
        }
    }
}

async fn admit_and_forward(
    g: Arc<Gateway>,
    endpoint: Endpoint,
    caller: &Caller,
    body: Bytes,
    arrived: Instant,
) -> Result<Response, (String, ApiError)> {
    let fail = |e: ApiError| (String::new(), e);
    let mut json: serde_json::Value = serde_json::from_slice(&body).map_err(|e| {
        fail(ApiError::bad_body(format!(
            "the body is not valid JSON: {e}"
        )))
    })?;
    let p = peek(&json, endpoint).map_err(fail)?;
    let route = match g.routes.get(&p.model) {
        Some(r) if caller.models.contains(&p.model) => r,
        // Metrics name only configured models: a client's string would
        // grow the label set without bound.
        _ => return Err(("unknown".into(), ApiError::model_not_found(&p.model))),
    };
    let model = p.model.clone();
    let fail = |e: ApiError| (model.clone(), e);
    // The limits that need no token count first: a key over them cannot
    // make the gateway tokenize for it.
    if let Err(r) = g.limiter.precheck(&caller.key) {
        g.metrics.limit(&caller.key, decision(&r));
        return Err(fail(refused(&r)));
    }
    // Tokenising is CPU work: off the async workers.
    let counter = route.counter.clone();
    let prompts = p.prompts.clone();
    let counted = tokio::task::spawn_blocking(move || counter.count(&prompts))
        .await
        .map_err(|e| {
            fail(ApiError::internal(format!(
                "counting the prompt failed: {e}"
            )))
        })?
        .map_err(fail)?;
    let cost = route.counter.cost(&p, counted.tokens);
    let reservation = match g.limiter.admit(&caller.key, cost) {
        Ok(r) => r,
        Err(r) => {
            g.metrics.limit(&caller.key, decision(&r));
            return Err(fail(refused(&r)));
        }
    };
    g.metrics.limit(&caller.key, "admitted");
    // A stream always asks for usage (to settle exactly); the usage chunk
    // is dropped on the way back unless the client asked too.
    let body = if p.stream && !p.include_usage {
        if let Some(o) = json.as_object_mut() {
            // Merged into the client's options, which are kept.
            match o.get_mut("stream_options") {
                Some(serde_json::Value::Object(so)) => {
                    so.insert("include_usage".into(), true.into());
                }
                _ => {
                    o.insert(
                        "stream_options".into(),
                        serde_json::json!({"include_usage": true}),
                    );
                }
            }
        }
        Bytes::from(serde_json::to_vec(&json).unwrap_or_else(|_| body.to_vec()))
    } else {
        body
    };
    let out = Outbound {
        key: caller.key.clone(),
        model: p.model.clone(),
        endpoint,
        body,
        stream: p.stream,
        client_wants_usage: p.include_usage,
        prompt_tokens: counted.tokens,
        ids: counted.ids,
        arrived,
    };
    Ok(forward(g.clone(), &route.pool, out, reservation).await)
}

/// The models this key may use.
async fn models(State(g): State<Arc<Gateway>>, headers: HeaderMap) -> Response {
    let caller = match authenticate(&g, &headers) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let data = g
        .cfg
        .models
        .iter()
        .filter(|m| caller.models.contains(&m.name))
        .map(|m| ModelCard {
            id: m.name.clone(),
            object: "model".into(),
            created: 0,
            owned_by: "inference-lab".into(),
            max_model_len: m
                .context_length
                .or(g.routes.get(&m.name).and_then(|r| r.counter.context())),
        })
        .collect();
    Json(ModelList {
        object: "list".into(),
        data,
    })
    .into_response()
}

/// 200 while some backend of every model is in rotation.
async fn health(State(g): State<Arc<Gateway>>) -> Response {
    let down: Vec<&String> = g
        .routes
        .iter()
        .filter(|(_, r)| {
            !r.pool
                .backends()
                .iter()
                .any(|b| b.healthy.load(std::sync::atomic::Ordering::Relaxed))
        })
        .map(|(m, _)| m)
        .collect();
    if down.is_empty() {
        (StatusCode::OK, "ok").into_response()
    } else {
        ApiError::unavailable(format!("no healthy backend for {down:?}")).into_response()
    }
}

async fn metrics(State(g): State<Arc<Gateway>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        g.metrics.render(&g.backends()),
    )
        .into_response()
}
