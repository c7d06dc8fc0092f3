//! Prefill + decode with the KV cache against a full recompute (p04's
//! forward) at every step, and SmolLM2's greedy continuations against the
//! transformers fixtures.

use common::{Model, ModelInfo};
use p04_transformer::{GgufFile, Llama};
use p05_kv_cache::generate::{GenerateParams, Generator};
use p05_kv_cache::llama_engine::LlamaEngine;
use p05_kv_cache::sampling::{argmax, SamplingParams};

fn info(vocab: usize, ctx: usize) -> ModelInfo {
    ModelInfo {
        name: "test".into(),
        vocab_size: vocab,
        context_length: ctx,
        bos_id: None,
        stop_ids: vec![],
    }
}

fn last_row(t: &common::Tensor) -> Vec<f32> {
    let v = *t.shape().last().unwrap();
    t.data()[t.numel() - v..].to_vec()
}

/// Cached decode vs recompute for `steps` greedy tokens; returns the worst
/// |diff| relative to the logit scale (max |logit|).
fn compare(engine: &LlamaEngine, prompt: &[u32], steps: usize) -> f32 {
    let m = &engine.model;
    let (mut logits, mut cache) = engine.prefill(prompt, prompt.len() + steps).unwrap();
    let mut seq = prompt.to_vec();
    let mut worst = 0.0f32;
    for step in 0..=steps {
        let full = last_row(&m.forward(&seq, 1, seq.len()).unwrap());
        let scale = full.iter().fold(0.0f32, |a, &x| a.max(x.abs()));
        let diff = logits
            .iter()
            .zip(&full)
            .fold(0.0f32, |a, (x, y)| a.max((x - y).abs()));
        worst = worst.max(diff / scale);
        if step == steps {
            break;
        }
        let next = argmax(&full);
        assert_eq!(
            argmax(&logits),
            next,
            "step {step}: cached and full argmax differ"
        );
        seq.push(next);
        engine.decode(next, &mut cache, &mut logits).unwrap();
    }
    worst
}

#[test]
fn tiny_llama_cache_equals_full_recompute_at_every_step() {
    let model = Llama::from_hf_dir(&p04_transformer::fixtures_dir().join("tiny_llama")).unwrap();
    let engine = LlamaEngine::new(model, info(101, 64));
    for prompt in [
        vec![5u32],
        vec![3, 1, 4, 1, 5, 9, 2],
        (0..20).map(|i| (i * 7 + 3) % 101).collect(),
    ] {
        let worst = compare(&engine, &prompt, 20);
        eprintln!(
            "tiny llama prompt len {}: worst relative |diff| {worst:e}",
            prompt.len()
        );
        assert!(
            worst <= 1e-5,
            "prompt {prompt:?}: worst relative |diff| {worst:e}"
        );
    }
}

#[test]
fn smollm2_cached_greedy_matches_transformers_and_recompute() {
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).unwrap_or_else(|e| panic!("{e}"));
    let file = GgufFile::open(&path).unwrap();
    let tok = p04_transformer::Tokenizer::from_gguf(&file.header).unwrap();
    let model = Llama::from_gguf(&file).unwrap();
    let engine = LlamaEngine::new(model, info(49152, 8192));
    let fx = common::st::load(&p04_transformer::fixtures_dir().join("smollm2_parity.safetensors"))
        .unwrap();
    for p in 0..5 {
        let prompt: Vec<u32> = fx
            .ints(&format!("p{p}/ids"))
            .unwrap()
            .1
            .iter()
            .map(|&v| v as u32)
            .collect();
        let want: Vec<u32> = fx
            .ints(&format!("p{p}/greedy"))
            .unwrap()
            .1
            .iter()
            .map(|&v| v as u32)
            .collect();
        let (mut logits, mut cache) = engine.prefill(&prompt, prompt.len() + 32).unwrap();
        let mut got = Vec::new();
        for _ in 0..32 {
            let next = argmax(&logits);
            got.push(next);
            engine.decode(next, &mut cache, &mut logits).unwrap();
        }
        assert_eq!(got, want, "prompt {p}: cached greedy continuation");
        assert_eq!(cache.kv.len(), prompt.len() + 32);
        // The step-at-a-time Generator the server drives: same tokens, same
        // text, and a log-probability for each (the greedy token is the top one).
        let params = GenerateParams {
            max_tokens: 32,
            sampling: SamplingParams::greedy(),
            stop_ids: vec![],
            stop_strings: vec![],
            ignore_eos: true,
            min_tokens: 0,
            logprobs: Some(3),
        };
        let mut g = Generator::start(&engine, &tok, &prompt, &params).unwrap();
        let mut text = String::new();
        let mut steps = Vec::new();
        while let Some(step) = g.next_token().unwrap() {
            text.push_str(&step.text);
            assert_eq!(step.top_logprobs.len(), 3);
            assert_eq!(step.top_logprobs[0].0, step.token, "greedy = top logprob");
            assert_eq!(step.logprob, Some(step.top_logprobs[0].1));
            steps.push(step.token);
        }
        assert_eq!(steps, want, "prompt {p}: Generator tokens");
        assert_eq!(text, tok.decode(&want), "prompt {p}: Generator text");
    }
    // Logits against a full recompute for a few steps of the chat prompt.
    let prompt: Vec<u32> = fx
        .ints("p4/ids")
        .unwrap()
        .1
        .iter()
        .map(|&v| v as u32)
        .collect();
    let worst = compare(&engine, &prompt, 4);
    // The cached prefill computes attention as two matmuls per head (QK^T,
    // then PV) while the recompute sums per query: the same math in another
    // f32 order, so the logits differ by rounding only. Measured 1.7e-6 of
    // the logit scale (the size of our gap to transformers, 5.2e-5 absolute
    // at scale ~30); held to the 1e-5 of scale, with the greedy
    // tokens above exact.
    eprintln!("SmolLM2 cached vs recompute: worst relative |diff| {worst:e}");
    assert!(
        worst <= 1e-5,
        "SmolLM2 cached vs recompute: worst relative |diff| {worst:e}"
    );
}

#[test]
fn full_cache_and_bad_tokens_are_errors() {
    let model = Llama::from_hf_dir(&p04_transformer::fixtures_dir().join("tiny_llama")).unwrap();
    let engine = LlamaEngine::new(model, info(101, 64));
    let (mut logits, mut cache) = engine.prefill(&[1, 2, 3], 4).unwrap();
    engine.decode(4, &mut cache, &mut logits).unwrap();
    let e = engine
        .decode(5, &mut cache, &mut logits)
        .unwrap_err()
        .to_string();
    assert!(e.contains("KV cache is full: 4 of 4"), "{e}");
    let (mut logits, mut cache) = engine.prefill(&[1], 8).unwrap();
    let e = engine
        .decode(101, &mut cache, &mut logits)
        .unwrap_err()
        .to_string();
    assert!(e.contains("token id 101"), "{e}");
    assert!(engine.prefill(&[], 8).is_err());
    assert!(
        engine.prefill(&[1; 10], 65).is_err(),
        "longer than the context"
    );
    assert_eq!(
        cache.kv.allocated_bytes(),
        p05_kv_cache::kv_cache::KvCache::formula_bytes(2, 2, 8, 8)
    );
}

#[test]
fn tiny_gpt2_cache_equals_full_recompute_at_every_step() {
    use p05_kv_cache::gpt2_engine::Gpt2Engine;
    let model =
        p04_transformer::Gpt2::from_hf_dir(&p04_transformer::fixtures_dir().join("tiny_gpt2"))
            .unwrap();
    let engine = Gpt2Engine::new(model, info(101, 64));
    for prompt in [vec![7u32], vec![3, 1, 4, 1, 5, 9, 2]] {
        let (mut logits, mut cache) = engine.prefill(&prompt, prompt.len() + 20).unwrap();
        let mut seq = prompt.clone();
        for step in 0..=20 {
            let full = last_row(&engine.model.forward(&seq, 1, seq.len()).unwrap());
            let scale = full.iter().fold(0.0f32, |a, &x| a.max(x.abs()));
            let diff = logits
                .iter()
                .zip(&full)
                .fold(0.0f32, |a, (x, y)| a.max((x - y).abs()));
            assert!(
                diff <= 1e-5 * scale,
                "step {step}: |diff| {diff:e} vs scale {scale}"
            );
            if step == 20 {
                break;
            }
            let next = argmax(&full);
            seq.push(next);
            engine.decode(next, &mut cache, &mut logits).unwrap();
        }
    }
}
