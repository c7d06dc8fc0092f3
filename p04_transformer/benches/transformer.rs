//! Criterion: SmolLM2-135M's tokenizer and its uncached forward pass (f32),
//! the two costs Project 04 builds. `cargo bench -p p04_transformer`
//! appends each benchmark's median and p95 (and criterion's own estimate)
//! to numbers.md.
//!
//! The model comes through `scripts/fetch_assets.sh smollm2` (run here if
//! missing; the error names the command when it cannot be fetched).

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use p04_transformer::model::Transformer;

fn smollm2() -> p04_transformer::model::LoadedTransformer {
    let path = common::assets::ensure(common::assets::Asset::SmolLm2)
        .unwrap_or_else(|e| panic!("SmolLM2 is needed: {e}"));
    Transformer::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// An English paragraph (about 1 KB): the prompt-shaped case.
const PARAGRAPH: &str = "The KV cache stores the keys and values of every token the model has \
already seen, so that each new token attends to them without recomputing the whole prefix. \
Its size grows with the number of layers, heads, head dimension and positions: for a small \
model it is a few megabytes per thousand tokens, for a large one it dominates the memory of \
a serving machine. Paged attention splits it into fixed-size blocks so that sequences of \
different lengths share one pool without fragmentation, and prefix caching lets requests \
with the same system prompt reuse the blocks computed once. Continuous batching then keeps \
the accelerator busy by letting requests join and leave the batch at every step.";

fn bench_tokenize(c: &mut Criterion) {
    let tok = smollm2()
        .tokenizer
        .expect("SmolLM2's GGUF carries its tokenizer");
    let mut g = c.benchmark_group("p04_tokenize");
    let run = "a".repeat(12_500);
    for (name, text) in [("paragraph", PARAGRAPH), ("a_x12500", run.as_str())] {
        g.throughput(Throughput::Bytes(text.len() as u64));
        g.bench_with_input(BenchmarkId::new("encode", name), text, |b, t| {
            b.iter(|| tok.encode(t))
        });
    }
    g.finish();
}

fn bench_forward(c: &mut Criterion) {
    let model = smollm2().model;
    let mut g = c.benchmark_group("p04_forward_f32");
    g.sample_size(10);
    for seq in [1usize, 16] {
        let ids: Vec<u32> = (0..seq as u32).map(|i| 1 + i * 97 % 4000).collect();
        g.throughput(Throughput::Elements(seq as u64));
        g.bench_with_input(BenchmarkId::new("smollm2_no_cache", seq), &ids, |b, ids| {
            b.iter(|| model.forward(ids, 1, ids.len()).expect("valid ids"))
        });
    }
    g.finish();
}

criterion_group!(benches, bench_tokenize, bench_forward);

/// criterion_main!, plus rows for numbers.md (`common::criterion_rows`).
fn main() {
    let since = std::time::SystemTime::now();
    benches();
    Criterion::default().configure_from_args().final_summary();
    common::criterion_rows::record_cargo_bench("p04_transformer", since);
}
