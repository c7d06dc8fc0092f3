//! Pipeline parallelism through the engine core: several greedy requests
//! at once (so a step holds several micro-batches, prompt chunks and
//! decodes) on Project 09's paged K/V, the tiny Llama at PP = 2 and
//! SmolLM2 at PP = 2 and 3 (f32 and native), over threads and loopback
//! TCP. No sum changes order in a pipeline, so every token and every
//! logit equals one process's bit for bit; each stage holds its layers'
//! share of the weights and of the K/V.

mod worlds;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use worlds::{tcp_world, threads_world};

use common::batch::BatchModel;
use p04_transformer::Split;
use p05_kv_cache::generate::GenerateParams;
use p08_continuous::kv_backend::KvBackend;
use p08_continuous::{ContinuousConfig, EngineCore};
use p09_kv_manager::PagedKv;
use p10_quant::Weights;
use p13_multi_gpu::pp::{follow_stage, PpRunner, Stage};
use p13_multi_gpu::tp::{load_part, weight_bytes};
use p13_multi_gpu::Communicator;

const KV_BYTES: usize = 1 << 26;

fn config() -> ContinuousConfig {
    ContinuousConfig {
        max_num_batched_tokens: 24,
        max_num_seqs: 8,
        kv_cache_bytes: KV_BYTES,
        max_passed_over: 8,
        max_waiting: 64,
        step_cost: None,
    }
}

/// (token, logits) of every sampled row, per request, in order.
type Rows = Vec<Vec<(u32, Vec<u32>)>>;

/// Drive `core` over `prompts` (greedy, 6 tokens each) to the end.
fn drive<B: KvBackend, R: p08_continuous::ModelRunner>(
    mut core: EngineCore<'_, B, R, ()>,
    prompts: &[Vec<u32>],
) -> Rows {
    core.record_logits(true);
    for (i, p) in prompts.iter().enumerate() {
        assert!(core.add(i as u64, p, &GenerateParams::greedy(6)).unwrap());
    }
    let mut rows: Rows = vec![Vec::new(); prompts.len()];
    while core.has_work() {
        let out = core.step();
        assert!(out.failed.is_empty(), "{:?}", out.failed);
        for (o, (_, l)) in out.outputs.iter().zip(out.logits) {
            rows[o.id as usize].push((o.step.token, l.iter().map(|x| x.to_bits()).collect()));
        }
    }
    rows
}

fn whole(path: &Path, weights: Weights, prompts: &[Vec<u32>]) -> Rows {
    let l = load_part(path, weights, Split::whole(), 1).unwrap();
    let (engine, tok) = (l.engine, l.tokenizer.unwrap_or_else(tiny_tokenizer));
    let kv = PagedKv::new(engine.kv_shape(), 16, KV_BYTES, false).unwrap();
    let core = EngineCore::with_backend(&engine, &tok, &config(), kv).unwrap();
    drive(core, prompts)
}

fn tiny_tokenizer() -> p04_transformer::Tokenizer {
    p04_transformer::Tokenizer::from_tokenizer_json(
        &p04_transformer::fixtures_dir().join("tiny_bpe/tokenizer.json"),
    )
    .unwrap()
}

/// The pipeline: stage 0 drives the core on this thread, the others follow
/// on threads of their own.
fn pipeline(
    path: &Path,
    weights: Weights,
    comms: Vec<Arc<dyn Communicator>>,
    prompts: &[Vec<u32>],
) -> (Rows, Vec<(usize, usize)>) {
    let stages = comms.len();
    std::thread::scope(|s| {
        let mut comms = comms;
        let followers: Vec<_> = comms
            .split_off(1)
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let split = Split::stage(c.rank(), stages).unwrap();
                    let l = load_part(path, weights, split, 1).unwrap();
                    let kv = PagedKv::new(l.engine.kv_shape(), 16, KV_BYTES, false).unwrap();
                    let bytes = (weight_bytes(&l.engine.model).0, l.engine.kv_shape().n_layer);
                    let mut stage = Stage::new(&l.engine, kv.new_storage());
                    follow_stage(&*c, &mut stage, stages).unwrap();
                    bytes
                })
            })
            .collect();
        let c = comms.remove(0);
        let l = load_part(path, weights, Split::stage(0, stages).unwrap(), 1).unwrap();
        let (engine, tok) = (l.engine, l.tokenizer.unwrap_or_else(tiny_tokenizer));
        let kv = PagedKv::new(engine.kv_shape(), 16, KV_BYTES, false).unwrap();
        let mut sizes = vec![(weight_bytes(&engine.model).0, engine.kv_shape().n_layer)];
        let runner = PpRunner::new(Stage::new(&engine, kv.new_storage()), c, stages);
        let info = common::Model::info(&engine).clone();
        let core = EngineCore::with_runner(&info, &tok, &config(), kv, runner).unwrap();
        let rows = drive(core, prompts); // the core (and its runner) drop: stop
        sizes.extend(followers.into_iter().map(|f| f.join().unwrap()));
        (rows, sizes)
    })
}

fn check(path: &Path, weights: Weights, stages: usize, prompts: &[Vec<u32>], n_layer: usize) {
    let want = whole(path, weights, prompts);
    assert!(
        want.iter().all(|r| r.len() == 6),
        "every request runs its 6 tokens"
    );
    for (name, comms) in [
        ("threads", threads_world(stages)),
        ("tcp", tcp_world(stages)),
    ] {
        let (got, sizes) = pipeline(path, weights, comms, prompts);
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!(
                w == g,
                "{} {weights:?} PP={stages} over {name}: request {i} differs from one process",
                path.display()
            );
        }
        // Each stage holds L/S layers' K/V.
        assert!(
            sizes.iter().all(|&(_, layers)| layers == n_layer / stages),
            "{sizes:?}"
        );
    }
}

fn tiny_llama() -> PathBuf {
    p04_transformer::fixtures_dir().join("tiny_llama")
}

#[test]
fn tiny_llama_at_pp_2_equals_one_process_bit_for_bit() {
    let prompts: Vec<Vec<u32>> = vec![
        vec![
            1, 17, 33, 5, 99, 64, 2, 8, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54,
            55, 56, 57, 58,
        ],
        vec![3, 4],
        vec![7, 8, 9, 10, 11],
    ];
    check(&tiny_llama(), Weights::F32, 2, &prompts, 2);
}

#[test]
fn smollm2_at_pp_2_and_3_equals_one_process_bit_for_bit() {
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).unwrap_or_else(|e| panic!("{e}"));
    let tok = p04_transformer::Tokenizer::from_gguf(
        &p04_transformer::GgufFile::open(&path).unwrap().header,
    )
    .unwrap();
    let prompts: Vec<Vec<u32>> = [
        "The capital of France is",
        "Write a haiku about the sea in winter, with the gulls and the grey light of the morning harbour.",
        "1, 2, 3,",
    ]
    .iter()
    .map(|p| tok.encode(p))
    .collect();
    check(&path, Weights::Native, 3, &prompts, 30);
    check(&path, Weights::Native, 2, &prompts, 30);
    check(&path, Weights::F32, 3, &prompts, 30);
}

#[test]
fn stage_counts_that_do_not_divide_the_layers_are_refused() {
    let e = load_part(&tiny_llama(), Weights::F32, Split::stage(0, 3).unwrap(), 1).unwrap_err();
    assert!(
        e.to_string()
            .contains("3 pipeline stages do not divide the 2 layers"),
        "{e}"
    );
}
