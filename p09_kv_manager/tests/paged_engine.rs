//! Project 08's engine core on paged blocks, on SmolLM2, step by step:
//! - a request whose prompt shares a cached prefix starts after it (the
//!   prefix-cache counters say how much) and generates what it generates
//!   cold, alone;
//! - a hasher that makes every block hash collide serves no false hit:
//!   outputs are unchanged;
//! - under a tiny pool, many concurrent requests are admitted and
//!   preempted on blocks, and all finish with their outputs unchanged;
//! - a sequence's blocks return to the pool when it finishes.

use std::collections::HashMap;
use std::sync::OnceLock;

use common::batch::BatchModel;
use p04_transformer::Tokenizer;
use p05_kv_cache::generate::{generate, GenerateParams};
use p05_kv_cache::llama_engine::LlamaEngine;
use p08_continuous::scheduler::SeqId;
use p08_continuous::{ContinuousConfig, EngineCore, LocalCore};
use p09_kv_manager::prefix_hash::BlockHasher;
use p09_kv_manager::{BlockPool, KvManager, PagedKv};

struct Model {
    engine: LlamaEngine,
    tok: Tokenizer,
}

fn smollm2() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| {
        let path = common::assets::ensure(common::assets::Asset::SmolLm2)
            .unwrap_or_else(|e| panic!("{e}"));
        let loaded = p05_kv_cache::load::load(&path).unwrap();
        Model {
            engine: loaded.engine,
            tok: loaded.tokenizer.unwrap(),
        }
    })
}

fn alone(m: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    generate(
        &m.engine,
        &m.tok,
        prompt,
        &GenerateParams::greedy(n),
        |_| {},
    )
    .unwrap()
    .tokens
}

fn text_ids(tok: &Tokenizer, n: usize, salt: &str) -> Vec<u32> {
    let base = format!(
        "{salt} The keeper of the lighthouse wrote in his log every evening: the wind, \
         the ships that passed, the colour of the sea and the names of the birds. "
    );
    let mut ids = Vec::new();
    while ids.len() < n {
        ids.extend(tok.encode(&base));
    }
    ids.truncate(n);
    ids
}

fn config(budget: usize, seqs: usize) -> ContinuousConfig {
    ContinuousConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: seqs,
        kv_cache_bytes: 0, // the pool is sized by its blocks here
        max_passed_over: 8,
        max_waiting: 64,
        step_cost: None,
    }
}

fn paged(blocks: usize, hasher: Option<Box<dyn BlockHasher>>) -> PagedKv {
    let pool = BlockPool::new(smollm2().engine.kv_shape(), 16, blocks).unwrap();
    PagedKv::from_manager(match hasher {
        Some(h) => KvManager::with_hasher(pool, true, h),
        None => KvManager::new(pool, true),
    })
}

/// Run requests (arrival step, prompt, max_tokens) to the end; their tokens.
fn run(
    core: &mut LocalCore<'_, LlamaEngine, PagedKv>,
    work: &[(usize, Vec<u32>, usize)],
) -> (HashMap<SeqId, Vec<u32>>, usize) {
    let mut got: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let mut preempted = 0;
    for step in 0..5000 {
        for (i, (at, prompt, n)) in work.iter().enumerate() {
            if *at == step {
                assert!(core
                    .add(i as SeqId, prompt, &GenerateParams::greedy(*n))
                    .unwrap());
            }
        }
        let out = core.step();
        assert!(out.failed.is_empty(), "{:?}", out.failed);
        preempted += out.schedule.preempted.len();
        for o in &out.outputs {
            if o.is_token {
                got.entry(o.id).or_default().push(o.step.token);
            }
        }
        if step > work.iter().map(|w| w.0).max().unwrap_or(0) && !core.has_work() {
            return (got, preempted);
        }
    }
    panic!("the workload did not finish");
}

#[test]
fn a_shared_prefix_is_computed_once_and_changes_no_output() {
    let m = smollm2();
    let system = text_ids(&m.tok, 100, "System:");
    let ask = |q: &str| {
        let mut p = system.clone();
        p.extend(m.tok.encode(q));
        p
    };
    let work = vec![
        (0, ask(" What does the keeper write?"), 8),
        // Arrives after the first has computed (and cached) the prefix.
        (12, ask(" Which birds?"), 8),
    ];
    let mut core =
        EngineCore::with_backend(&m.engine, &m.tok, &config(64, 4), paged(64, None)).unwrap();
    let (got, _) = run(&mut core, &work);
    let stats = core.kv().manager().prefix_stats();
    // The second request found the prefix's full blocks: 6 of 16 = 96 tokens.
    assert_eq!(stats.hits, 96, "{stats:?}");
    assert_eq!(stats.queries, (work[0].1.len() + work[1].1.len()) as u64);
    for (i, (_, p, n)) in work.iter().enumerate() {
        assert_eq!(got[&(i as SeqId)], alone(m, p, *n), "request {i}");
    }
    assert_eq!(core.kv().manager().used_blocks(), 0, "every block returned");
}

/// Every block hashes to 7: only the token comparison tells prefixes apart.
#[derive(Debug)]
struct Colliding;

impl BlockHasher for Colliding {
    fn hash(&self, _: Option<u64>, _: &[u32], _: &[u8]) -> u64 {
        7
    }
}

#[test]
fn colliding_hashes_serve_no_false_hit() {
    let m = smollm2();
    let work = vec![
        (0, text_ids(&m.tok, 40, "One"), 6),
        (10, text_ids(&m.tok, 40, "Two"), 6),
        (20, text_ids(&m.tok, 40, "One"), 6),
    ];
    let mut core = EngineCore::with_backend(
        &m.engine,
        &m.tok,
        &config(64, 4),
        paged(64, Some(Box::new(Colliding))),
    )
    .unwrap();
    let (got, _) = run(&mut core, &work);
    for (i, (_, p, n)) in work.iter().enumerate() {
        assert_eq!(got[&(i as SeqId)], alone(m, p, *n), "request {i}");
    }
    // The third request repeats the first: its first block is a true hit.
    assert_eq!(core.kv().manager().prefix_stats().hits, 16);
}

#[test]
fn many_requests_in_a_tiny_pool_all_finish_unchanged() {
    let m = smollm2();
    // 16 blocks (256 positions) for eight requests of 34 to 83 positions each.
    let work: Vec<(usize, Vec<u32>, usize)> = (0..8)
        .map(|i| {
            (
                i,
                text_ids(&m.tok, 10 + 4 * i, &format!("R{i}")),
                24 + 3 * i,
            )
        })
        .collect();
    let mut core =
        EngineCore::with_backend(&m.engine, &m.tok, &config(64, 8), paged(16, None)).unwrap();
    let (got, preempted) = run(&mut core, &work);
    assert!(preempted > 0, "the pool forced preemption");
    for (i, (_, p, n)) in work.iter().enumerate() {
        assert_eq!(got[&(i as SeqId)], alone(m, p, *n), "request {i}");
    }
    assert_eq!(core.kv().manager().used_blocks(), 0);
    eprintln!("{preempted} preemptions, outputs unchanged");
}

/// Sampled (not greedy), fixed length: choices differ, so a choice that
/// read another's K/V would show it.
fn sampled(max_tokens: usize, seed: u64) -> GenerateParams {
    let mut p = GenerateParams::greedy(max_tokens);
    p.sampling.temperature = 0.9;
    p.sampling.seed = Some(seed);
    p
}

/// Run one request of `ids.len()` choices to the end: each choice's tokens,
/// and the most K/V bytes held at once.
fn run_choices<B: p08_continuous::kv_backend::KvBackend>(
    core: &mut LocalCore<'_, LlamaEngine, B>,
    ids: &[SeqId],
    prompt: &[u32],
    params: &GenerateParams,
) -> (Vec<Vec<u32>>, usize) {
    assert!(core.add_choices(ids, prompt, params, b"").unwrap());
    let mut got: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let mut peak = 0;
    for _ in 0..1000 {
        let out = core.step();
        assert!(out.failed.is_empty(), "{:?}", out.failed);
        peak = peak.max(core.kv_bytes());
        for o in &out.outputs {
            if o.is_token {
                got.entry(o.id).or_default().push(o.step.token);
            }
        }
        if !core.has_work() {
            return (ids.iter().map(|i| got.remove(i).unwrap()).collect(), peak);
        }
    }
    panic!("the choices did not finish");
}

#[test]
fn parallel_samples_share_the_prompt_and_each_is_its_own_request() {
    let m = smollm2();
    // 40 tokens: two full blocks and a shared partial one, which each
    // choice copies before its first write.
    let prompt = text_ids(&m.tok, 40, "Fork");
    let ids = [10, 11, 12, 13];
    let params = sampled(12, 42);
    let mut core =
        EngineCore::with_backend(&m.engine, &m.tok, &config(64, 8), paged(64, None)).unwrap();
    let (paged_out, paged_peak) = run_choices(&mut core, &ids, &prompt, &params);
    assert_eq!(core.kv().manager().used_blocks(), 0, "every block returned");
    // Choice i is the request `n = 1` with seed 42 + i, run alone.
    for (i, got) in paged_out.iter().enumerate() {
        let want = generate(
            &m.engine,
            &m.tok,
            &prompt,
            &sampled(12, 42 + i as u64),
            |_| {},
        )
        .unwrap()
        .tokens;
        assert_eq!(got, &want, "choice {i}");
    }
    assert!(paged_out.windows(2).any(|w| w[0] != w[1]), "choices differ");
    // 52 positions = 4 blocks each if separate (16); forked: the two full
    // prompt blocks are shared, each choice holds 2 of its own (10).
    let block = core.kv().manager().pool().block_bytes();
    assert_eq!(paged_peak, 10 * block);
    // The contiguous backend copies the prompt's K/V per choice: same
    // outputs, more memory.
    let mut core = EngineCore::new(
        &m.engine,
        &m.tok,
        &ContinuousConfig {
            kv_cache_bytes: 64 << 20,
            ..config(64, 8)
        },
    )
    .unwrap();
    let (contiguous_out, contiguous_peak) = run_choices(&mut core, &ids, &prompt, &params);
    assert_eq!(contiguous_out, paged_out);
    assert!(
        contiguous_peak > paged_peak,
        "{contiguous_peak} vs {paged_peak}"
    );
}

#[test]
fn choices_that_cannot_fork_compute_their_prompt_and_match() {
    let m = smollm2();
    let prompt = text_ids(&m.tok, 40, "Fork");
    let params = sampled(8, 7);
    // Two running sequences at most: one choice forks, two wait and compute
    // the prompt themselves (from the prefix cache's two full blocks).
    let mut core =
        EngineCore::with_backend(&m.engine, &m.tok, &config(64, 2), paged(64, None)).unwrap();
    let (out, _) = run_choices(&mut core, &[0, 1, 2, 3], &prompt, &params);
    for (i, got) in out.iter().enumerate() {
        let want = generate(
            &m.engine,
            &m.tok,
            &prompt,
            &sampled(8, 7 + i as u64),
            |_| {},
        )
        .unwrap()
        .tokens;
        assert_eq!(got, &want, "choice {i}");
    }
    assert_eq!(core.kv().manager().prefix_stats().hits, 2 * 2 * 16);
}

#[test]
fn a_cache_salt_keeps_prefixes_apart() {
    let m = smollm2();
    let prompt = text_ids(&m.tok, 40, "Salt");
    let params = GenerateParams::greedy(4);
    let mut core =
        EngineCore::with_backend(&m.engine, &m.tok, &config(64, 4), paged(64, None)).unwrap();
    let mut hits = Vec::new();
    let want = alone(m, &prompt, 4);
    for (id, salt) in [(0, "tenant-a"), (1, "tenant-b"), (2, "tenant-a"), (3, "")] {
        assert!(core
            .add_choices(&[id], &prompt, &params, salt.as_bytes())
            .unwrap());
        let mut got = Vec::new();
        while core.has_work() {
            let out = core.step();
            got.extend(
                out.outputs
                    .iter()
                    .filter(|o| o.is_token)
                    .map(|o| o.step.token),
            );
        }
        assert_eq!(got, want, "request {id}");
        hits.push(core.kv().manager().prefix_stats().hits);
    }
    // Only the second "tenant-a" request hits (two full blocks); "tenant-b"
    // and the unsalted one start cold.
    assert_eq!(hits, vec![0, 0, 32, 32]);
}
