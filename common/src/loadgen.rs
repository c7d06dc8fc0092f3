//! The load generator: drives any OpenAI-compatible server with streaming
//! requests and measures what a user of it feels, with vLLM's `bench serve`
//! definitions:
//!
//! - **TTFT** (time to first token): request sent → first chunk with content.
//! - **ITL** (inter-token latency): the gaps between content chunks.
//! - **TPOT** (time per output token): (E2EL − TTFT) / (output tokens − 1),
//!   per request with more than one output token.
//! - **E2EL** (end-to-end latency): request sent → stream finished.
//! - throughput: completed requests, output tokens and all tokens per second
//!   of the measured run; **goodput**: completed requests per second that met
//!   every stated latency target.
//!
//! Arrivals are open-loop (Poisson at a rate, seeded: requests are sent on
//! schedule whether or not earlier ones finished) or closed-loop (a fixed
//! number of clients, each sending its next request when the last returns).
//! Warm-up requests (their own prompts) run first and are excluded.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};
use thiserror::Error;
use tokio::sync::Semaphore;

use crate::client::{chunk_text, chunk_usage, error_message, SseDecoder};
use crate::rng::Rng;
use crate::stats::percentile_sorted;

/// Which endpoint the requests go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Api {
    Completions,
    Chat,
}

/// How requests arrive.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arrival {
    /// Open loop: exponential gaps at `rate` requests/s (infinite = all at once).
    Poisson { rate: f64, seed: u64 },
    /// Closed loop: `concurrency` clients back to back.
    Closed { concurrency: usize },
}

/// One request to send.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadRequest {
    pub prompt: String,
    /// Expected prompt length (used when the server reports no usage).
    pub prompt_len: usize,
    /// `max_tokens`; with `ignore_eos` the output is exactly this long
    /// where the server supports it.
    pub output_len: usize,
}

/// Latency targets for goodput, in milliseconds (None = no target).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2el_ms: Option<f64>,
}

#[derive(Clone, Debug)]
pub struct LoadConfig {
    /// e.g. `http://127.0.0.1:8000` (no `/v1`).
    pub base_url: String,
    pub model: Option<String>,
    pub api: Api,
    pub arrival: Arrival,
    /// Cap on requests in flight for open-loop arrivals.
    pub max_concurrency: Option<usize>,
    pub ignore_eos: bool,
    pub temperature: f32,
    pub timeout: Duration,
    pub slo: Slo,
}

#[derive(Debug, Error)]
pub enum LoadError {
    #[error("no requests to send")]
    Empty,
    #[error(
        "concurrency must be positive, max_concurrency 1..=2^61 and rate at least 1e-6 requests/s"
    )]
    BadArrival,
    #[error("warm-up request failed: {0}")]
    Warmup(String),
}

/// What happened to one request. Times in seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RequestRecord {
    pub ok: bool,
    pub error: String,
    pub prompt_len: usize,
    pub output_len: usize,
    pub ttft: f64,
    pub itl: Vec<f64>,
    pub latency: f64,
    /// When it was sent, from the start of the measured run.
    pub start: f64,
    pub generated_text: String,
}

/// Send one streaming request and time its chunks.
pub async fn send_one(
    http: &reqwest::Client,
    cfg: &LoadConfig,
    req: &LoadRequest,
    run_start: Instant,
) -> RequestRecord {
    let mut body = json!({
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if let Some(m) = &cfg.model {
        body["model"] = json!(m);
    }
    if cfg.ignore_eos {
        // vLLM's and ours; llama.cpp's server takes min_tokens instead.
        body["ignore_eos"] = json!(true);
        body["min_tokens"] = json!(req.output_len);
    }
    let path = match cfg.api {
        Api::Completions => {
            body["prompt"] = json!(req.prompt);
            "/v1/completions"
        }
        Api::Chat => {
            body["messages"] = json!([{"role": "user", "content": req.prompt}]);
            "/v1/chat/completions"
        }
    };
    let url = format!("{}{path}", cfg.base_url.trim_end_matches('/'));
    let sent = Instant::now();
    let mut rec = RequestRecord {
        prompt_len: req.prompt_len,
        start: sent.duration_since(run_start).as_secs_f64(),
        ..RequestRecord::default()
    };
    let result = tokio::time::timeout(cfg.timeout, async {
        let resp = http
            .post(&url)
            .json(&body)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            let status = resp.status();
            let text = resp.text().await.unwrap_or_default();
            return Err(format!("{status}: {}", error_message(&text)));
        }
        let mut sse = SseDecoder::default();
        let mut stream = resp.bytes_stream();
        let mut last = sent;
        let mut chunks = 0usize;
        let mut usage_out = None;
        while let Some(piece) = stream.next().await {
            let piece = piece.map_err(|e| e.to_string())?;
            let now = Instant::now();
            for data in sse.push(&piece) {
                if data == "[DONE]" {
                    continue;
                }
                let chunk: Value = serde_json::from_str(&data).map_err(|e| e.to_string())?;
                if let Some((p, c)) = chunk_usage(&chunk) {
                    rec.prompt_len = p.unwrap_or(rec.prompt_len);
                    usage_out = c;
                }
                match chunk_text(&chunk) {
                    Some(t) if !t.is_empty() => {
                        if chunks == 0 {
                            rec.ttft = now.duration_since(sent).as_secs_f64();
                        } else {
                            rec.itl.push(now.duration_since(last).as_secs_f64());
                        }
                        last = now;
                        chunks += 1;
                        rec.generated_text.push_str(t);
                    }
                    _ => {}
                }
            }
        }
        rec.output_len = usage_out.unwrap_or(chunks);
        Ok(())
    })
    .await;
    rec.latency = sent.elapsed().as_secs_f64();
    match result {
        Ok(Ok(())) if rec.output_len > 0 => rec.ok = true,
        Ok(Ok(())) => rec.error = "no output tokens".into(),
        Ok(Err(e)) => rec.error = e,
        Err(_) => rec.error = format!("timed out after {:?}", cfg.timeout),
    }
    rec
}

/// Run the warm-up requests one by one (excluded from the figures), then
/// the measured ones; return every measured record and the measured run's
/// duration in seconds.
pub async fn run(
    cfg: &LoadConfig,
    warmup: &[LoadRequest],
    requests: &[LoadRequest],
) -> Result<(Vec<RequestRecord>, f64), LoadError> {
    if requests.is_empty() {
        return Err(LoadError::Empty);
    }
    // A fresh connection per request: a pooled keep-alive connection that
    // the server closes as the next request goes out fails that request
    // ("error sending request"; seen with llama.cpp's llama-server). A
    // local connect costs tens of microseconds, the same for every server.
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap_or_default();
    for r in warmup {
        let rec = send_one(&http, cfg, r, Instant::now()).await;
        if !rec.ok {
            return Err(LoadError::Warmup(rec.error));
        }
    }
    if cfg
        .max_concurrency
        .is_some_and(|c| c == 0 || c > Semaphore::MAX_PERMITS)
    {
        return Err(LoadError::BadArrival);
    }
    let start = Instant::now();
    let records = match cfg.arrival {
        Arrival::Closed { concurrency } => {
            if concurrency == 0 {
                return Err(LoadError::BadArrival);
            }
            closed_loop(&http, cfg, requests, concurrency, start).await
        }
        Arrival::Poisson { rate, seed } => {
            // Below one request per 11 days the exponential gaps overflow
            // what a timer can be set to.
            if rate.is_nan() || rate < 1e-6 {
                return Err(LoadError::BadArrival);
            }
            open_loop(&http, cfg, requests, rate, seed, start).await
        }
    };
    Ok((records, start.elapsed().as_secs_f64()))
}

async fn closed_loop(
    http: &reqwest::Client,
    cfg: &LoadConfig,
    requests: &[LoadRequest],
    concurrency: usize,
    start: Instant,
) -> Vec<RequestRecord> {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let clients = (0..concurrency.min(requests.len())).map(|_| {
        let next = next.clone();
        async move {
            let mut mine = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(r) = requests.get(i) else { break };
                mine.push((i, send_one(http, cfg, r, start).await));
            }
            mine
        }
    });
    let mut all: Vec<(usize, RequestRecord)> = futures_util::future::join_all(clients)
        .await
        .into_iter()
        .flatten()
        .collect();
    all.sort_by_key(|(i, _)| *i);
    all.into_iter().map(|(_, r)| r).collect()
}

async fn open_loop(
    http: &reqwest::Client,
    cfg: &LoadConfig,
    requests: &[LoadRequest],
    rate: f64,
    seed: u64,
    start: Instant,
) -> Vec<RequestRecord> {
    let limit = Arc::new(Semaphore::new(
        cfg.max_concurrency.unwrap_or(Semaphore::MAX_PERMITS),
    ));
    let mut rng = Rng::new(seed);
    let mut at = 0.0f64;
    let sends = requests.iter().map(|r| {
        if rate.is_finite() {
            at += rng.next_exp(rate);
        }
        let when = start + Duration::from_secs_f64(at);
        let limit = limit.clone();
        async move {
            tokio::time::sleep_until(when.into()).await;
            let _permit = limit.acquire().await;
            send_one(http, cfg, r, start).await
        }
    });
    futures_util::future::join_all(sends).await
}

/// Mean, median, standard deviation and percentiles of one metric, in ms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct MetricSummary {
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    pub p95: f64,
    pub p99: f64,
}

impl MetricSummary {
    /// From samples in seconds; zeros for an empty set (as vLLM reports).
    pub fn from_seconds(samples: &[f64]) -> MetricSummary {
        if samples.is_empty() {
            return MetricSummary::default();
        }
        let mut ms: Vec<f64> = samples.iter().map(|s| s * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        let n = ms.len() as f64;
        let mean = ms.iter().sum::<f64>() / n;
        let var = ms.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        MetricSummary {
            mean,
            median: percentile_sorted(&ms, 50.0),
            std: var.sqrt(),
            p95: percentile_sorted(&ms, 95.0),
            p99: percentile_sorted(&ms, 99.0),
        }
    }
}

/// A run's results; `to_json` spells them with vLLM's field names.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    pub duration_s: f64,
    pub completed: usize,
    pub failed: usize,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    pub request_goodput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft: MetricSummary,
    pub tpot: MetricSummary,
    pub itl: MetricSummary,
    pub e2el: MetricSummary,
    pub errors: Vec<String>,
}

/// TPOT of one request, when it has more than one output token.
pub fn tpot(r: &RequestRecord) -> Option<f64> {
    (r.output_len > 1).then(|| (r.latency - r.ttft) / (r.output_len - 1) as f64)
}

impl Report {
    pub fn new(records: &[RequestRecord], duration_s: f64, slo: &Slo) -> Report {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok).collect();
        let ttfts: Vec<f64> = ok.iter().map(|r| r.ttft).collect();
        let tpots: Vec<f64> = ok.iter().filter_map(|r| tpot(r)).collect();
        let itls: Vec<f64> = ok.iter().flat_map(|r| r.itl.iter().copied()).collect();
        let e2els: Vec<f64> = ok.iter().map(|r| r.latency).collect();
        let within = |v: f64, target: Option<f64>| target.is_none_or(|t| v * 1e3 <= t);
        let good = ok
            .iter()
            .filter(|r| {
                within(r.ttft, slo.ttft_ms)
                    && within(tpot(r).unwrap_or(0.0), slo.tpot_ms)
                    && within(r.latency, slo.e2el_ms)
            })
            .count();
        let input: usize = ok.iter().map(|r| r.prompt_len).sum();
        let output: usize = ok.iter().map(|r| r.output_len).sum();
        let d = duration_s.max(1e-9);
        Report {
            duration_s,
            completed: ok.len(),
            failed: records.len() - ok.len(),
            total_input_tokens: input,
            total_output_tokens: output,
            request_throughput: ok.len() as f64 / d,
            request_goodput: good as f64 / d,
            output_throughput: output as f64 / d,
            total_token_throughput: (input + output) as f64 / d,
            ttft: MetricSummary::from_seconds(&ttfts),
            tpot: MetricSummary::from_seconds(&tpots),
            itl: MetricSummary::from_seconds(&itls),
            e2el: MetricSummary::from_seconds(&e2els),
            errors: records
                .iter()
                .filter(|r| !r.ok)
                .map(|r| r.error.clone())
                .collect(),
        }
    }

    /// vLLM `bench serve` names: `duration`, `completed`, `request_throughput`,
    /// `mean_ttft_ms`, `median_ttft_ms`, `std_ttft_ms`, `p99_ttft_ms`, ...
    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "duration": self.duration_s,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "errors": self.errors,
        });
        for (name, m) in self.metrics() {
            v[format!("mean_{name}_ms")] = json!(m.mean);
            v[format!("median_{name}_ms")] = json!(m.median);
            v[format!("std_{name}_ms")] = json!(m.std);
            v[format!("p95_{name}_ms")] = json!(m.p95);
            v[format!("p99_{name}_ms")] = json!(m.p99);
        }
        v
    }

    pub fn metrics(&self) -> [(&'static str, MetricSummary); 4] {
        [
            ("ttft", self.ttft),
            ("tpot", self.tpot),
            ("itl", self.itl),
            ("e2el", self.e2el),
        ]
    }

    /// A table in the style of vLLM's summary.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let mut line = |k: &str, v: String| s.push_str(&format!("{k:<34}{v:>14}\n"));
        line("Successful requests:", self.completed.to_string());
        line("Failed requests:", self.failed.to_string());
        line("Benchmark duration (s):", format!("{:.2}", self.duration_s));
        line("Total input tokens:", self.total_input_tokens.to_string());
        line(
            "Total generated tokens:",
            self.total_output_tokens.to_string(),
        );
        line(
            "Request throughput (req/s):",
            format!("{:.3}", self.request_throughput),
        );
        line(
            "Request goodput (req/s):",
            format!("{:.3}", self.request_goodput),
        );
        line(
            "Output token throughput (tok/s):",
            format!("{:.2}", self.output_throughput),
        );
        line(
            "Total token throughput (tok/s):",
            format!("{:.2}", self.total_token_throughput),
        );
        for (name, m) in self.metrics() {
            let n = name.to_uppercase();
            line(&format!("Mean {n} (ms):"), format!("{:.2}", m.mean));
            line(&format!("Median {n} (ms):"), format!("{:.2}", m.median));
            line(&format!("P95 {n} (ms):"), format!("{:.2}", m.p95));
            line(&format!("P99 {n} (ms):"), format!("{:.2}", m.p99));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ttft: f64, latency: f64, output_len: usize) -> RequestRecord {
        RequestRecord {
            ok: true,
            prompt_len: 10,
            output_len,
            ttft,
            latency,
            itl: vec![(latency - ttft) / (output_len.max(2) - 1) as f64; output_len - 1],
            ..RequestRecord::default()
        }
    }

    #[test]
    fn report_follows_the_vllm_definitions() {
        let records = [
            rec(0.1, 1.1, 11),
            rec(0.3, 2.3, 5),
            RequestRecord {
                error: "boom".into(),
                ..RequestRecord::default()
            },
        ];
        let slo = Slo {
            ttft_ms: Some(200.0),
            ..Slo::default()
        };
        let r = Report::new(&records, 4.0, &slo);
        assert_eq!((r.completed, r.failed), (2, 1));
        assert_eq!(r.total_output_tokens, 16);
        assert!((r.request_throughput - 0.5).abs() < 1e-12);
        assert!(
            (r.request_goodput - 0.25).abs() < 1e-12,
            "only one meets TTFT"
        );
        // TPOT: (1.1-0.1)/10 = 100 ms and (2.3-0.3)/4 = 500 ms.
        assert!((r.tpot.mean - 300.0).abs() < 1e-9);
        assert!((r.ttft.median - 200.0).abs() < 1e-9);
        let j = r.to_json();
        assert_eq!(j["completed"], 2);
        // numpy-style interpolation: 1100 + 0.99 x (2300 - 1100)
        assert!((j["p99_e2el_ms"].as_f64().unwrap() - 2288.0).abs() < 1e-9);
        assert_eq!(j["errors"][0], "boom");
    }

    #[test]
    fn poisson_gaps_have_the_requested_mean() {
        let mut rng = Rng::new(7);
        let n = 100_000;
        let mean = (0..n).map(|_| rng.next_exp(4.0)).sum::<f64>() / n as f64;
        assert!((mean - 0.25).abs() < 0.005, "mean gap {mean}");
    }
}
