//! A paged sequence handed from one core to another, on SmolLM2 (f32),
//! its K/V landing straight in blocks the receiving core reserved and
//! lent out (Project 14's decode worker does this on its pull thread):
//! - the sequence continues with the same tokens and logits, bit for bit,
//!   as one core doing it all, whether it arrives through a buffer
//!   (`import`) or through lent blocks (`reserve_import`, `take_back`,
//!   `import_reserved`);
//! - while the blocks are lent the receiving core keeps stepping its
//!   other sequences, and their outputs do not change;
//! - a cancelled reservation, lent or home, gives every block back.

mod support;

use common::batch::BatchModel;
use p05_kv_cache::generate::GenerateParams;
use p05_kv_cache::llama_engine::LlamaEngine;
use p08_continuous::handoff::HandoffError;
use p08_continuous::kv_transfer::KvBuffer;
use p08_continuous::scheduler::SeqId;
use p08_continuous::{ContinuousConfig, EngineCore, LocalCore};
use p09_kv_manager::{BlockPool, KvManager, PagedKv};
use support::smollm2;

type Core = LocalCore<'static, LlamaEngine, PagedKv>;

fn core(blocks: usize) -> Core {
    let m = smollm2();
    let engine: &'static LlamaEngine = &m.engine;
    let tok = &*m.tokenizer;
    let config = ContinuousConfig {
        max_num_batched_tokens: 32,
        max_num_seqs: 8,
        kv_cache_bytes: 0, // the pool is sized by its blocks here
        max_passed_over: 8,
        max_waiting: 64,
        step_cost: None,
    };
    let pool = BlockPool::new(engine.kv_shape(), 16, blocks).unwrap();
    let kv = PagedKv::from_manager(KvManager::new(pool, true));
    let mut c = EngineCore::with_backend(engine, tok, &config, kv).unwrap();
    c.record_logits(true);
    c
}

/// Step until `id` has `until` more tokens (or nothing runs): its
/// (token, logits) rows, and every other sequence's tokens.
#[allow(clippy::type_complexity)]
fn run(core: &mut Core, id: SeqId, until: usize) -> (Vec<(u32, Vec<f32>)>, Vec<(SeqId, u32)>) {
    let (mut rows, mut others) = (Vec::new(), Vec::new());
    while core.has_work() && rows.len() < until {
        let out = core.step();
        assert!(out.failed.is_empty(), "{:?}", out.failed);
        for (o, (_, l)) in out.outputs.iter().zip(out.logits) {
            if o.id == id {
                rows.push((o.step.token, l));
            } else if o.is_token {
                others.push((o.id, o.step.token));
            }
        }
    }
    (rows, others)
}

fn same(want: &[(u32, Vec<f32>)], got: &[(u32, Vec<f32>)]) {
    assert_eq!(want.len(), got.len());
    for (i, ((wt, wl), (gt, gl))) in want.iter().zip(got).enumerate() {
        assert_eq!(wt, gt, "token {i}");
        assert!(
            wl.iter().zip(gl).all(|(x, y)| x.to_bits() == y.to_bits()),
            "token {i}: logits differ"
        );
    }
}

fn prompt() -> Vec<u32> {
    // 40 tokens or so: several blocks of 16, the last one partly full.
    smollm2().tokenizer.encode(
        "The keeper of the lighthouse wrote in his log every evening: the wind, \
         the ships that passed, the colour of the sea and the names of the birds.",
    )
}

#[test]
fn a_paged_sequence_continues_exactly_through_a_buffer_or_lent_blocks() {
    let prompt = prompt();
    let p = GenerateParams::greedy(8);
    let other = smollm2().tokenizer.encode("Hello, how are you?");

    let mut one = core(64);
    assert!(one.add(1, &prompt, &p).unwrap());
    let (want, _) = run(&mut one, 1, usize::MAX);
    let mut alone = core(64);
    assert!(alone.add(2, &other, &GenerateParams::greedy(6)).unwrap());
    let (_, other_alone) = run(&mut alone, 0, usize::MAX);

    // The sender: prefill and the first token, then export.
    let mut a = core(64);
    assert!(a.add(1, &prompt, &p).unwrap());
    let (first, _) = run(&mut a, 1, 1);
    let state = a.export(1).unwrap();
    assert_eq!(state.kv.tokens, prompt.len());

    // Through a buffer.
    let mut b = core(64);
    b.import(9, &state, ()).map_err(|(e, _)| e).unwrap();
    let mut got = first.clone();
    got.extend(run(&mut b, 9, usize::MAX).0);
    same(&want, &got);

    // Through lent blocks, while another sequence runs on the receiver.
    let mut c = core(64);
    assert!(c.add(2, &other, &GenerateParams::greedy(6)).unwrap());
    let mut lease = c
        .reserve_import(9, &prompt, prompt.len() + 8)
        .unwrap()
        .expect("paged storage lends its blocks");
    assert_eq!(lease.blocks.len(), prompt.len().div_ceil(16));
    let (_, mut other_got) = run(&mut c, 0, usize::MAX);
    assert!(!c.has_work(), "the other sequence ran to its end meanwhile");
    for (i, (_, mem)) in lease.blocks.iter_mut().enumerate() {
        mem.copy_from_slice(state.kv.block(i));
    }
    c.take_back(9, lease).unwrap();
    let mut landed = state.clone();
    landed.kv = KvBuffer::zeros(state.kv.layout, 0);
    c.import_reserved(9, &landed, ())
        .map_err(|(e, _)| e)
        .unwrap();
    assert_eq!(c.num_reserved(), 0);
    let mut got = first.clone();
    let (rest, more) = run(&mut c, 9, usize::MAX);
    got.extend(rest);
    other_got.extend(more);
    same(&want, &got);
    assert_eq!(other_got, other_alone, "the other sequence is unchanged");
}

#[test]
fn a_reservation_refuses_what_does_not_fit_and_cancelling_it_frees_every_block() {
    let prompt = prompt();
    let mut c = core(8);
    let used = |c: &Core| c.kv().manager().used_blocks();
    // 3 blocks of 16 for ~40 positions (and one more); 8 blocks hold 128.
    assert!(matches!(
        c.reserve_import(1, &prompt, 129),
        Err(HandoffError::TooLong { .. })
    ));
    assert_eq!(used(&c), 0);
    let lease = c.reserve_import(1, &prompt, 64).unwrap().unwrap();
    let held = used(&c);
    assert_eq!(held, (prompt.len() + 1).div_ceil(16));
    assert!(matches!(
        c.reserve_import(1, &prompt, 64),
        Err(HandoffError::Duplicate(1))
    ));
    // A second one finds too few free blocks.
    let mut big = prompt.clone();
    big.extend_from_slice(&prompt);
    big.extend_from_slice(&prompt);
    assert!(matches!(
        c.reserve_import(2, &big, 127),
        Err(HandoffError::Busy(2))
    ));
    assert_eq!(used(&c), held);
    // Lent and lost: cancelling restores the memory and frees the blocks,
    // and the pool serves a request afterwards.
    drop(lease);
    c.cancel_import(1);
    assert_eq!(used(&c), 0);
    assert_eq!(c.num_reserved(), 0);
    let lease = c.reserve_import(3, &prompt, 64).unwrap().unwrap();
    c.take_back(3, lease).unwrap();
    c.cancel_import(3);
    assert_eq!(used(&c), 0);
    assert!(c.add(4, &prompt, &GenerateParams::greedy(4)).unwrap());
    let (rows, _) = run(&mut c, 4, usize::MAX);
    assert_eq!(rows.len(), 4);
}
