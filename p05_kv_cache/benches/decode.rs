//! Criterion: what one generated token costs with a KV cache, split into
//! the forward step at two positions and the sampler on SmolLM2's 49,152
//! logits (greedy, and top-k/top-p with a repetition penalty).
//! `cargo bench -p p05_kv_cache` appends each benchmark's median and p95
//! (and criterion's own estimate) to numbers.md.

use criterion::{criterion_group, BenchmarkId, Criterion};
use p05_kv_cache::sampling::{Sampler, SamplingParams};

fn smollm2() -> p05_kv_cache::load::LoadedEngine {
    let path = common::assets::ensure(common::assets::Asset::SmolLm2)
        .unwrap_or_else(|e| panic!("SmolLM2 is needed: {e}"));
    p05_kv_cache::load::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn bench_decode_step(c: &mut Criterion) {
    let engine = smollm2().engine;
    let vocab = engine.model.cfg.vocab_size;
    let mut logits = vec![0.0f32; vocab];
    let mut g = c.benchmark_group("p05_decode_step_f32");
    g.sample_size(20);
    for pos in [16usize, 256] {
        // Fill the cache to `pos` once; each iteration decodes one token
        // there and rewinds (the written row is overwritten next time).
        let prompt: Vec<u32> = (0..pos as u32).map(|i| 1 + i * 97 % 4000).collect();
        let mut cache = engine.new_cache(pos + 1);
        engine
            .step(&prompt, &mut cache, &mut logits)
            .expect("prefill");
        g.bench_function(BenchmarkId::new("smollm2", pos), |b| {
            b.iter(|| {
                cache.kv.set_len(pos).expect("room for pos + 1");
                engine.step(&[42], &mut cache, &mut logits).expect("decode");
            })
        });
    }
    g.finish();
}

fn bench_sampler(c: &mut Criterion) {
    let vocab = 49_152;
    let mut rng = common::rng::Rng::new(7);
    let logits: Vec<f32> = (0..vocab)
        .map(|_| (rng.next_f64() * 20.0 - 10.0) as f32)
        .collect();
    // A language model's logits are peaked: a few dozen tokens far above
    // the rest (uniform logits make top-p keep thousands).
    let mut peaked = logits.clone();
    for i in 0..32 {
        peaked[i * 1531 % vocab] += 15.0;
    }
    let history: Vec<u32> = (0..256).map(|i| i * 131 % vocab as u32).collect();
    let mut g = c.benchmark_group("p05_sample_49152");
    let settings = [
        ("greedy", SamplingParams::greedy()),
        (
            "top_k50_top_p0.9_rep1.1",
            SamplingParams {
                temperature: 0.8,
                top_k: Some(50),
                top_p: 0.9,
                repetition_penalty: 1.1,
                ..SamplingParams::greedy()
            },
        ),
        (
            "top_p0.9",
            SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                ..SamplingParams::greedy()
            },
        ),
        (
            "top_p0.9_peaked",
            SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                ..SamplingParams::greedy()
            },
        ),
        (
            "temperature0.8",
            SamplingParams {
                temperature: 0.8,
                ..SamplingParams::greedy()
            },
        ),
    ];
    for (name, params) in settings {
        let mut sampler = Sampler::new(params).expect("valid settings");
        let src = if name.ends_with("peaked") {
            &peaked
        } else {
            &logits
        };
        let mut row = src.clone();
        g.bench_function(name, |b| {
            b.iter(|| {
                row.copy_from_slice(src);
                sampler.sample(&mut row, &history)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench_decode_step, bench_sampler);

/// criterion_main!, plus rows for numbers.md (`common::criterion_rows`).
fn main() {
    let since = std::time::SystemTime::now();
    benches();
    Criterion::default().configure_from_args().final_summary();
    common::criterion_rows::record_cargo_bench("p05_kv_cache", since);
}
