//! Backends on real sockets (127.0.0.1, free ports) for the gateway's
//! tests: our p06 server on SmolLM2 (loaded once per test binary), each in
//! its own runtime so a test can kill one (every task, listener and
//! connection dropped at once); scripted mock backends for exact bytes and
//! failures; and the gateway itself.

#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::response::Response;
use axum::routing::{get, post as post_route};
use axum::Router;
use common::engine::Engine;
use p04_transformer::Tokenizer;
use p05_kv_cache::llama_engine::LlamaEngine;
use p12_gateway::clock::Clock;
use p12_gateway::count::Counter;
use p12_gateway::{Config, Gateway};

pub const MODEL: &str = "SmolLM2-135M-Instruct";

pub struct Shared {
    pub engine: Arc<LlamaEngine>,
    pub tokenizer: Arc<Tokenizer>,
    pub path: std::path::PathBuf,
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
            path,
        }
    })
}

/// One of our servers, in a runtime of its own.
pub struct OurServer {
    pub url: String,
    pub port: u16,
    rt: Option<tokio::runtime::Runtime>,
}

impl OurServer {
    /// On a free port, or on `port` (a restart after a kill). Callable
    /// from async code: the runtime is built on a thread of its own.
    pub fn start(port: u16) -> OurServer {
        std::thread::spawn(move || OurServer::start_blocking(port))
            .join()
            .unwrap()
    }

    fn start_blocking(port: u16) -> OurServer {
        let s = smollm2();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let engine: Arc<dyn Engine> = {
            let _enter = rt.enter();
            Arc::new(
                p06_server::SerialEngine::start(s.engine.clone(), s.tokenizer.clone(), MODEL, 64)
                    .unwrap(),
            )
        };
        let listener = rt
            .block_on(tokio::net::TcpListener::bind(("127.0.0.1", port)))
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = p06_server::AppState::new(engine, 1 << 20);
        rt.spawn(p06_server::server::serve(
            listener,
            state,
            std::future::pending(),
            Duration::from_secs(1),
        ));
        OurServer {
            url: format!("http://127.0.0.1:{port}"),
            port,
            rt: Some(rt),
        }
    }

    /// Gone at once: listener, connections and in-flight requests.
    pub fn kill(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for OurServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What a scripted backend does with each request it gets.
#[derive(Clone, Debug)]
pub enum Script {
    /// Answer with this status and body (JSON).
    Status(u16, &'static str),
    /// Stream these raw chunks, `gap` apart; `then_die`: cut the connection
    /// after them instead of ending cleanly.
    Stream {
        chunks: Vec<&'static [u8]>,
        gap: Duration,
        then_die: bool,
    },
}

/// A mock backend on a free port in the caller's runtime; counts requests
/// and records the bodies it got.
pub struct Mock {
    pub url: String,
    pub hits: Arc<AtomicUsize>,
    pub bodies: Arc<std::sync::Mutex<Vec<Bytes>>>,
    /// What its `/metrics` page says (empty until set).
    pub metrics: Arc<std::sync::Mutex<String>>,
}

pub async fn mock(script: Script) -> Mock {
    let hits = Arc::new(AtomicUsize::new(0));
    let bodies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (h, b) = (hits.clone(), bodies.clone());
    let answer = move |body: Bytes| {
        let (h, b, script) = (h.clone(), b.clone(), script.clone());
        async move {
            h.fetch_add(1, Ordering::SeqCst);
            b.lock().unwrap().push(body);
            match script {
                Script::Status(s, text) => Response::builder()
                    .status(s)
                    .header("content-type", "application/json")
                    .body(Body::from(text))
                    .unwrap(),
                Script::Stream {
                    chunks,
                    gap,
                    then_die,
                } => {
                    let stream = futures_util::stream::unfold(0usize, move |i| {
                        let chunks = chunks.clone();
                        async move {
                            if i > 0 {
                                tokio::time::sleep(gap).await;
                            }
                            if i < chunks.len() {
                                Some((
                                    Ok::<Bytes, std::io::Error>(Bytes::from_static(chunks[i])),
                                    i + 1,
                                ))
                            } else if then_die {
                                Some((Err(std::io::Error::other("backend died")), i + 1))
                            } else {
                                None
                            }
                        }
                    });
                    Response::builder()
                        .header("content-type", "text/event-stream")
                        .body(Body::from_stream(stream))
                        .unwrap()
                }
            }
        }
    };
    let metrics = Arc::new(std::sync::Mutex::new(String::new()));
    let page = metrics.clone();
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let page = page.clone();
                async move { page.lock().unwrap().clone() }
            }),
        )
        .route("/v1/completions", post_route(answer.clone()))
        .route("/v1/chat/completions", post_route(answer))
        .route("/health", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    Mock {
        url,
        hits,
        bodies,
        metrics,
    }
}

pub const KEY: &str = "sk-test-alice";
pub const OTHER_KEY: &str = "sk-test-bob";

/// A config for `backends` of MODEL: key alice (with `limits` TOML lines)
/// may use MODEL; key bob's tenant may use only "other".
pub fn config(backends: &[&str], routing: &str, limits: &str, extra: &str) -> Config {
    let list: Vec<String> = backends.iter().map(|b| format!("\"{b}\"")).collect();
    let text = format!(
        r#"
        {extra}
        [[tenants]]
        name = "a"
        models = ["{MODEL}"]
        [[tenants]]
        name = "b"
        models = ["other"]
        [[keys]]
        name = "alice"
        tenant = "a"
        sha256 = "{}"
        {limits}
        [[keys]]
        name = "bob"
        tenant = "b"
        sha256 = "{}"
        [[models]]
        name = "{MODEL}"
        backends = [{}]
        routing = "{routing}"
        affinity_prefix_tokens = 64
        [[models]]
        name = "other"
        backends = ["http://127.0.0.1:9"]
        "#,
        p12_gateway::auth::hash_key(KEY),
        p12_gateway::auth::hash_key(OTHER_KEY),
        list.join(", ")
    );
    Config::parse(&text, "test config").unwrap()
}

/// The gateway on a free port; MODEL counted with SmolLM2's tokenizer when
/// `exact` (else by bytes). Returns its URL and state.
pub async fn gateway(cfg: Config, clock: Arc<dyn Clock>, exact: bool) -> (String, Arc<Gateway>) {
    let mut counters = std::collections::HashMap::new();
    if exact {
        let s = smollm2();
        let c = Counter::from_gguf(s.path.to_str().unwrap(), None, MODEL).unwrap();
        counters.insert(MODEL.to_string(), c);
    }
    let g = Arc::new(Gateway::new(cfg, clock, counters).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = p12_gateway::router(g.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, g)
}

pub fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// POST a JSON body with `key`.
pub async fn post(
    url: &str,
    path: &str,
    key: Option<&str>,
    body: &serde_json::Value,
) -> reqwest::Response {
    let mut r = client().post(format!("{url}{path}")).json(body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    r.send().await.unwrap()
}

/// Requests the gateway sent to `backend`, from its metrics page.
pub fn served_by(g: &Gateway, backend: &str) -> u64 {
    let page = g.metrics.render(&g.backends());
    page.lines()
        .filter(|l| {
            l.starts_with("gateway_requests_total") && l.contains(&format!("backend=\"{backend}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// The line of the metrics page that starts with `prefix`, its value.
pub fn metric(g: &Gateway, prefix: &str) -> Option<f64> {
    let page = g.metrics.render(&g.backends());
    page.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// A scripted stream: an event split across reads, the usage, [DONE].
pub const CHUNKS: [&[u8]; 4] = [
    b"data: {\"choices\":[{\"index\":0,\"text\":\"Hel\"}]}\n\n",
    b"data: {\"choices\":[{\"index\":0,\"te",
    b"xt\":\"lo\",\"finish_reason\":\"stop\"}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":2,\"total_tokens\":4}}\n\n",
    b"data: [DONE]\n\n",
];

/// A chat request of MODEL, greedy.
pub fn chat(content: &str, max_tokens: u64) -> serde_json::Value {
    serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": content}],
           "max_tokens": max_tokens, "temperature": 0})
}

/// An error answer: its status and body.
pub async fn error_of(r: reqwest::Response) -> (u16, serde_json::Value) {
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// A streamed completion's bytes, and how many reads they came in.
pub async fn stream_bytes(url: &str, body: &serde_json::Value) -> (Vec<u8>, usize) {
    let mut r = post(url, "/v1/completions", Some(KEY), body).await;
    assert_eq!(r.status(), 200);
    let (mut bytes, mut reads) = (Vec::new(), 0);
    while let Some(c) = r.chunk().await.unwrap() {
        bytes.extend_from_slice(&c);
        reads += 1;
    }
    (bytes, reads)
}
