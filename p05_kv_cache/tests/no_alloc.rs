//! After prefill and one warm-up step, a decode step makes no heap allocation
//! (single-threaded: rayon's job queues may allocate when threads are used).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use common::{Model, ModelInfo};
use p04_transformer::Llama;
use p05_kv_cache::llama_engine::LlamaEngine;

struct Counting;

thread_local! {
    /// Allocations by this thread (the harness's threads cannot interfere).
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

fn count() {
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: forwards to the system allocator, only counting calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        count();
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

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
    let before = ALLOCS.with(Cell::get);
    let mut tok = 2u32;
    for _ in 0..20 {
        engine.decode(tok, &mut cache, &mut logits).unwrap();
        tok = p05_kv_cache::sampling::argmax(&logits);
    }
    let after = ALLOCS.with(Cell::get);
    assert_eq!(
        after - before,
        0,
        "20 decode steps allocated {} times",
        after - before
    );
    // The counter sees allocations: a prefill makes a new cache.
    let before = ALLOCS.with(Cell::get);
    let _ = engine.prefill(&[1], 4).unwrap();
    assert!(ALLOCS.with(Cell::get) > before);
}
