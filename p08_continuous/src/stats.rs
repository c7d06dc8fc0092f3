//! The scheduler's metrics, appended to the server's `/metrics` in vLLM's
//! names where vLLM has one: `vllm:num_preemptions_total`,
//! `vllm:iteration_tokens_total` (a histogram of tokens per step),
//! `vllm:kv_cache_usage_perc`; and the lab's own: steps, the prefill and
//! decode tokens they carried, and step time.

use std::fmt::Write;

use p06_server::metrics::Histogram;

use crate::core::StepOutput;
use crate::kv_backend::KvMetric;

const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
];
const STEP_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5,
];

#[derive(Clone, Debug)]
pub struct StepStats {
    /// Tokens per step (decode tokens + prefill chunks).
    pub iteration_tokens: Histogram,
    pub step_seconds: Histogram,
    pub steps: u64,
    /// Tokens that were a sequence's one decode token.
    pub decode_tokens: u64,
    /// Tokens of prompt chunks (and of preempted sequences' recomputation).
    pub prefill_tokens: u64,
    pub preemptions: u64,
    pub kv_cache_bytes: usize,
    pub kv_capacity_bytes: usize,
    /// The K/V backend's and the runner's own metrics, as of the last step.
    pub kv_metrics: Vec<KvMetric>,
}

impl Default for StepStats {
    fn default() -> Self {
        StepStats {
            iteration_tokens: Histogram::new(TOKEN_BUCKETS),
            step_seconds: Histogram::new(STEP_BUCKETS),
            steps: 0,
            decode_tokens: 0,
            prefill_tokens: 0,
            preemptions: 0,
            kv_cache_bytes: 0,
            kv_capacity_bytes: 0,
            kv_metrics: Vec::new(),
        }
    }
}

impl StepStats {
    pub fn observe<C>(
        &mut self,
        out: &StepOutput<C>,
        step_s: f64,
        kv_cache_bytes: usize,
        kv_metrics: Vec<KvMetric>,
    ) {
        self.preemptions += out.schedule.preempted.len() as u64;
        self.kv_cache_bytes = kv_cache_bytes;
        self.kv_metrics = kv_metrics;
        if out.schedule.is_empty() {
            return;
        }
        self.steps += 1;
        self.iteration_tokens
            .observe(out.schedule.num_tokens() as f64);
        self.step_seconds.observe(step_s);
        for s in &out.schedule.seqs {
            if s.decode {
                self.decode_tokens += 1;
            } else {
                self.prefill_tokens += s.len as u64;
            }
        }
    }

    /// Fraction of the K/V budget allocated (0..1, as vLLM reports it).
    pub fn kv_usage(&self) -> f64 {
        self.kv_cache_bytes as f64 / self.kv_capacity_bytes.max(1) as f64
    }

    pub fn render(&self, out: &mut String, labels: &str) {
        self.iteration_tokens.render(
            out,
            "vllm:iteration_tokens_total",
            "Tokens per engine step (decode tokens plus prefill chunks).",
            labels,
        );
        self.step_seconds.render(
            out,
            "inference_lab:step_seconds",
            "Wall time of one engine step (schedule, batched forward, sampling).",
            labels,
        );
        for (name, help, v) in [
            (
                "vllm:num_preemptions_total",
                "Sequences preempted (K/V freed, recomputed later).",
                self.preemptions,
            ),
            ("inference_lab:steps_total", "Engine steps run.", self.steps),
            (
                "inference_lab:decode_tokens_total",
                "Tokens that were a sequence's single decode token.",
                self.decode_tokens,
            ),
            (
                "inference_lab:prefill_tokens_total",
                "Prompt-chunk tokens, including recomputation after preemption.",
                self.prefill_tokens,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            let _ = writeln!(out, "{name}{{{labels}}} {v}");
        }
        let mut last = "";
        for m in &self.kv_metrics {
            // A metric's series (one per rank) share one HELP and TYPE.
            if m.name != last {
                let _ = writeln!(
                    out,
                    "# HELP {} {}\n# TYPE {} {}",
                    m.name, m.help, m.name, m.kind
                );
                last = m.name;
            }
            match m.rank {
                Some(r) => {
                    let sep = if labels.is_empty() { "" } else { "," };
                    let _ = writeln!(out, "{}{{{labels}{sep}rank=\"{r}\"}} {}", m.name, m.value);
                }
                None => {
                    let _ = writeln!(out, "{}{{{labels}}} {}", m.name, m.value);
                }
            }
        }
        let name = "vllm:kv_cache_usage_perc";
        let _ = writeln!(
            out,
            "# HELP {name} Fraction of the K/V budget allocated to running sequences (1 = full).\n# TYPE {name} gauge"
        );
        let _ = writeln!(out, "{name}{{{labels}}} {}", self.kv_usage());
    }
}
