//! `common::client::RemoteEngine` behind our HTTP layer, forwarding to our
//! own server: the front answers what the back generates, and a client
//! leaving the front cancels the work at the back.

mod support;

use std::sync::Arc;
use std::time::Duration;

use common::client::RemoteEngine;
use p06_server::AppState;
use serde_json::{json, Value};
use support::{post, sse_events, TestServer, MODEL};

async fn front_for(back: &TestServer) -> String {
    let engine = Arc::new(RemoteEngine::new(&back.url, MODEL));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(p06_server::server::serve(
        listener,
        AppState::new(engine, 1 << 20),
        std::future::pending(),
        Duration::from_secs(1),
    ));
    url
}

#[tokio::test]
async fn a_remote_engine_serves_what_the_backend_generates() {
    let back = TestServer::default().await;
    let front = front_for(&back).await;
    let body = json!({"model": MODEL, "max_tokens": 12, "temperature": 0,
                      "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    .to_string();
    let direct: Value = post(&back.url, "/v1/chat/completions", &body)
        .await
        .json()
        .await
        .unwrap();
    let via: Value = post(&front, "/v1/chat/completions", &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        via["choices"][0]["message"],
        direct["choices"][0]["message"]
    );
    assert_eq!(via["usage"], direct["usage"]);
    // Completions, streamed through both hops.
    let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10,
                      "temperature": 0, "stream": true})
    .to_string();
    let text = |events: Vec<String>| -> String {
        events
            .iter()
            .filter(|e| *e != "[DONE]")
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
            .collect()
    };
    let a = text(sse_events(post(&back.url, "/v1/completions", &body).await).await);
    let b = text(sse_events(post(&front, "/v1/completions", &body).await).await);
    assert_eq!(a, b);
    assert!(!a.is_empty());
    // The back's errors come through with their status (the front cannot
    // know the context length; the back refuses).
    let body = json!({"prompt": "Hi", "max_tokens": 9000}).to_string();
    let r = post(&front, "/v1/completions", &body).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"].as_str().unwrap().contains("8192"),
        "{v}"
    );
}

#[tokio::test]
async fn leaving_the_front_cancels_the_backend_request() {
    let back = TestServer::default().await;
    let front = front_for(&back).await;
    let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000,
                      "ignore_eos": true, "temperature": 0, "stream": true})
    .to_string();
    let mut resp = post(&front, "/v1/completions", &body).await;
    let _ = resp.chunk().await.unwrap();
    back.wait_metric("vllm:num_requests_running", 1.0, Duration::from_secs(10))
        .await;
    drop(resp);
    back.wait_metric("vllm:num_requests_running", 0.0, Duration::from_secs(3))
        .await;
    assert_eq!(back.metric("inference_lab:kv_cache_bytes").await, 0.0);
}
