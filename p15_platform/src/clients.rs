//! Closed-loop streaming clients whose number changes while they run (a
//! step, a ramp, a stop), each request timed to its first token and
//! checked to its end: `ok` only when the stream ends with `[DONE]` and no
//! error event, `cut` when it ended early after tokens had come. Each
//! keeps its text (to compare with the single server's) and the longest
//! wait it saw for a token (the pause a fault costs a client).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;

/// One request, times in seconds from the clients' start.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Record {
    pub prompt: String,
    pub start: f64,
    pub ttft: Option<f64>,
    pub end: f64,
    pub ok: bool,
    /// Tokens came, then the stream broke off.
    pub cut: bool,
    pub error: String,
    /// The text streamed, in order.
    pub text: String,
    /// The longest wait for a token, from the request's start to its
    /// first token or between two tokens (s).
    pub max_gap: f64,
}

#[derive(Debug)]
pub struct Clients {
    pub t0: Instant,
    /// How many clients run now.
    pub want: Arc<AtomicUsize>,
    pub records: Arc<Mutex<Vec<Record>>>,
}

const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "Once upon a time",
    "List three colours:",
    "Explain what a cache is in one line.",
];

impl Clients {
    /// `max` client tasks against `url` (the router), idle until asked;
    /// times are taken from `t0`.
    pub fn start(
        url: &str,
        model: &str,
        key: &str,
        max: usize,
        max_tokens: u32,
        t0: Instant,
    ) -> Clients {
        let want = Arc::new(AtomicUsize::new(0));
        let records = Arc::new(Mutex::new(Vec::new()));
        let http = reqwest::Client::new();
        for i in 0..max {
            let (want, records, http) = (want.clone(), records.clone(), http.clone());
            let (url, model, key) = (url.to_string(), model.to_string(), key.to_string());
            tokio::spawn(async move {
                let mut n = i;
                loop {
                    if i >= want.load(Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    let prompt = PROMPTS[n % PROMPTS.len()];
                    n += 1;
                    let r = one(&http, &url, &model, &key, prompt, max_tokens, t0).await;
                    let failed = !r.ok;
                    records.lock().unwrap_or_else(|p| p.into_inner()).push(r);
                    if failed {
                        // A client backs off rather than spin on a refusal.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            });
        }
        Clients { t0, want, records }
    }

    /// Run `n` clients from now on (those above `n` finish their request).
    pub fn set(&self, n: usize) {
        self.want.store(n, Ordering::Relaxed);
    }

    pub fn records(&self) -> Vec<Record> {
        self.records
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// One streaming completion, timed.
pub async fn one(
    http: &reqwest::Client,
    url: &str,
    model: &str,
    key: &str,
    prompt: &str,
    max_tokens: u32,
    t0: Instant,
) -> Record {
    let start = t0.elapsed().as_secs_f64();
    let mut rec = Record {
        prompt: prompt.to_string(),
        start,
        ..Record::default()
    };
    let body = serde_json::json!({
        "model": model, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0.0, "stream": true,
    });
    let resp = http
        .post(format!("{url}/v1/completions"))
        .bearer_auth(key)
        .json(&body)
        .timeout(Duration::from_secs(300))
        .send()
        .await;
    let resp = match resp {
        Ok(r) if r.status().is_success() => r,
        Ok(r) => {
            let status = r.status();
            rec.error = format!("{status}: {}", r.text().await.unwrap_or_default());
            rec.end = t0.elapsed().as_secs_f64();
            return rec;
        }
        Err(e) => {
            rec.error = e.to_string();
            rec.end = t0.elapsed().as_secs_f64();
            return rec;
        }
    };
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut done = false;
    let mut last = start;
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else {
            rec.error = "the stream broke off".into();
            break;
        };
        buf.extend_from_slice(&chunk);
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim().strip_prefix("data:").map(str::trim) else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(data).unwrap_or_default();
            let text = v.pointer("/choices/0/text").and_then(|t| t.as_str());
            if v.get("error").is_some() {
                rec.error = format!("error event: {data}");
            } else if let Some(text) = text.filter(|t| !t.is_empty()) {
                let now = t0.elapsed().as_secs_f64();
                rec.ttft.get_or_insert(now - start);
                rec.max_gap = rec.max_gap.max(now - last);
                last = now;
                rec.text.push_str(text);
            }
        }
    }
    rec.end = t0.elapsed().as_secs_f64();
    rec.ok = done && rec.error.is_empty();
    rec.cut = !rec.ok && rec.ttft.is_some();
    if !rec.ok && rec.error.is_empty() {
        rec.error = "the stream ended without [DONE]".into();
    }
    rec
}
