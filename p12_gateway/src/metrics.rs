//! The gateway's metrics in Prometheus text: requests by key, model,
//! backend and status; rate-limit decisions; retries; breaker state and
//! health per backend; the latency the gateway adds before a request is
//! sent on (authentication, counting, admission, routing).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds of the added-latency histogram, seconds.
const BUCKETS_S: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

#[derive(Debug, Default)]
struct Inner {
    /// (key, model, backend, status) → count.
    requests: BTreeMap<(String, String, String, u16), u64>,
    /// (key, decision) → count.
    limits: BTreeMap<(String, &'static str), u64>,
    /// (model, backend, reason) → count.
    retries: BTreeMap<(String, String, &'static str), u64>,
    /// (model, backend) → streams that failed on this backend after their
    /// first event (resumed elsewhere or ended by an error event).
    stream_errors: BTreeMap<(String, String), u64>,
    /// (model, backend) → streams continued on this backend after theirs failed.
    stream_resumes: BTreeMap<(String, String), u64>,
    /// Per bucket, then +Inf.
    added: [u64; BUCKETS_S.len() + 1],
    added_sum_s: f64,
    added_count: u64,
    /// (key) → tokens charged at settlement.
    tokens: BTreeMap<String, u64>,
}

#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

/// Prometheus label value escaping.
fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A finished request; `backend` is "" when none was reached.
    pub fn request(&self, key: &str, model: &str, backend: &str, status: u16) {
        *self
            .lock()
            .requests
            .entry((key.into(), model.into(), backend.into(), status))
            .or_default() += 1;
    }

    /// "admitted", "requests", "tokens", "too_large", "concurrency".
    pub fn limit(&self, key: &str, decision: &'static str) {
        *self
            .lock()
            .limits
            .entry((key.into(), decision))
            .or_default() += 1;
    }

    pub fn retry(&self, model: &str, backend: &str, reason: &'static str) {
        *self
            .lock()
            .retries
            .entry((model.into(), backend.into(), reason))
            .or_default() += 1;
    }

    /// A committed stream the backend failed (ended with an error event).
    pub fn stream_error(&self, model: &str, backend: &str) {
        *self
            .lock()
            .stream_errors
            .entry((model.into(), backend.into()))
            .or_default() += 1;
    }

    pub fn stream_resumed(&self, model: &str, backend: &str) {
        *self
            .lock()
            .stream_resumes
            .entry((model.into(), backend.into()))
            .or_default() += 1;
    }

    pub fn tokens(&self, key: &str, n: u64) {
        *self.lock().tokens.entry(key.into()).or_default() += n;
    }

    pub fn added(&self, d: Duration) {
        let s = d.as_secs_f64();
        let mut m = self.lock();
        let i = BUCKETS_S
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(BUCKETS_S.len());
        m.added[i] += 1;
        m.added_sum_s += s;
        m.added_count += 1;
    }

    /// Retries so far, every model, backend and reason.
    pub fn retries_total(&self) -> u64 {
        self.lock().retries.values().sum()
    }

    /// Requests counted so far with this status (tests read it).
    pub fn requests_with_status(&self, status: u16) -> u64 {
        self.lock()
            .requests
            .iter()
            .filter(|(k, _)| k.3 == status)
            .map(|(_, v)| v)
            .sum()
    }

    /// The text page; `backends` is (model, url, breaker state, healthy, outstanding).
    pub fn render(&self, backends: &[(String, String, u8, bool, usize)]) -> String {
        let m = self.lock();
        let mut o = String::new();
        let _ = writeln!(o, "# TYPE gateway_requests_total counter");
        for ((k, model, b, s), v) in &m.requests {
            let _ = writeln!(
                o,
                "gateway_requests_total{{key=\"{}\",model=\"{}\",backend=\"{}\",status=\"{s}\"}} {v}",
                esc(k),
                esc(model),
                esc(b)
            );
        }
        let _ = writeln!(o, "# TYPE gateway_rate_limit_total counter");
        for ((k, d), v) in &m.limits {
            let _ = writeln!(
                o,
                "gateway_rate_limit_total{{key=\"{}\",decision=\"{d}\"}} {v}",
                esc(k)
            );
        }
        let _ = writeln!(o, "# TYPE gateway_tokens_total counter");
        for (k, v) in &m.tokens {
            let _ = writeln!(o, "gateway_tokens_total{{key=\"{}\"}} {v}", esc(k));
        }
        let _ = writeln!(o, "# TYPE gateway_retries_total counter");
        for ((model, b, r), v) in &m.retries {
            let _ = writeln!(
                o,
                "gateway_retries_total{{model=\"{}\",backend=\"{}\",reason=\"{r}\"}} {v}",
                esc(model),
                esc(b)
            );
        }
        for (name, counts) in [
            ("gateway_stream_errors_total", &m.stream_errors),
            ("gateway_stream_resumes_total", &m.stream_resumes),
        ] {
            let _ = writeln!(o, "# TYPE {name} counter");
            for ((model, b), v) in counts {
                let _ = writeln!(
                    o,
                    "{name}{{model=\"{}\",backend=\"{}\"}} {v}",
                    esc(model),
                    esc(b)
                );
            }
        }
        let _ = writeln!(
            o,
            "# HELP gateway_breaker_state 0 closed, 1 open, 2 half-open"
        );
        let _ = writeln!(o, "# TYPE gateway_breaker_state gauge");
        for (model, url, state, _, _) in backends {
            let _ = writeln!(
                o,
                "gateway_breaker_state{{model=\"{}\",backend=\"{}\"}} {state}",
                esc(model),
                esc(url)
            );
        }
        let _ = writeln!(o, "# TYPE gateway_backend_healthy gauge");
        for (model, url, _, healthy, _) in backends {
            let _ = writeln!(
                o,
                "gateway_backend_healthy{{model=\"{}\",backend=\"{}\"}} {}",
                esc(model),
                esc(url),
                u8::from(*healthy)
            );
        }
        let _ = writeln!(o, "# TYPE gateway_backend_outstanding gauge");
        for (model, url, _, _, n) in backends {
            let _ = writeln!(
                o,
                "gateway_backend_outstanding{{model=\"{}\",backend=\"{}\"}} {n}",
                esc(model),
                esc(url)
            );
        }
        let _ = writeln!(
            o,
            "# HELP gateway_added_seconds time from arrival to the request sent on"
        );
        let _ = writeln!(o, "# TYPE gateway_added_seconds histogram");
        let mut cum = 0;
        for (b, n) in BUCKETS_S.iter().zip(&m.added) {
            cum += n;
            let _ = writeln!(o, "gateway_added_seconds_bucket{{le=\"{b}\"}} {cum}");
        }
        cum += m.added[BUCKETS_S.len()];
        let _ = writeln!(o, "gateway_added_seconds_bucket{{le=\"+Inf\"}} {cum}");
        let _ = writeln!(o, "gateway_added_seconds_sum {}", m.added_sum_s);
        let _ = writeln!(o, "gateway_added_seconds_count {}", m.added_count);
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_counts_and_escapes() {
        let m = Metrics::default();
        m.request("a\"b", "m", "http://x", 200);
        m.request("a\"b", "m", "http://x", 200);
        m.added(Duration::from_micros(300));
        m.added(Duration::from_secs(2));
        let page = m.render(&[("m".into(), "http://x".into(), 1, false, 0)]);
        assert!(page.contains(
            "gateway_requests_total{key=\"a\\\"b\",model=\"m\",backend=\"http://x\",status=\"200\"} 2"
        ));
        assert!(page.contains("gateway_added_seconds_bucket{le=\"0.0005\"} 1"));
        assert!(page.contains("gateway_added_seconds_bucket{le=\"+Inf\"} 2"));
        assert!(page.contains("gateway_breaker_state{model=\"m\",backend=\"http://x\"} 1"));
        assert!(page.contains("gateway_backend_healthy{model=\"m\",backend=\"http://x\"} 0"));
    }
}
