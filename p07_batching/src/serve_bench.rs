//! `p07_batching bench-serve`: the batcher behind the p06 HTTP layer, driven
//! by the p06 load generator, beside the p06 serial server on the same
//! loaded model in the same run (one server at a time, so they never share
//! the cores).
//!
//! 1. closed loop at concurrency 8 (256-token prompts, 64 output tokens):
//!    output tok/s, batcher vs serial;
//! 2. Poisson at 0.1 req/s: TTFT, batcher vs serial (an idle batcher must
//!    not wait);
//! 3. a `max_wait_ms` × `max_batch` sweep under Poisson load;
//! 4. short (16) and long (256 output tokens) requests in one batch: the
//!    lock-step penalty on the short ones, and the empty slots.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use common::engine::Engine;
use common::loadgen::{
    self, Api, Arrival, LoadConfig, LoadRequest, MetricSummary, Report, RequestRecord, Slo,
};
use common::rng::Rng;
use p04_transformer::Tokenizer;
use p05_kv_cache::llama_engine::LlamaEngine;
use p06_server::bench::{random_prompt, spawn_server};
use p06_server::SerialEngine;

use crate::{BatchConfig, BatchingEngine};

/// Requests of `input_len` prompt tokens and the given output lengths.
pub fn requests(
    tok: &Tokenizer,
    input_len: usize,
    outputs: &[usize],
    seed: u64,
) -> Result<Vec<LoadRequest>> {
    let mut rng = Rng::new(seed);
    outputs
        .iter()
        .map(|&output_len| {
            let (prompt, ids) = random_prompt(tok, input_len, &mut rng)?;
            Ok(LoadRequest {
                prompt,
                prompt_len: ids.len(),
                output_len,
            })
        })
        .collect()
}

/// Serve `engine` on a free port, run the load, and report (with every request's record).
pub async fn drive(
    engine: Arc<dyn Engine>,
    name: &str,
    arrival: Arrival,
    warmup: &[LoadRequest],
    reqs: &[LoadRequest],
) -> Result<(Report, Vec<RequestRecord>)> {
    let url = spawn_server(engine).await?;
    load(&url, name, arrival, warmup, reqs).await
}

/// Run the load against a server already listening at `url`.
pub async fn load(
    url: &str,
    name: &str,
    arrival: Arrival,
    warmup: &[LoadRequest],
    reqs: &[LoadRequest],
) -> Result<(Report, Vec<RequestRecord>)> {
    let cfg = LoadConfig {
        base_url: url.to_string(),
        model: Some(name.to_string()),
        api: Api::Completions,
        arrival,
        max_concurrency: None,
        ignore_eos: true,
        temperature: 0.0,
        timeout: Duration::from_secs(1800),
        slo: Slo::default(),
    };
    let (records, duration) = loadgen::run(&cfg, warmup, reqs)
        .await
        .context("load generator")?;
    let report = Report::new(&records, duration, &cfg.slo);
    if report.failed > 0 {
        anyhow::bail!("{} requests failed: {:?}", report.failed, report.errors);
    }
    Ok((report, records))
}

/// The lock-step penalty: a batch of 8 (`outputs` tokens each) starts, and
/// `late` short requests (16 tokens) arrive `delay` later. They wait for the
/// whole batch: its longest member sets their TTFT. Returns the late
/// requests' TTFT (median, p95, ... in ms) and the batch's share of empty
/// decode slots.
pub async fn late_arrivals(
    e: &Engines,
    outputs: &[usize],
    late: usize,
    delay: Duration,
    seed: u64,
) -> Result<(MetricSummary, f64)> {
    let engine = e.batching(BatchConfig {
        max_batch: outputs.len(),
        max_wait: Duration::from_millis(20),
        max_waiting: 64,
    })?;
    let url = spawn_server(engine.clone()).await?;
    let batch = requests(&e.tok, 64, outputs, seed)?;
    let newcomers = requests(&e.tok, 64, &vec![16; late], seed + 1)?;
    let warm = requests(&e.tok, 16, &[4], seed + 2)?;
    load(
        &url,
        &e.name,
        Arrival::Closed { concurrency: 1 },
        &[],
        &warm,
    )
    .await?;
    let before = engine.stats();
    let all_at_once = Arrival::Poisson {
        rate: f64::INFINITY,
        seed,
    };
    let first = load(&url, &e.name, all_at_once, &[], &batch);
    let second = async {
        tokio::time::sleep(delay).await;
        load(&url, &e.name, all_at_once, &[], &newcomers).await
    };
    let (first, second) = tokio::join!(first, second);
    first?;
    let (report, _) = second?;
    let after = engine.stats();
    let empty = (after.empty_slot_steps - before.empty_slot_steps) as f64
        / (after.slot_steps - before.slot_steps).max(1) as f64;
    Ok((report.ttft, empty))
}

/// The two engines under test, on one loaded model.
#[derive(Debug)]
pub struct Engines {
    pub model: Arc<LlamaEngine>,
    pub tok: Arc<Tokenizer>,
    pub name: String,
}

impl Engines {
    pub fn serial(&self) -> Result<Arc<dyn Engine>> {
        Ok(Arc::new(
            SerialEngine::start(self.model.clone(), self.tok.clone(), &self.name, 256)
                .map_err(anyhow::Error::msg)?,
        ))
    }

    pub fn batching(&self, config: BatchConfig) -> Result<Arc<BatchingEngine>> {
        Ok(Arc::new(
            BatchingEngine::start(self.model.clone(), self.tok.clone(), &self.name, config)
                .map_err(anyhow::Error::msg)?,
        ))
    }
}
