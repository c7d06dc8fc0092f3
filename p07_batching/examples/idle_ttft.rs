//! Time to the first token of one request on an idle engine, in process (no
//! HTTP): p06's serial engine and the p07 batcher alternated on one model.
//!
//!   cargo run --release -p p07_batching --example idle_ttft

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::engine::{Engine, EngineEvent, EngineRequest, PromptInput};
use p07_batching::{BatchConfig, BatchingEngine};

async fn ttft(engine: &dyn Engine, prompt: &str) -> f64 {
    let mut r = EngineRequest::new("cmpl-x", PromptInput::Text(prompt.into()));
    r.max_tokens = Some(4);
    r.sampling.temperature = 0.0;
    r.ignore_eos = true;
    let t0 = Instant::now();
    let mut rx = engine.submit(r).unwrap();
    let mut first = None;
    while let Some(ev) = rx.recv().await {
        if first.is_none() && matches!(ev, EngineEvent::Token(_)) {
            first = Some(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    first.unwrap()
}

#[tokio::main]
async fn main() {
    let path = common::assets::ensure(common::assets::Asset::SmolLm2).unwrap();
    let loaded = p05_kv_cache::load::load(&path).unwrap();
    let (model, tok) = (Arc::new(loaded.engine), Arc::new(loaded.tokenizer.unwrap()));
    let cfg = BatchConfig {
        max_batch: 16,
        max_wait: Duration::from_millis(5),
        max_waiting: 8,
    };
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(6);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    // Fresh engines every 7 requests (as the HTTP bench makes them).
    for _ in 0..3 {
        let serial = p06_server::SerialEngine::start(model.clone(), tok.clone(), "m", 8).unwrap();
        let batcher = BatchingEngine::start(model.clone(), tok.clone(), "m", cfg).unwrap();
        for i in 0..8 {
            let x = ttft(&serial, &prompt).await;
            let y = ttft(&batcher, &prompt).await;
            if i > 0 {
                a.push(x);
                b.push(y);
            }
        }
    }
    a.sort_by(f64::total_cmp);
    b.sort_by(f64::total_cmp);
    println!(
        "TTFT median: serial {:.1} ms, batcher {:.1} ms",
        a[10], b[10]
    );
}
