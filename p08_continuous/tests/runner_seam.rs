//! The runner seam on Project 08's contiguous caches, SmolLM2 (f32):
//! - every step's plan survives its binary encoding unchanged (what a
//!   remote runner would receive), through prefill chunks, decodes,
//!   parallel-sampling forks and frees;
//! - a sequence exported from one core after its first token and imported
//!   into a fresh one continues with the same tokens and logits, bit for
//!   bit, as one core doing it all.

mod support;

use p05_kv_cache::generate::GenerateParams;
use p08_continuous::runner::{KvOp, StepPlan};
use p08_continuous::{ContinuousConfig, EngineCore};
use support::smollm2;

fn config() -> ContinuousConfig {
    ContinuousConfig {
        max_num_batched_tokens: 32,
        max_num_seqs: 8,
        kv_cache_bytes: 1 << 28,
        max_passed_over: 8,
        max_waiting: 64,
        step_cost: None,
    }
}

#[test]
fn every_plan_round_trips_through_its_encoding() {
    let s = smollm2();
    let (model, tok) = (&*s.engine, &*s.tokenizer);
    let mut core = EngineCore::new(model, tok, &config()).unwrap();
    let prompt = tok.encode("In the morning the fishermen of the small harbour town checked their nets and talked about the weather.");
    let mut p = GenerateParams::greedy(6);
    p.sampling.temperature = 0.7;
    p.sampling.seed = Some(3);
    assert!(core.add_choices(&[1, 2, 3], &prompt, &p, b"").unwrap());
    assert!(core
        .add(4, &tok.encode("Hello"), &GenerateParams::greedy(3))
        .unwrap());
    let (mut plans, mut forks, mut frees) = (0, 0, 0);
    while core.has_work() {
        let out = core.step();
        assert!(out.failed.is_empty(), "{:?}", out.failed);
        let plan = core.last_plan();
        let bytes = plan.encode().unwrap();
        assert_eq!(&StepPlan::decode(&bytes).unwrap(), plan);
        plans += 1;
        forks += plan
            .ops
            .iter()
            .filter(|o| matches!(o, KvOp::Fork { .. }))
            .count();
        frees += plan
            .ops
            .iter()
            .filter(|o| matches!(o, KvOp::Free { .. }))
            .count();
    }
    assert!(plans > 4, "prefill chunks and decodes");
    assert_eq!(forks, 2, "the two other choices fork the first");
    assert!(frees >= 1, "finished sequences free their caches");
}

#[test]
fn a_contiguous_sequence_continues_exactly_on_another_core() {
    let s = smollm2();
    let (model, tok) = (&*s.engine, &*s.tokenizer);
    let prompt = tok.encode("Write a haiku about the sea in winter.");
    let p = GenerateParams::greedy(8);
    let run = |core: &mut p08_continuous::LocalCore<'_, _>, id, until: usize| {
        let mut rows = Vec::new();
        while core.has_work() && rows.len() < until {
            let out = core.step();
            for (o, (_, l)) in out.outputs.iter().zip(out.logits) {
                if o.id == id {
                    rows.push((o.step.token, l));
                }
            }
        }
        rows
    };
    let mut one = EngineCore::new(model, tok, &config()).unwrap();
    one.record_logits(true);
    assert!(one.add(1, &prompt, &p).unwrap());
    let want = run(&mut one, 1, usize::MAX);
    let mut a = EngineCore::new(model, tok, &config()).unwrap();
    a.record_logits(true);
    assert!(a.add(1, &prompt, &p).unwrap());
    let mut got = run(&mut a, 1, 1);
    let state = a.export(1).unwrap();
    let mut b = EngineCore::new(model, tok, &config()).unwrap();
    b.record_logits(true);
    b.import(9, &state, ()).map_err(|(e, _)| e).unwrap();
    got.extend(run(&mut b, 9, usize::MAX));
    assert_eq!(want.len(), got.len());
    for (i, ((wt, wl), (gt, gl))) in want.iter().zip(&got).enumerate() {
        assert_eq!(wt, gt, "token {i}");
        assert!(
            wl.iter().zip(gl).all(|(x, y)| x.to_bits() == y.to_bits()),
            "token {i}: logits differ"
        );
    }
}
