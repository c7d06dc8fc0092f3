//! `GET /metrics` in Prometheus' text format, with vLLM's metric names and
//! buckets, so dashboards and routers written for vLLM read ours:
//!
//! - histograms `vllm:time_to_first_token_seconds`,
//!   `vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`;
//! - counters `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
//!   `vllm:request_success_total{finished_reason=...}`;
//! - gauges `vllm:num_requests_running`, `vllm:num_requests_waiting`, and
//!   `inference_lab:kv_cache_bytes` (vLLM reports a fraction of its block
//!   pool; the serial engine has no pool, so it reports bytes held).

use std::fmt::Write;
use std::sync::Mutex;

use common::engine::{EngineLoad, Finish};

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A Prometheus histogram (public so engines that export their own, like
/// p07's batch sizes, render them the same way).
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Non-cumulative counts per bucket; the last is +Inf.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| v <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += v;
    }

    /// `labels` is the text inside the braces, e.g. `model_name=\"x\"`.
    pub fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut acc = 0;
        for (i, c) in self.counts.iter().enumerate() {
            acc += c;
            let le = self
                .bounds
                .get(i)
                .map_or("+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {acc}");
        }
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {acc}");
    }
}

#[derive(Debug)]
struct Inner {
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    prompt_tokens: u64,
    generation_tokens: u64,
    /// stop, length, abort
    finished: [u64; 3],
}

#[derive(Debug)]
pub struct Metrics {
    labels: String,
    inner: Mutex<Inner>,
}

impl Metrics {
    pub fn new(model_name: &str) -> Metrics {
        let escaped = model_name.replace('\\', "\\\\").replace('"', "\\\"");
        Metrics {
            labels: format!("model_name=\"{escaped}\""),
            inner: Mutex::new(Inner {
                ttft: Histogram::new(TTFT_BUCKETS),
                itl: Histogram::new(ITL_BUCKETS),
                e2e: Histogram::new(E2E_BUCKETS),
                prompt_tokens: 0,
                generation_tokens: 0,
                finished: [0; 3],
            }),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        let mut g = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut g)
    }

    pub fn first_token(&self, seconds: f64) {
        self.with(|m| m.ttft.observe(seconds));
    }

    pub fn inter_token(&self, seconds: f64) {
        self.with(|m| m.itl.observe(seconds));
    }

    /// A request ended (any way, cancellation included).
    pub fn finished(&self, finish: Finish, prompt_tokens: usize, generated: usize, e2e_s: f64) {
        self.with(|m| {
            m.e2e.observe(e2e_s);
            m.prompt_tokens += prompt_tokens as u64;
            m.generation_tokens += generated as u64;
            m.finished[finish as usize] += 1;
        });
    }

    /// The exposition text, with the engine's gauges as of now.
    pub fn render(&self, load: EngineLoad) -> String {
        let l = &self.labels;
        let mut out = String::new();
        let gauge = |out: &mut String, name: &str, help: &str, v: usize| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{l}}} {v}"
            );
        };
        gauge(
            &mut out,
            "vllm:num_requests_running",
            "Requests being generated.",
            load.running,
        );
        gauge(
            &mut out,
            "vllm:num_requests_waiting",
            "Requests waiting in the queue.",
            load.waiting,
        );
        gauge(
            &mut out,
            "inference_lab:kv_cache_bytes",
            "Bytes of KV cache held by running requests.",
            load.kv_cache_bytes,
        );
        self.with(|m| {
            let counter = |out: &mut String, name: &str, help: &str, v: u64| {
                let _ = writeln!(
                    out,
                    "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{l}}} {v}"
                );
            };
            counter(
                &mut out,
                "vllm:prompt_tokens_total",
                "Prefill tokens processed.",
                m.prompt_tokens,
            );
            counter(
                &mut out,
                "vllm:generation_tokens_total",
                "Tokens generated.",
                m.generation_tokens,
            );
            let name = "vllm:request_success_total";
            let _ = writeln!(
                out,
                "# HELP {name} Finished requests by finish reason.\n# TYPE {name} counter"
            );
            for f in [Finish::Stop, Finish::Length, Finish::Abort] {
                let _ = writeln!(
                    out,
                    "{name}{{{l},finished_reason=\"{f}\"}} {}",
                    m.finished[f as usize]
                );
            }
            m.ttft.render(
                &mut out,
                "vllm:time_to_first_token_seconds",
                "Time to first token.",
                l,
            );
            m.itl.render(
                &mut out,
                "vllm:inter_token_latency_seconds",
                "Time between tokens.",
                l,
            );
            m.e2e.render(
                &mut out,
                "vllm:e2e_request_latency_seconds",
                "End-to-end request latency.",
                l,
            );
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_counters_labelled() {
        let m = Metrics::new("m");
        m.first_token(0.003);
        m.first_token(0.3);
        m.first_token(9999.0);
        m.finished(Finish::Length, 5, 7, 1.2);
        let t = m.render(EngineLoad {
            running: 1,
            waiting: 2,
            kv_cache_bytes: 3,
        });
        for line in [
            "vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.001\"} 0",
            "vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.005\"} 1",
            "vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.5\"} 2",
            "vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 3",
            "vllm:time_to_first_token_seconds_count{model_name=\"m\"} 3",
            "vllm:num_requests_waiting{model_name=\"m\"} 2",
            "vllm:generation_tokens_total{model_name=\"m\"} 7",
            "vllm:request_success_total{model_name=\"m\",finished_reason=\"length\"} 1",
            "vllm:request_success_total{model_name=\"m\",finished_reason=\"abort\"} 0",
        ] {
            assert!(t.lines().any(|l| l == line), "missing {line}\n{t}");
        }
    }
}
