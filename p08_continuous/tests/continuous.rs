//! The continuous batcher's guarantees, step by step on SmolLM2 through
//! [`EngineCore`] (the same core the server's model thread drives):
//! - a mixed workload (staggered arrivals, different prompt lengths and
//!   `max_tokens`, chunked prefill, cancellations) gives every request the
//!   greedy tokens it gets alone from p05's generation;
//! - streams that are decoding receive a token in every step while a
//!   2,048-token prompt is prefilled chunk by chunk;
//! - preemption under a tiny K/V budget happens and changes no output.

mod support;

use std::collections::HashMap;

use common::batch::BatchModel;
use p04_transformer::Tokenizer;
use p05_kv_cache::generate::{generate, GenerateParams};
use p05_kv_cache::llama_engine::LlamaEngine;
use p08_continuous::core::StepOutput;
use p08_continuous::scheduler::SeqId;
use p08_continuous::{ContinuousConfig, EngineCore};
use support::smollm2;

/// What p05's single-sequence generation gives for (prompt, max_tokens).
fn alone(model: &LlamaEngine, tok: &Tokenizer, prompt: &[u32], n: usize) -> Vec<u32> {
    generate(model, tok, prompt, &GenerateParams::greedy(n), |_| {})
        .unwrap()
        .tokens
}

/// `n` token ids of ordinary English text.
fn text_ids(tok: &Tokenizer, n: usize, salt: &str) -> Vec<u32> {
    let base = format!(
        "{salt} In the morning the fishermen of the small harbour town checked their nets, \
         mended the torn ones and talked about the weather, the price of fuel and the old days. "
    );
    let mut ids = Vec::new();
    while ids.len() < n {
        ids.extend(tok.encode(&base));
    }
    ids.truncate(n);
    ids
}

fn config(budget: usize, seqs: usize, kv_positions: usize) -> ContinuousConfig {
    ContinuousConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: seqs,
        kv_cache_bytes: kv_positions * smollm2().engine.kv_shape().bytes_per_position(),
        max_passed_over: 8,
        max_waiting: 64,
        step_cost: None,
    }
}

/// Collect each sequence's tokens from a step's outputs.
fn record(out: &StepOutput, got: &mut HashMap<SeqId, Vec<u32>>, done: &mut Vec<SeqId>) {
    assert!(out.failed.is_empty(), "{:?}", out.failed);
    for o in &out.outputs {
        if o.is_token {
            got.entry(o.id).or_default().push(o.step.token);
        }
        if o.step.finish.is_some() {
            done.push(o.id);
        }
    }
}

#[test]
fn a_mixed_workload_gives_every_request_its_tokens_alone() {
    let s = smollm2();
    let (model, tok) = (&*s.engine, &*s.tokenizer);
    // (arrival step, prompt, max_tokens, cancel at step)
    let work: Vec<(usize, Vec<u32>, usize, Option<usize>)> = vec![
        (0, text_ids(tok, 5, "A"), 12, None),
        (0, text_ids(tok, 70, "B"), 9, None),
        (2, text_ids(tok, 1, "C"), 15, None),
        (3, text_ids(tok, 130, "D"), 6, None),
        (3, text_ids(tok, 20, "E"), 30, Some(14)),
        (7, text_ids(tok, 45, "F"), 4, None),
        (12, text_ids(tok, 33, "G"), 10, None),
    ];
    // A 48-token budget cuts the 70- and 130-token prompts into chunks.
    let mut core = EngineCore::new(model, tok, &config(48, 5, 100_000)).unwrap();
    let mut got: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let mut done = Vec::new();
    let mut chunked = 0;
    for step in 0..500 {
        for (i, (at, prompt, n, _)) in work.iter().enumerate() {
            if *at == step {
                assert!(core
                    .add(i as SeqId, prompt, &GenerateParams::greedy(*n))
                    .unwrap());
            }
        }
        for (i, w) in work.iter().enumerate() {
            if w.3 == Some(step) {
                assert!(core.abort(i as SeqId).is_some(), "request {i} ended early");
            }
        }
        let out = core.step();
        chunked += out.schedule.seqs.iter().filter(|c| !c.samples).count();
        record(&out, &mut got, &mut done);
        if step > 12 && !core.has_work() {
            break;
        }
    }
    assert!(chunked >= 3, "prompts were chunked: {chunked} chunks");
    assert!(!core.has_work());
    for (i, (_, prompt, n, cancel)) in work.iter().enumerate() {
        let want = alone(model, tok, prompt, *n);
        let have = got.remove(&(i as SeqId)).unwrap_or_default();
        match cancel {
            None => {
                assert!(done.contains(&(i as SeqId)));
                assert_eq!(have, want, "request {i}");
            }
            // A cancelled one stopped early; what it got was right.
            Some(_) => {
                assert!(!done.contains(&(i as SeqId)));
                assert!(
                    !have.is_empty() && have.len() < *n,
                    "request {i}: {}",
                    have.len()
                );
                assert_eq!(have, want[..have.len()], "request {i}");
            }
        }
    }
}

#[test]
fn running_streams_get_a_token_every_step_while_a_long_prompt_is_prefilled() {
    let s = smollm2();
    let (model, tok) = (&*s.engine, &*s.tokenizer);
    let budget = 128;
    let mut core = EngineCore::new(model, tok, &config(budget, 8, 100_000)).unwrap();
    for id in 0..4 {
        core.add(
            id,
            &text_ids(tok, 8 + id as usize, "x"),
            &GenerateParams::greedy(200),
        )
        .unwrap();
    }
    core.step(); // the four prompts
    let long = text_ids(tok, 2048, "long");
    core.add(99, &long, &GenerateParams::greedy(4)).unwrap();
    let mut prefill_steps = 0;
    let mut prefilled = 0;
    loop {
        let out = core.step();
        let decoded: Vec<SeqId> = out
            .outputs
            .iter()
            .filter(|o| o.is_token && o.id < 4)
            .map(|o| o.id)
            .collect();
        assert_eq!(
            decoded,
            [0, 1, 2, 3],
            "step {prefill_steps}: {:?}",
            out.schedule
        );
        let chunk = out.schedule.seqs.iter().find(|c| c.id == 99).unwrap();
        assert!(chunk.len <= budget - 4);
        prefilled += chunk.len;
        prefill_steps += 1;
        if chunk.samples {
            break;
        }
    }
    assert_eq!(prefilled, 2048);
    assert_eq!(prefill_steps, 2048usize.div_ceil(budget - 4));
    eprintln!("2048-token prompt prefilled in {prefill_steps} steps, 4 streams decoding in each");
}

#[test]
fn preemption_under_a_tiny_kv_budget_changes_no_output() {
    let s = smollm2();
    let (model, tok) = (&*s.engine, &*s.tokenizer);
    // 160 positions for four requests that each grow past 60.
    let work: Vec<(Vec<u32>, usize)> = (0..4)
        .map(|i| (text_ids(tok, 20 + 7 * i, &format!("{i}")), 40 + 5 * i))
        .collect();
    let mut core = EngineCore::new(model, tok, &config(64, 4, 160)).unwrap();
    for (i, (p, n)) in work.iter().enumerate() {
        core.add(i as SeqId, p, &GenerateParams::greedy(*n))
            .unwrap();
    }
    let mut got = HashMap::new();
    let mut done = Vec::new();
    let mut preempted = 0;
    for _ in 0..2000 {
        let out = core.step();
        preempted += out.schedule.preempted.len();
        record(&out, &mut got, &mut done);
        assert!(core.kv_bytes() <= core.kv_capacity_bytes());
        if !core.has_work() {
            break;
        }
    }
    assert!(!core.has_work(), "the workload finished");
    assert!(preempted > 0, "the budget forced a preemption");
    assert_eq!(core.scheduler().preemptions(), preempted as u64);
    for (i, (p, n)) in work.iter().enumerate() {
        assert_eq!(got[&(i as SeqId)], alone(model, tok, p, *n), "request {i}");
    }
    eprintln!("{preempted} preemptions, outputs unchanged");
}

#[test]
fn requests_that_cannot_fit_even_alone_are_refused() {
    let s = smollm2();
    let mut core = EngineCore::new(&*s.engine, &s.tokenizer, &config(64, 4, 100)).unwrap();
    let e = core
        .add(0, &[1, 2, 3], &GenerateParams::greedy(200))
        .unwrap_err();
    assert!(e.to_string().contains("K/V positions"), "{e}");
    assert!(!core.has_work());
    // 100 positions of SmolLM2's K/V shape: what the budget was divided by.
    let shape = s.engine.kv_shape();
    assert_eq!(
        (shape.n_layer, shape.n_kv_head, shape.head_dim),
        (30, 3, 64)
    );
}
