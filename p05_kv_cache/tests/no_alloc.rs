//! After prefill and one warm-up step, a decode step makes no heap allocation
//! (single-threaded: rayon's job queues may allocate when threads are used).

use common::alloc_count::count;
use common::{Model, ModelInfo};
use p04_transformer::Llama;
use p05_kv_cache::llama_engine::LlamaEngine;

#[global_allocator]
static GLOBAL: common::alloc_count::Counting = common::alloc_count::Counting;

#[test]
fn decode_step_allocates_nothing_after_warmup() {
    let mut model =
        Llama::from_hf_dir(&p04_transformer::fixtures_dir().join("tiny_llama")).unwrap();
    model.threads = 1;
    let info = ModelInfo {
        name: "tiny".into(),
        vocab_size: 101,
        context_length: 64,
        bos_id: None,
        stop_ids: vec![],
    };
    let engine = LlamaEngine::new(model, info);
    let (mut logits, mut cache) = engine.prefill(&[3, 1, 4, 1, 5], 40).unwrap();
    engine.decode(9, &mut cache, &mut logits).unwrap(); // warm-up
    let before = count();
    let mut tok = 2u32;
    for _ in 0..20 {
        engine.decode(tok, &mut cache, &mut logits).unwrap();
        tok = p05_kv_cache::sampling::argmax(&logits);
    }
    let after = count();
    assert_eq!(
        after - before,
        0,
        "20 decode steps allocated {} times",
        after - before
    );
    // The counter sees allocations: a prefill makes a new cache.
    let before = count();
    let _ = engine.prefill(&[1], 4).unwrap();
    assert!(count() > before);
}
