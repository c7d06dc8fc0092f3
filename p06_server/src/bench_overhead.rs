//! `bench --overhead`: what the HTTP layer costs. The p05 engine alone
//! (Generator in-process, token ids in hand) against the same loaded engine
//! behind our server (text prompt over a socket, tokenization, queue hand-off,
//! SSE), A B / B A alternating in one run, same prompts both sides.
//!
//! TTFT: start → first token (direct: prefill + first sample; HTTP: request
//! sent → first content chunk). Decode tok/s: (tokens − 1) / (end − first
//! token), the inverse of TPOT.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use common::engine::Engine;
use common::loadgen::{self, Api, Arrival, LoadConfig, LoadRequest, Slo};
use common::numbers::{Recorder, Row};
use common::rng::Rng;
use common::stats::summarize;
use p05_kv_cache::generate::{GenerateParams, Generator};

use crate::bench::{random_prompt, spawn_server, BenchArgs};
use crate::SerialEngine;

/// (TTFT seconds, decode tok/s) of one generation.
type Sample = (f64, f64);

pub async fn run(a: &BenchArgs) -> Result<()> {
    let path = crate::server::resolve_model(&a.tokenizer).map_err(anyhow::Error::msg)?;
    let loaded = p05_kv_cache::load::load(&path).with_context(|| path.display().to_string())?;
    let tok = Arc::new(loaded.tokenizer.context("the model has no tokenizer")?);
    let model = Arc::new(loaded.engine);
    let name = crate::server::served_name(&a.tokenizer);
    let serial: Arc<dyn Engine> = Arc::new(
        SerialEngine::start(model.clone(), tok.clone(), &name, 4).map_err(anyhow::Error::msg)?,
    );
    let url = spawn_server(serial).await?;
    let cfg = LoadConfig {
        base_url: url.clone(),
        model: Some(name),
        api: Api::Completions,
        arrival: Arrival::Closed { concurrency: 1 },
        max_concurrency: None,
        ignore_eos: true,
        temperature: 0.0,
        timeout: Duration::from_secs(a.timeout_s),
        slo: Slo::default(),
    };
    let http = reqwest::Client::new();
    let mut rng = Rng::new(a.seed);
    let out = a.output_len.max(2);
    let (mut direct, mut served): (Vec<Sample>, Vec<Sample>) = (Vec::new(), Vec::new());
    eprintln!(
        "overhead: {} reps, prompt {} tokens, {out} output tokens, p05 engine vs {url}",
        a.reps, a.input_len
    );
    // One warm-up each side, then A B / B A.
    for rep in 0..=a.reps {
        let (text, ids) = random_prompt(&tok, a.input_len, &mut rng)?;
        for side in 0..2 {
            let http_side = (side + rep) % 2 == 1;
            let sample = if http_side {
                let req = LoadRequest {
                    prompt: text.clone(),
                    prompt_len: ids.len(),
                    output_len: out,
                };
                let r = loadgen::send_one(&http, &cfg, &req, Instant::now()).await;
                anyhow::ensure!(
                    r.ok && r.output_len == out,
                    "HTTP side: {} ({} tokens)",
                    r.error,
                    r.output_len
                );
                anyhow::ensure!(
                    r.prompt_len == ids.len(),
                    "the server tokenized the prompt to {} tokens, not {}",
                    r.prompt_len,
                    ids.len()
                );
                (r.ttft, (out - 1) as f64 / (r.latency - r.ttft))
            } else {
                let (model, tok, ids) = (model.clone(), tok.clone(), ids.clone());
                tokio::task::spawn_blocking(move || direct_sample(&*model, &tok, &ids, out))
                    .await??
            };
            if rep > 0 {
                if http_side {
                    served.push(sample)
                } else {
                    direct.push(sample)
                }
            }
        }
    }
    let col = |v: &[Sample], f: fn(&Sample) -> f64| v.iter().map(f).collect::<Vec<f64>>();
    let ttft_ms = |v: &[Sample]| summarize(&col(v, |s| s.0 * 1e3));
    let (d_ttft, s_ttft) = (ttft_ms(&direct), ttft_ms(&served));
    let (d_rates, s_rates) = (col(&direct, |s| s.1), col(&served, |s| s.1));
    let (d_tps, s_tps) = (summarize(&d_rates).median, summarize(&s_rates).median);
    // Per-pair ratios: each rep ran both sides on the same prompt, back to back.
    let pair_ratio = |f: fn(&Sample) -> f64| {
        summarize(
            &direct
                .iter()
                .zip(&served)
                .map(|(d, s)| f(s) / f(d))
                .collect::<Vec<_>>(),
        )
    };
    let (ttft_ratio, tps_ratio) = (pair_ratio(|s| s.0), pair_ratio(|s| s.1));
    println!("                      p05 engine   via HTTP    ratio (median of pairs)");
    println!(
        "TTFT (ms, median)     {:>10.1} {:>10.1} {:>8.3}",
        d_ttft.median, s_ttft.median, ttft_ratio.median
    );
    println!(
        "TTFT (ms, p95)        {:>10.1} {:>10.1}",
        d_ttft.p95, s_ttft.p95
    );
    println!(
        "decode (tok/s, med)   {d_tps:>10.1} {s_tps:>10.1} {:>8.3}",
        tps_ratio.median
    );
    if !a.no_record {
        let tag = format!("overhead in{} out{out}", a.input_len);
        let mut rows = Vec::new();
        rows.extend(Row::median_p95(
            format!("{tag}: TTFT p05 engine alone"),
            d_ttft.median,
            d_ttft.p95,
            "ms",
            "",
        ));
        rows.extend(Row::median_p95(
            format!("{tag}: TTFT via HTTP server"),
            s_ttft.median,
            s_ttft.p95,
            "ms",
            "p05 + 1-2 ms (tokenize, socket, SSE)",
        ));
        rows.extend(Row::median_p95(
            format!("{tag}: TTFT ratio HTTP/engine, per-pair ratio"),
            ttft_ratio.median,
            ttft_ratio.p95,
            "x",
            "<= 1.05 (target)",
        ));
        // Decode tok/s is measured directly, one rate per generation.
        rows.extend(Row::rates_median_p5(
            format!("{tag}: decode p05 engine alone"),
            &d_rates,
            "tok/s",
            "",
        ));
        rows.extend(Row::rates_median_p5(
            format!("{tag}: decode via HTTP server"),
            &s_rates,
            "tok/s",
            "",
        ));
        rows.extend(Row::median_p95(
            format!("{tag}: decode ratio HTTP/engine, per-pair ratio"),
            tps_ratio.median,
            tps_ratio.p95,
            "x",
            ">= 0.95 (target)",
        ));
        Recorder::for_workspace(common::numbers::command_line("p06_server")).append(&rows)?;
    }
    Ok(())
}

fn direct_sample<M: common::Model>(
    model: &M,
    tok: &p04_transformer::Tokenizer,
    ids: &[u32],
    out: usize,
) -> Result<Sample> {
    let params = GenerateParams::greedy(out);
    let t0 = Instant::now();
    let mut g = Generator::start(model, tok, ids, &params).map_err(|e| anyhow::anyhow!("{e}"))?;
    g.next_token().map_err(|e| anyhow::anyhow!("{e}"))?;
    let ttft = t0.elapsed().as_secs_f64();
    while g
        .next_token()
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .is_some()
    {}
    let total = t0.elapsed().as_secs_f64();
    Ok((ttft, (out - 1) as f64 / (total - ttft)))
}
