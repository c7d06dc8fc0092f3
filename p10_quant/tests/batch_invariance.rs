//! Batch invariance on SmolLM2, through the serving core (Project 08's
//! continuous batcher on Project 09's paged K/V): 8 prompts run alone,
//! then among 8 others arriving at other steps, under step token budgets
//! of 16, 64 and 512 (so the prompts are chunked differently and share
//! their steps with other prompts' chunks and other streams' decodes), in
//! a pool small enough to preempt, and again after their prefixes are in
//! the cache. Every sampled token's logits row must equal the solo run's
//! bit for bit, on native weights (greedy and seeded sampling) and f32.

use std::collections::HashMap;

use common::batch::BatchModel;
use p04_transformer::Tokenizer;
use p05_kv_cache::generate::GenerateParams;
use p05_kv_cache::llama_engine::LlamaEngine;
use p08_continuous::scheduler::SeqId;
use p08_continuous::{ContinuousConfig, EngineCore, LocalCore};
use p09_kv_manager::{BlockPool, KvManager, PagedKv};

mod support;

use support::{f32_model, native, Model};

const TARGETS: [&str; 8] = [
    "What is the capital of France?",
    "Write a haiku about the sea in winter.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "The old lighthouse keeper opened his log and wrote:",
    "Translate to French: the cat sleeps on the warm windowsill.",
    "def fibonacci(n):",
    "Give me a short recipe for pancakes.",
];

const OTHERS: [&str; 8] = [
    "Once upon a time, in a village at the edge of a great forest, there lived a miller who",
    "Summarise the plot of a story about a robot learning to paint.",
    "How many legs does a spider have?",
    "The weather report for tomorrow says",
    "Name the planets of the solar system in order from the sun.",
    "Why do leaves change colour in autumn? Answer for a child.",
    "SELECT name FROM users WHERE",
    "A train leaves the station at noon travelling at sixty miles an hour;",
];

/// A shared system text (two full 16-position blocks and more), so
/// prompts share cached prefixes.
const PREAMBLE: &str =
    "You are a helpful assistant. Answer briefly and clearly, in plain English, \
    and say so when you do not know the answer.\n\n";

/// Each request: prompt ids and its sampling settings.
fn requests(
    tok: &Tokenizer,
    texts: &[&str],
    id0: SeqId,
    seeded: bool,
) -> Vec<(SeqId, Vec<u32>, GenerateParams)> {
    texts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut p = GenerateParams::greedy(16);
            if seeded {
                p.sampling.temperature = 0.8;
                p.sampling.top_p = 0.95;
                p.sampling.seed = Some(100 + i as u64);
            }
            (id0 + i as SeqId, tok.encode(&format!("{PREAMBLE}{t}")), p)
        })
        .collect()
}

fn config(budget: usize) -> ContinuousConfig {
    ContinuousConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: 16,
        kv_cache_bytes: 0, // the pool is sized by its blocks here
        max_passed_over: 8,
        max_waiting: 64,
        step_cost: None,
    }
}

fn paged(engine: &LlamaEngine, blocks: usize, prefix: bool) -> PagedKv {
    let pool = BlockPool::new(engine.kv_shape(), 16, blocks).unwrap();
    PagedKv::from_manager(KvManager::new(pool, prefix))
}

/// A request: its id, prompt ids and settings.
type Req = (SeqId, Vec<u32>, GenerateParams);

/// Per request: (token, logits row) of every sampling step.
type Rows = HashMap<SeqId, Vec<(u32, Vec<f32>)>>;

/// Run `work` (arrival step, request) to the end on `core`; the rows and
/// the preemptions seen.
fn run(core: &mut LocalCore<'_, LlamaEngine, PagedKv>, work: &[(usize, Req)]) -> (Rows, usize) {
    core.record_logits(true);
    let mut rows: Rows = HashMap::new();
    let mut preempted = 0;
    let last = work.iter().map(|w| w.0).max().unwrap_or(0);
    for step in 0..20_000 {
        for (at, (id, prompt, params)) in work {
            if *at == step {
                assert!(core.add(*id, prompt, params).unwrap());
            }
        }
        let out = core.step();
        assert!(out.failed.is_empty(), "{:?}", out.failed);
        preempted += out.schedule.preempted.len();
        let mut logits: HashMap<SeqId, Vec<f32>> = out.logits.into_iter().collect();
        for o in &out.outputs {
            let row = logits
                .remove(&o.id)
                .expect("a sampling row's logits are recorded");
            rows.entry(o.id).or_default().push((o.step.token, row));
        }
        if step > last && !core.has_work() {
            return (rows, preempted);
        }
    }
    panic!("the workload did not finish");
}

/// Each target alone in a fresh core (roomy pool, one budget).
fn solo(m: &Model, targets: &[Req]) -> Rows {
    let mut all = Rows::new();
    for t in targets {
        let mut core =
            EngineCore::with_backend(&m.engine, &m.tok, &config(512), paged(&m.engine, 64, false))
                .unwrap();
        all.extend(run(&mut core, &[(0, t.clone())]).0);
    }
    all
}

fn assert_same(label: &str, want: &Rows, got: &Rows, ids: impl Iterator<Item = SeqId>) {
    for id in ids {
        let (w, g) = (&want[&id], &got[&id]);
        assert_eq!(
            w.len(),
            g.len(),
            "{label}: request {id} sampled {} times, alone {}",
            g.len(),
            w.len()
        );
        for (step, ((wt, wl), (gt, gl))) in w.iter().zip(g).enumerate() {
            if let Some(k) = wl
                .iter()
                .zip(gl)
                .position(|(a, b)| a.to_bits() != b.to_bits())
            {
                panic!(
                    "{label}: request {id}, token {step}: logit {k} is {} here, {} alone",
                    gl[k], wl[k]
                );
            }
            assert_eq!(wt, gt, "{label}: request {id}, token {step}");
        }
    }
}

/// Targets and others interleaved: others first, targets arriving while
/// they prefill and decode.
fn mixed(targets: &[Req], others: &[Req]) -> Vec<(usize, Req)> {
    let mut work: Vec<_> = others
        .iter()
        .enumerate()
        .map(|(i, o)| (i / 3, o.clone()))
        .collect();
    work.extend(
        targets
            .iter()
            .enumerate()
            .map(|(i, t)| (1 + 2 * i, t.clone())),
    );
    work
}

fn check_model(m: &Model, name: &str, seeded: bool, budgets: &[usize]) {
    let targets = requests(&m.tok, &TARGETS, 0, seeded);
    let others = requests(&m.tok, &OTHERS, 100, seeded);
    let want = solo(m, &targets);
    let ids = || targets.iter().map(|t| t.0);
    for &budget in budgets {
        let mut core = EngineCore::with_backend(
            &m.engine,
            &m.tok,
            &config(budget),
            paged(&m.engine, 256, false),
        )
        .unwrap();
        let (got, _) = run(&mut core, &mixed(&targets, &others));
        assert_same(&format!("{name}, budget {budget}"), &want, &got, ids());
    }
    // 12 blocks of 16 positions for 16 requests of 45 to 70 positions:
    // admitted as blocks free up, preempted when decodes need more.
    let mut core =
        EngineCore::with_backend(&m.engine, &m.tok, &config(64), paged(&m.engine, 12, false))
            .unwrap();
    let (got, preempted) = run(&mut core, &mixed(&targets, &others));
    assert!(preempted > 0, "{name}: the small pool preempted nothing");
    assert_same(
        &format!("{name}, preempted {preempted} times"),
        &want,
        &got,
        ids(),
    );
    // Warm prefix cache: the same requests again in the same core find
    // their prompts' full blocks cached (and the others' neighbours).
    let mut core =
        EngineCore::with_backend(&m.engine, &m.tok, &config(64), paged(&m.engine, 256, true))
            .unwrap();
    let _ = run(&mut core, &mixed(&targets, &others));
    let before = core.kv().manager().prefix_stats().hits;
    let again: Vec<_> = targets
        .iter()
        .map(|(id, p, g)| (id + 1000, p.clone(), g.clone()))
        .collect();
    let (got, _) = run(
        &mut core,
        &again.iter().map(|t| (0, t.clone())).collect::<Vec<_>>(),
    );
    let hits = core.kv().manager().prefix_stats().hits - before;
    assert!(hits > 0, "{name}: the second round found no cached prefix");
    let got: Rows = got.into_iter().map(|(id, r)| (id - 1000, r)).collect();
    assert_same(
        &format!("{name}, after {hits} prefix-cache hits"),
        &want,
        &got,
        ids(),
    );
}

#[test]
fn native_logits_do_not_depend_on_what_shares_the_step() {
    check_model(native(), "native greedy", false, &[16, 64, 512]);
}

#[test]
fn native_seeded_sampling_does_not_depend_on_what_shares_the_step() {
    check_model(native(), "native seeded", true, &[64]);
}

#[test]
fn f32_logits_do_not_depend_on_what_shares_the_step() {
    check_model(f32_model(), "f32 greedy", false, &[16, 64]);
}
