// The test harness shared by p06's tests and p07's (included by each
// crate's tests/support/mod.rs, which supplies `test_engine`).

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use p04_transformer::Tokenizer;
use p05_kv_cache::llama_engine::LlamaEngine;
use common::engine::Engine;
use p06_server::AppState;
use tokio::sync::oneshot;

pub const MODEL: &str = "SmolLM2-135M-Instruct";

pub struct Shared {
    pub engine: Arc<LlamaEngine>,
    pub tokenizer: Arc<Tokenizer>,
}

/// SmolLM2, fetched if missing (the test fails with the fetch's message).
pub fn smollm2() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| {
        let path = common::assets::ensure(common::assets::Asset::SmolLm2)
            .unwrap_or_else(|e| panic!("{e}"));
        let loaded = p05_kv_cache::load::load(&path).unwrap();
        Shared {
            engine: Arc::new(loaded.engine),
            tokenizer: Arc::new(loaded.tokenizer.unwrap()),
        }
    })
}

pub struct TestServer {
    pub url: String,
    pub state: AppState,
    stop: Option<oneshot::Sender<()>>,
    pub done: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl TestServer {
    pub async fn start(max_waiting: usize, max_body_bytes: usize, grace: Duration) -> TestServer {
        let engine = test_engine(smollm2(), max_waiting);
        let state = AppState::new(engine, max_body_bytes);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, rx) = oneshot::channel::<()>();
        let shutdown = async move {
            let _ = rx.await;
        };
        let done = tokio::spawn(p06_server::server::serve(
            listener,
            state.clone(),
            shutdown,
            grace,
        ));
        TestServer {
            url,
            state,
            stop: Some(stop),
            done: Some(done),
        }
    }

    pub async fn default() -> TestServer {
        TestServer::start(64, 1 << 20, Duration::from_secs(30)).await
    }

    /// Begin the graceful shutdown.
    pub fn shutdown(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }

    pub async fn metric(&self, name: &str) -> f64 {
        let text = reqwest::get(format!("{}/metrics", self.url))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find(|l| l.starts_with(name) && !l.starts_with('#'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("metric {name} missing:\n{text}"))
    }

    /// Poll until `name` reads `want`, or panic after `within`.
    pub async fn wait_metric(&self, name: &str, want: f64, within: Duration) -> Duration {
        let t0 = Instant::now();
        loop {
            if self.metric(name).await == want {
                return t0.elapsed();
            }
            assert!(
                t0.elapsed() < within,
                "{name} did not reach {want} within {within:?} (now {})",
                self.metric(name).await
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

pub async fn post(url: &str, path: &str, body: &str) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{url}{path}"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap()
}

/// Read an SSE response to the end: the `data:` payloads in order.
pub async fn sse_events(mut resp: reqwest::Response) -> Vec<String> {
    let mut dec = common::client::SseDecoder::default();
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await.unwrap() {
        out.extend(dec.push(&chunk));
    }
    out
}

/// A short non-streamed completion ("Hi", `max_tokens` tokens).
pub async fn short_completion(url: &str, max_tokens: usize) -> reqwest::Response {
    let body = format!(r#"{{"prompt": "Hi", "max_tokens": {max_tokens}}}"#);
    post(url, "/v1/completions", &body).await
}
