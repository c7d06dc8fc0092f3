//! The README's server (native weights on Project 08's continuous batcher
//! over Project 09's paged K/V with prefix caching) on a real socket:
//! - the official `openai` Python client's checks, streamed text equal to
//!   non-streamed among them (scripts/openai_client_check.py; its venv is
//!   made by scripts/setup_client_venv.sh when missing);
//! - 8 greedy requests one at a time, then all at once (half of them
//!   streamed), then all at once again on a warm prefix cache: the same
//!   texts every time.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use common::batch::BatchModel;
use p04_transformer::Tokenizer;
use p05_kv_cache::llama_engine::LlamaEngine;
use serde_json::{json, Value};
use tokio::sync::oneshot;

const MODEL: &str = "SmolLM2-135M-Instruct";

fn native() -> &'static (Arc<LlamaEngine>, Arc<Tokenizer>) {
    static M: OnceLock<(Arc<LlamaEngine>, Arc<Tokenizer>)> = OnceLock::new();
    M.get_or_init(|| {
        let path = common::assets::ensure(common::assets::Asset::SmolLm2)
            .unwrap_or_else(|e| panic!("{e}"));
        let loaded =
            p10_quant::loader::load_native(&path, p10_quant::NativeWeights::detect()).unwrap();
        (Arc::new(loaded.engine), Arc::new(loaded.tokenizer.unwrap()))
    })
}

/// The server on 127.0.0.1 (an ephemeral port); drop the sender to stop it.
async fn start() -> (String, oneshot::Sender<()>) {
    let (engine, tok) = native();
    let config = p08_continuous::ContinuousConfig::default();
    let kv = p09_kv_manager::PagedKv::new(engine.kv_shape(), 16, 1 << 30, true).unwrap();
    let engine = p08_continuous::ContinuousEngine::start_with_backend(
        engine.clone(),
        tok.clone(),
        MODEL,
        config,
        kv,
    )
    .unwrap();
    let state = p06_server::AppState::new(Arc::new(engine), 1 << 20);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, rx) = oneshot::channel::<()>();
    tokio::spawn(p06_server::server::serve(
        listener,
        state,
        async move {
            let _ = rx.await;
        },
        Duration::from_secs(5),
    ));
    (url, stop)
}

const PROMPTS: [&str; 8] = [
    "What is the capital of France?",
    "Write a haiku about the sea in winter.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "Who wrote Romeo and Juliet?",
    "Translate to French: the cat sleeps on the warm windowsill.",
    "Write a Python function that reverses a string.",
    "Give me a short recipe for pancakes.",
];

/// One greedy chat request's text, streamed or not.
async fn chat(client: &reqwest::Client, url: &str, prompt: &str, stream: bool) -> String {
    let body = json!({"model": MODEL, "max_tokens": 40, "temperature": 0, "stream": stream,
                      "messages": [{"role": "user", "content": prompt}]});
    let resp = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&body)
        .timeout(Duration::from_secs(300))
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    if !stream {
        let v: Value = resp.json().await.unwrap();
        return v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
    }
    let bytes = resp.bytes().await.unwrap();
    let mut sse = common::client::SseDecoder::default();
    let mut text = String::new();
    for event in sse.push(&bytes) {
        if event == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(&event).unwrap();
        text.push_str(common::client::chunk_text(&chunk).unwrap_or(""));
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_give_the_serial_texts() {
    let (url, _stop) = start().await;
    let client = reqwest::Client::new();
    let mut serial = Vec::new();
    for p in PROMPTS {
        serial.push(chat(&client, &url, p, false).await);
    }
    for round in ["concurrent", "concurrent, warm prefix cache"] {
        let tasks: Vec<_> = PROMPTS
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (client, url, p) = (client.clone(), url.clone(), p.to_string());
                tokio::spawn(async move { chat(&client, &url, &p, i % 2 == 0).await })
            })
            .collect();
        for (i, t) in tasks.into_iter().enumerate() {
            let got = t.await.unwrap();
            assert_eq!(got, serial[i], "{round}: request {i} ({:?})", PROMPTS[i]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_python_client_passes_its_checks() {
    let root = common::assets::workspace_root();
    let setup = std::process::Command::new("bash")
        .arg(root.join("scripts/setup_client_venv.sh"))
        .status()
        .expect("running scripts/setup_client_venv.sh");
    assert!(
        setup.success(),
        "could not create .venv-client; run `bash scripts/setup_client_venv.sh` and read its error"
    );
    let (url, _stop) = start().await;
    let out = tokio::process::Command::new(root.join(".venv-client/bin/python"))
        .args([
            root.join("scripts/openai_client_check.py")
                .to_str()
                .unwrap(),
            "--base-url",
            &format!("{url}/v1"),
            "--model",
            MODEL,
        ])
        .output()
        .await
        .expect("running the openai client script");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    eprintln!("{stdout}{stderr}");
    assert!(
        out.status.success() && stdout.contains("all checks passed"),
        "openai client checks failed:\n{stdout}{stderr}"
    );
}
