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
        let (text, ids) = random_prompt(&tok, a.input_len, &mut rng);
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
    let med = |v: &[Sample], f: fn(&Sample) -> f64| {
        summarize(&v.iter().map(f).collect::<Vec<_>>()).median
    };
    let (d_ttft, s_ttft) = (med(&direct, |s| s.0) * 1e3, med(&served, |s| s.0) * 1e3);
    let (d_tps, s_tps) = (med(&direct, |s| s.1), med(&served, |s| s.1));
    println!("                      p05 engine   via HTTP    ratio");
    println!(
        "TTFT (ms, median)     {d_ttft:>10.1} {s_ttft:>10.1} {:>8.3}",
        s_ttft / d_ttft
    );
    println!(
        "decode (tok/s, med)   {d_tps:>10.1} {s_tps:>10.1} {:>8.3}",
        s_tps / d_tps
    );
    if !a.no_record {
        let tag = format!("overhead in{} out{out}", a.input_len);
        let rows = vec![
            Row::new(
                format!("{tag}: TTFT p05 engine alone (median)"),
                d_ttft,
                "ms",
            ),
            Row::new(
                format!("{tag}: TTFT via HTTP server (median)"),
                s_ttft,
                "ms",
            )
            .predicted("p05 + 1-2 ms (tokenize, socket, SSE)"),
            Row::new(
                format!("{tag}: TTFT ratio HTTP/engine"),
                s_ttft / d_ttft,
                "x",
            )
            .predicted("<= 1.05 (target)"),
            Row::new(
                format!("{tag}: decode p05 engine alone (median)"),
                d_tps,
                "tok/s",
            ),
            Row::new(
                format!("{tag}: decode via HTTP server (median)"),
                s_tps,
                "tok/s",
            ),
            Row::new(
                format!("{tag}: decode ratio HTTP/engine"),
                s_tps / d_tps,
                "x",
            )
            .predicted(">= 0.95 (target)"),
        ];
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
