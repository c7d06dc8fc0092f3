//! A sequence handed from one engine to another continues exactly: engine
//! A prefills a prompt and samples the first token, exports the sequence
//! (tokens, settings, sampler position, K/V) and drops it; a fresh engine
//! B, already busy with other requests, imports it and decodes the rest.
//! Every token and every logits row equals one engine doing it all, bit
//! for bit, with greedy and with seeded sampling, on native weights and on
//! f32 (the serving core is batch-invariant, so B's neighbours change
//! nothing). The transfer is Project 14's prefill-to-decode hand-off in
//! one process.

mod support;

use std::collections::HashMap;

use common::batch::BatchModel;
use p05_kv_cache::generate::GenerateParams;
use p05_kv_cache::llama_engine::LlamaEngine;
use p08_continuous::handoff::HandoffError;
use p08_continuous::kv_transfer::TransferError;
use p08_continuous::scheduler::SeqId;
use p08_continuous::{ContinuousConfig, EngineCore, LocalCore};
use p09_kv_manager::{BlockPool, KvManager, PagedKv};
use support::{f32_model, native, Model};

const PROMPTS: [&str; 3] = [
    "What is the capital of France?",
    "Write a haiku about the sea in winter.",
    "The old lighthouse keeper opened his log and wrote:",
];

const NEIGHBOURS: [&str; 2] = [
    "Once upon a time, in a village at the edge of a great forest, there lived a miller who",
    "Name the planets of the solar system in order from the sun.",
];

fn config() -> ContinuousConfig {
    ContinuousConfig {
        max_num_batched_tokens: 512,
        max_num_seqs: 8,
        kv_cache_bytes: 0, // the pool is sized by its blocks here
        max_passed_over: 8,
        max_waiting: 64,
        step_cost: None,
    }
}

fn paged(engine: &LlamaEngine, block_size: usize) -> PagedKv {
    let pool = BlockPool::new(engine.kv_shape(), block_size, 128).unwrap();
    PagedKv::from_manager(KvManager::new(pool, true))
}

fn params(seeded: bool, i: usize) -> GenerateParams {
    let mut p = GenerateParams::greedy(12);
    if seeded {
        p.sampling.temperature = 0.8;
        p.sampling.top_p = 0.95;
        p.sampling.seed = Some(500 + i as u64);
    }
    p
}

/// (token, logits row) of each of `id`'s sampling steps in `out`.
type Rows = Vec<(u32, Vec<f32>)>;

/// Step `core` until `id` has sampled `until` more times (or finished);
/// its rows.
fn steps(core: &mut LocalCore<'_, LlamaEngine, PagedKv>, id: SeqId, until: usize) -> Rows {
    let mut rows = Rows::new();
    for _ in 0..1000 {
        let out = core.step();
        assert!(out.failed.is_empty(), "{:?}", out.failed);
        let mut logits: HashMap<SeqId, Vec<f32>> = out.logits.into_iter().collect();
        let mut done = false;
        for o in out.outputs.iter().filter(|o| o.id == id) {
            rows.push((o.step.token, logits.remove(&id).expect("recorded")));
            done = o.step.finish.is_some();
        }
        if done || rows.len() == until {
            return rows;
        }
    }
    panic!("request {id} did not get {until} samples");
}

fn assert_same(label: &str, want: &Rows, got: &Rows) {
    assert_eq!(want.len(), got.len(), "{label}: samples");
    for (i, ((wt, wl), (gt, gl))) in want.iter().zip(got).enumerate() {
        let k = wl
            .iter()
            .zip(gl)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(k.is_none(), "{label}, token {i}: logit {k:?} differs");
        assert_eq!(wt, gt, "{label}, token {i}");
    }
}

fn check(m: &Model, name: &str, seeded: bool) {
    for (i, text) in PROMPTS.iter().enumerate() {
        let prompt = m.tok.encode(text);
        let p = params(seeded, i);
        // One engine doing it all.
        let mut one =
            EngineCore::with_backend(&m.engine, &m.tok, &config(), paged(&m.engine, 16)).unwrap();
        one.record_logits(true);
        assert!(one.add(1, &prompt, &p).unwrap());
        let want = steps(&mut one, 1, usize::MAX);
        // A: the prompt and the first token.
        let mut a =
            EngineCore::with_backend(&m.engine, &m.tok, &config(), paged(&m.engine, 16)).unwrap();
        a.record_logits(true);
        assert!(a.add(1, &prompt, &p).unwrap());
        let mut got = steps(&mut a, 1, 1);
        let state = a.export(1).unwrap();
        assert_eq!(state.kv.tokens, prompt.len(), "the prompt's K/V crosses");
        assert!(a.abort(1).is_some());
        assert_eq!(a.kv().manager().used_blocks(), 0, "A keeps nothing");
        // B: busy with two other requests, then the imported one.
        let mut b =
            EngineCore::with_backend(&m.engine, &m.tok, &config(), paged(&m.engine, 16)).unwrap();
        b.record_logits(true);
        for (j, n) in NEIGHBOURS.iter().enumerate() {
            let ids = m.tok.encode(n);
            assert!(b
                .add(100 + j as SeqId, &ids, &params(seeded, 9 + j))
                .unwrap());
        }
        let _ = steps(&mut b, 100, 3);
        b.import(42, &state, ()).map_err(|(e, _)| e).unwrap();
        got.extend(steps(&mut b, 42, usize::MAX));
        assert_same(&format!("{name}, prompt {i}"), &want, &got);
    }
}

#[test]
fn a_native_sequence_continues_exactly_on_another_engine() {
    check(native(), "native greedy", false);
    check(native(), "native seeded", true);
}

#[test]
fn an_f32_sequence_continues_exactly_on_another_engine() {
    check(f32_model(), "f32 greedy", false);
    check(f32_model(), "f32 seeded", true);
}

/// A buffer of another block size, or a truncated one, is refused before
/// any block is written, and the refused sequence holds nothing.
#[test]
fn an_import_of_another_layout_is_refused_and_holds_nothing() {
    let m = f32_model();
    let core = |block_size| {
        EngineCore::with_backend(&m.engine, &m.tok, &config(), paged(&m.engine, block_size))
            .unwrap()
    };
    let mut a = core(16);
    assert!(a
        .add(1, &m.tok.encode(PROMPTS[0]), &params(false, 0))
        .unwrap());
    assert!(matches!(a.export(1), Err(HandoffError::NotStarted(1))));
    assert_eq!(a.step().outputs.len(), 1, "the prompt and its first sample");
    let state = a.export(1).unwrap();
    let mut short = state.clone();
    short.kv.data.pop();
    for (block_size, state) in [(8, &state), (16, &short)] {
        let mut b = core(block_size);
        let err = b.import(7, state, ()).map_err(|(e, _)| e).unwrap_err();
        let want = match block_size {
            8 => matches!(err, HandoffError::Transfer(TransferError::Layout { .. })),
            _ => matches!(err, HandoffError::Transfer(TransferError::Size { .. })),
        };
        assert!(want, "block size {block_size}: {err:?}");
        assert_eq!(b.kv().manager().used_blocks(), 0);
        assert!(!b.has_work());
    }
}
