//! The `bench` command: the load generator (`common::loadgen`) against any
//! OpenAI-compatible server, with prompts of chosen token lengths, and the
//! `overhead` measurement: the p05 engine alone vs the same engine behind
//! our HTTP layer, A B A B in one run.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use common::loadgen::{self, Api, Arrival, LoadConfig, LoadRequest, Report, Slo};
use common::numbers::{Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use common::rng::Rng;
use p04_transformer::{GgufFile, Tokenizer};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ApiArg {
    Completions,
    Chat,
}

#[derive(Clone, Debug, Args)]
pub struct BenchArgs {
    /// Server to drive, e.g. http://127.0.0.1:8000 (no /v1).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// `model` to send (default: the first id from /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long, value_enum, default_value_t = ApiArg::Completions)]
    pub api: ApiArg,
    /// Open loop: Poisson arrivals at this many requests/s ("inf" = all at once).
    #[arg(long, conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Closed loop: this many clients back to back.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Cap on requests in flight for --rate.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    #[arg(long, default_value_t = 100)]
    pub num_requests: usize,
    /// Prompt length in tokens (random prompts).
    #[arg(long, default_value_t = 256)]
    pub input_len: usize,
    /// Output length in tokens (max_tokens, with ignore_eos/min_tokens).
    #[arg(long, default_value_t = 64)]
    pub output_len: usize,
    /// Lengths drawn uniformly in [len·(1−r), len·(1+r)].
    #[arg(long, default_value_t = 0.0)]
    pub range_ratio: f64,
    /// One prompt per line instead of random prompts.
    #[arg(long)]
    pub prompts_file: Option<PathBuf>,
    /// Tokenizer for random prompts: `smollm2` or a .gguf path.
    #[arg(long, default_value = "smollm2")]
    pub tokenizer: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Ask for exactly output_len tokens (ignore_eos and min_tokens).
    #[arg(long)]
    pub ignore_eos: bool,
    #[arg(long)]
    pub slo_ttft_ms: Option<f64>,
    #[arg(long)]
    pub slo_tpot_ms: Option<f64>,
    #[arg(long)]
    pub slo_e2el_ms: Option<f64>,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
    /// Name for this server in the rows and the JSON (e.g. ours, llama.cpp).
    #[arg(long, default_value = "server")]
    pub label: String,
    /// Write the vLLM-style JSON here (default target/bench/<label>-<arrival>.json).
    #[arg(long)]
    pub result_file: Option<PathBuf>,
    /// Your prediction, recorded beside the rows.
    #[arg(long)]
    pub prediction: Option<String>,
    #[arg(long)]
    pub no_record: bool,
    /// Sweep Poisson rates (comma-separated req/s) and plot throughput and
    /// latency against offered load.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["rate", "concurrency"])]
    pub rates: Option<Vec<f64>>,
    /// Instead of driving --url: p05 engine alone vs behind our HTTP layer.
    #[arg(long)]
    pub overhead: bool,
    /// Repetitions per side for --overhead.
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
}

/// Load just the tokenizer of a GGUF (`smollm2` is fetched if missing).
pub fn load_tokenizer(spec: &str) -> Result<Tokenizer> {
    let path = crate::server::resolve_model(spec).map_err(anyhow::Error::msg)?;
    let f = GgufFile::open(&path).with_context(|| path.display().to_string())?;
    Ok(Tokenizer::from_gguf(&f.header)?)
}

/// A prompt of exactly `len` tokens of ordinary text: random ids from the
/// vocabulary's plain tokens, decoded, re-encoded and cut until the text
/// round-trips (what vLLM's random dataset does, plus the round-trip).
pub fn random_prompt(tok: &Tokenizer, len: usize, rng: &mut Rng) -> Result<(String, Vec<u32>)> {
    // Rejection sampling, so a seed gives the prompts it always gave; a
    // vocabulary with no plain piece ends with an error, not a spin.
    const MAX_MISSES: usize = 1 << 20;
    let vocab = tok.vocab_size() as u64;
    let mut ids: Vec<u32> = Vec::with_capacity(len + 8);
    let mut misses = 0;
    while ids.len() < len {
        if vocab == 0 || misses == MAX_MISSES {
            bail!(
                "no plain text piece in {misses} draws from the tokenizer's {vocab} tokens: \
                 cannot build a random prompt"
            );
        }
        let id = (rng.next_u64() % vocab) as u32;
        // Plain word pieces only: no specials, no control bytes.
        let bytes = tok.decode_bytes(&[id]);
        let plain = tok
            .token(id)
            .is_some_and(|t| !t.starts_with("<|") && !t.starts_with('<'))
            && std::str::from_utf8(&bytes).is_ok_and(|s| s.chars().all(|c| !c.is_control()));
        if plain {
            ids.push(id);
            misses = 0;
        } else {
            misses += 1;
        }
    }
    // Re-encoding may merge across the joins: iterate to a fixed point.
    let mut text = tok.decode(&ids);
    for _ in 0..8 {
        let mut again = tok.encode(&text);
        again.truncate(len);
        let t2 = tok.decode(&again);
        if t2 == text && again.len() == len {
            return Ok((text, again));
        }
        text = t2;
    }
    let ids = tok.encode(&text);
    Ok((text, ids))
}

fn lengths(base: usize, ratio: f64, rng: &mut Rng) -> usize {
    let lo = (base as f64 * (1.0 - ratio)).round().max(1.0);
    let hi = (base as f64 * (1.0 + ratio)).round().max(lo);
    (lo + (rng.next_f64() * (hi - lo + 1.0)).floor()).min(hi) as usize
}

/// The requests of a run: random prompts, or the lines of a file.
pub fn build_requests(a: &BenchArgs) -> Result<Vec<LoadRequest>> {
    let mut rng = Rng::new(a.seed);
    if let Some(path) = &a.prompts_file {
        let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
        let prompts: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        if prompts.is_empty() {
            bail!("{}: no prompts (one per line expected)", path.display());
        }
        return Ok((0..a.num_requests + a.warmup)
            .map(|i| LoadRequest {
                prompt: prompts[i % prompts.len()].to_string(),
                prompt_len: 0,
                output_len: lengths(a.output_len, a.range_ratio, &mut rng),
            })
            .collect());
    }
    let tok = load_tokenizer(&a.tokenizer)?;
    (0..a.num_requests + a.warmup)
        .map(|_| {
            let input = lengths(a.input_len, a.range_ratio, &mut rng);
            let output = lengths(a.output_len, a.range_ratio, &mut rng);
            let (prompt, ids) = random_prompt(&tok, input, &mut rng)?;
            Ok(LoadRequest {
                prompt,
                prompt_len: ids.len(),
                output_len: output,
            })
        })
        .collect()
}

async fn first_model(url: &str) -> Result<String> {
    let v: serde_json::Value = reqwest::get(format!("{}/v1/models", url.trim_end_matches('/')))
        .await
        .with_context(|| format!("{url}/v1/models"))?
        .json()
        .await?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("{url}/v1/models lists no model: {v}"))
}

pub async fn run(a: BenchArgs) -> Result<()> {
    if a.overhead {
        return crate::bench_overhead::run(&a).await;
    }
    let model = match &a.model {
        Some(m) => m.clone(),
        None => first_model(&a.url).await?,
    };
    if let Some(rates) = &a.rates {
        return sweep(&a, &model, rates).await;
    }
    let arrival = match (a.rate, a.concurrency) {
        (Some(rate), None) => Arrival::Poisson { rate, seed: a.seed },
        (None, Some(c)) => Arrival::Closed { concurrency: c },
        (None, None) => Arrival::Closed { concurrency: 1 },
        (Some(_), Some(_)) => bail!("give --rate or --concurrency, not both"),
    };
    run_one(&a, &model, arrival).await.map(|_| ())
}

fn arrival_name(arrival: Arrival) -> String {
    match arrival {
        Arrival::Poisson { rate, .. } => format!("rate{rate}"),
        Arrival::Closed { concurrency } => format!("c{concurrency}"),
    }
}

/// One load-generator run: table, JSON, numbers.md rows.
async fn run_one(a: &BenchArgs, model: &str, arrival: Arrival) -> Result<Report> {
    let mut requests = build_requests(a)?;
    let warm: Vec<LoadRequest> = requests.drain(..a.warmup.min(requests.len())).collect();
    let cfg = LoadConfig {
        base_url: a.url.clone(),
        model: Some(model.to_string()),
        api: match a.api {
            ApiArg::Completions => Api::Completions,
            ApiArg::Chat => Api::Chat,
        },
        arrival,
        max_concurrency: a.max_concurrency,
        ignore_eos: a.ignore_eos,
        temperature: 0.0,
        timeout: Duration::from_secs(a.timeout_s),
        slo: Slo {
            ttft_ms: a.slo_ttft_ms,
            tpot_ms: a.slo_tpot_ms,
            e2el_ms: a.slo_e2el_ms,
        },
    };
    let arrival_name = arrival_name(arrival);
    eprintln!(
        "bench {}: {} requests (+{} warm-up) to {} [{model}], {arrival_name}, in {} out {}",
        a.label,
        requests.len(),
        warm.len(),
        a.url,
        a.input_len,
        a.output_len
    );
    let (records, duration) = loadgen::run(&cfg, &warm, &requests).await?;
    let report = Report::new(&records, duration, &cfg.slo);
    println!("{}", report.table());
    let mut json = report.to_json();
    json["label"] = serde_json::json!(a.label);
    json["model_id"] = serde_json::json!(model);
    json["backend"] = serde_json::json!("openai");
    json["max_concurrency"] = serde_json::json!(a.concurrency.or(a.max_concurrency));
    json["request_rate"] = match arrival {
        Arrival::Poisson { rate, .. } => serde_json::json!(rate),
        Arrival::Closed { .. } => serde_json::json!("inf"),
    };
    json["input_lens"] = records.iter().map(|r| r.prompt_len).collect();
    json["output_lens"] = records.iter().map(|r| r.output_len).collect();
    json["ttfts"] = records.iter().map(|r| r.ttft).collect();
    json["itls"] = records.iter().map(|r| r.itl.clone()).collect();
    json["generated_texts"] = records.iter().map(|r| r.generated_text.clone()).collect();
    let out = a.result_file.clone().unwrap_or_else(|| {
        common::assets::workspace_root()
            .join(format!("target/bench/{}-{arrival_name}.json", a.label))
    });
    write_json(&out, &json)?;
    eprintln!("wrote {}", out.display());
    if !a.no_record {
        let tag = format!(
            "{} {arrival_name} in{} out{}",
            a.label, a.input_len, a.output_len
        );
        let mut rows = Vec::new();
        // Latencies as median and p95 (TTFT also p99); the prediction, if
        // any, goes on the first row (median TTFT).
        rows.extend(Row::median_p95(
            format!("{tag}: TTFT"),
            report.ttft.median,
            report.ttft.p95,
            "ms",
            a.prediction.clone().unwrap_or_default(),
        ));
        rows.push(Row::new(format!("{tag}: p99 TTFT"), report.ttft.p99, "ms"));
        for (name, m) in [
            ("TPOT", &report.tpot),
            ("ITL", &report.itl),
            ("E2EL", &report.e2el),
        ] {
            rows.extend(Row::median_p95(
                format!("{tag}: {name}"),
                m.median,
                m.p95,
                "ms",
                "",
            ));
        }
        // Whole-run aggregates: one number per run.
        rows.extend([
            Row::new(
                format!("{tag}: request throughput, whole run"),
                report.request_throughput,
                "req/s",
            ),
            Row::new(
                format!("{tag}: output throughput, whole run"),
                report.output_throughput,
                "tok/s",
            ),
            Row::new(
                format!("{tag}: goodput, whole run"),
                report.request_goodput,
                "req/s",
            ),
            Row::new(format!("{tag}: failed"), report.failed as f64, "requests"),
        ]);
        let command = common::numbers::command_line("p06_server");
        Recorder::for_workspace(command).append(&rows)?;
    }
    Ok(report)
}

/// Poisson runs at each offered rate: achieved throughput and latency vs
/// offered load, plotted to `p06_server/plots/<label>_vs_rate.png`.
async fn sweep(a: &BenchArgs, model: &str, rates: &[f64]) -> Result<()> {
    let mut thr = Vec::new();
    let mut ttft = Vec::new();
    let mut e2el = Vec::new();
    for &rate in rates {
        let r = run_one(a, model, Arrival::Poisson { rate, seed: a.seed }).await?;
        thr.push((rate, r.request_throughput));
        ttft.push((rate, r.ttft.median / 1e3));
        e2el.push((rate, r.e2el.median / 1e3));
    }
    println!("offered req/s  achieved req/s  median TTFT s  median E2EL s");
    for i in 0..rates.len() {
        println!(
            "{:>13.3} {:>15.3} {:>14.2} {:>14.2}",
            rates[i], thr[i].1, ttft[i].1, e2el[i].1
        );
    }
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("plots");
    let title = format!(
        "{}: achieved vs offered load (Poisson, in {} out {} tokens)",
        a.label, a.input_len, a.output_len
    );
    let ideal: Vec<(f64, f64)> = rates.iter().map(|&r| (r, r)).collect();
    let chart = |file: &str, y: &str, series: [Series; 2]| {
        let labels = Labels {
            title: &title,
            x: "offered requests/s",
            y,
        };
        line_chart(&dir.join(file), labels, &series, Scale::Linear).map_err(anyhow::Error::msg)
    };
    chart(
        &format!("{}_throughput_vs_rate.png", a.label),
        "completed requests/s",
        [
            Series::new("achieved", thr),
            Series::new("offered (ideal)", ideal),
        ],
    )?;
    chart(
        &format!("{}_latency_vs_rate.png", a.label),
        "seconds (median)",
        [
            Series::new("TTFT", ttft),
            Series::new("end-to-end latency", e2el),
        ],
    )?;
    println!("plots: {}", dir.display());
    Ok(())
}

pub fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, serde_json::to_string_pretty(v)?)?;
    Ok(())
}

/// Shared with the overhead runner: an in-process server on a free port.
pub async fn spawn_server(engine: Arc<dyn common::engine::Engine>) -> Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let state = crate::AppState::new(engine, 1 << 20);
    tokio::spawn(crate::server::serve(
        listener,
        state,
        std::future::pending(),
        Duration::from_secs(1),
    ));
    Ok(url)
}
