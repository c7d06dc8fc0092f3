//! The batched, ragged step against per-sequence steps: random mixes of
//! prompt chunks and decode tokens at random positions give the same logits
//! and the same K/V as running each sequence alone; a paged store (blocks of
//! 3 positions) gives the contiguous store's results; a malformed step is an
//! error that touches no store.

use common::batch::{Batch, BatchError, BatchModel, KvShape, KvStore};
use common::rng::Rng;
use common::{Model, ModelInfo};
use p04_transformer::{Gpt2, Llama};
use p05_kv_cache::gpt2_engine::Gpt2Engine;
use p05_kv_cache::kv_cache::KvCache;
use p05_kv_cache::llama_engine::LlamaEngine;
use p05_kv_cache::LocalModelError;

fn info(vocab: usize, ctx: usize) -> ModelInfo {
    ModelInfo {
        name: "tiny".into(),
        vocab_size: vocab,
        context_length: ctx,
        bos_id: None,
        stop_ids: vec![],
    }
}

fn llama() -> LlamaEngine {
    let m = Llama::from_hf_dir(&p04_transformer::fixtures_dir().join("tiny_llama")).unwrap();
    LlamaEngine::new(m, info(101, 64))
}

fn gpt2() -> Gpt2Engine {
    let m = Gpt2::from_hf_dir(&p04_transformer::fixtures_dir().join("tiny_gpt2")).unwrap();
    Gpt2Engine::new(m, info(101, 64))
}

fn new_kv(s: KvShape, max: usize) -> KvCache {
    KvCache::new(s.n_layer, s.n_kv_head, s.head_dim, max)
}

/// max |a - b| over the scale max |b|.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

fn ids(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab as u64) as u32).collect()
}

/// `cases` random steps: 1..=6 sequences, each with a random history
/// already in its store (0..20 positions) and 1..=9 new tokens (a third of
/// them single decode tokens). The batched step must equal each sequence
/// run alone, logits within 1e-5 of logit scale and K/V within the same.
fn ragged_equals_alone<M: BatchModel>(engine: &M, cases: u64) {
    let shape = engine.kv_shape();
    let vocab = engine.info().vocab_size;
    let mut ws = engine.new_workspace();
    let mut worst = 0.0f32;
    for case in 0..cases {
        let mut rng = Rng::new(1000 + case);
        let n_seqs = 1 + rng.below(6) as usize;
        let mut stores = Vec::new();
        let mut news = Vec::new();
        for _ in 0..n_seqs {
            let mut kv = new_kv(shape, 40);
            let history = rng.below(20) as usize;
            if history > 0 {
                let mut b = Batch::new();
                b.push(&ids(&mut rng, history, vocab), 0).unwrap();
                let mut l = vec![0.0; vocab];
                let mut one = &mut kv;
                engine
                    .forward_batch(&b, std::slice::from_mut(&mut one), &mut ws, &mut l)
                    .unwrap();
            }
            let n_new = if rng.below(3) == 0 {
                1
            } else {
                1 + rng.below(9) as usize
            };
            news.push(ids(&mut rng, n_new, vocab));
            stores.push(kv);
        }
        // Each alone.
        let mut alone_logits = Vec::new();
        let mut alone_kv = Vec::new();
        for (kv, new) in stores.iter().zip(&news) {
            let mut kv = kv.clone();
            let mut b = Batch::new();
            b.push(new, kv.len()).unwrap();
            let mut l = vec![0.0; vocab];
            let mut one = &mut kv;
            engine
                .forward_batch(&b, std::slice::from_mut(&mut one), &mut ws, &mut l)
                .unwrap();
            alone_logits.push(l);
            alone_kv.push(kv);
        }
        // All together.
        let mut b = Batch::new();
        for (kv, new) in stores.iter().zip(&news) {
            b.push(new, kv.len()).unwrap();
        }
        let mut logits = vec![0.0; n_seqs * vocab];
        let mut refs: Vec<&mut KvCache> = stores.iter_mut().collect();
        engine
            .forward_batch(&b, &mut refs, &mut ws, &mut logits)
            .unwrap();
        for (i, (want, kv_want)) in alone_logits.iter().zip(&alone_kv).enumerate() {
            let got = &logits[i * vocab..(i + 1) * vocab];
            let d = rel_diff(got, want);
            worst = worst.max(d);
            assert!(
                d <= 1e-5,
                "case {case} seq {i}: logits differ by {d:e} of scale"
            );
            assert_eq!(
                stores[i].len(),
                kv_want.len(),
                "case {case} seq {i}: length"
            );
            for l in 0..shape.n_layer {
                let (got, want) = (stores[i].layer(l), kv_want.layer(l));
                let dk = rel_diff(got.0, want.0);
                let dv = rel_diff(got.1, want.1);
                assert!(
                    dk <= 1e-5 && dv <= 1e-5,
                    "case {case} seq {i} layer {l}: K/V differ"
                );
            }
        }
    }
    eprintln!("{cases} ragged steps: worst relative logit diff {worst:e}");
}

#[test]
fn tiny_llama_ragged_step_equals_each_sequence_alone() {
    ragged_equals_alone(&llama(), 40);
}

#[test]
fn tiny_gpt2_ragged_step_equals_each_sequence_alone() {
    ragged_equals_alone(&gpt2(), 40);
}

#[test]
fn batch_of_one_is_the_model_adapter_exactly() {
    let engine = llama();
    let prompt = [3u32, 1, 4, 1, 5, 9, 2, 6];
    let (mut want, mut cache) = engine.prefill(&prompt, 20).unwrap();
    let mut kv = engine.new_cache(20).kv;
    let mut ws = engine.new_workspace();
    let mut b = Batch::new();
    b.push(&prompt, 0).unwrap();
    let mut got = vec![0.0; 101];
    let mut one = &mut kv;
    engine
        .forward_batch(&b, std::slice::from_mut(&mut one), &mut ws, &mut got)
        .unwrap();
    assert_eq!(got, want, "prefill");
    for t in [7u32, 8, 9] {
        engine.decode(t, &mut cache, &mut want).unwrap();
        b.clear();
        b.push(&[t], kv.len()).unwrap();
        let mut one = &mut kv;
        engine
            .forward_batch(&b, std::slice::from_mut(&mut one), &mut ws, &mut got)
            .unwrap();
        assert_eq!(got, want, "decode {t}");
    }
}

/// A paged store for the test: blocks of `BLOCK` positions, each block its
/// own allocation, K and V per (layer, kv_head, block).
#[derive(Debug)]
struct Paged {
    shape: KvShape,
    len: usize,
    /// [layer][kv_head][block] -> (BLOCK, head_dim)
    k: Vec<Vec<Vec<Vec<f32>>>>,
    v: Vec<Vec<Vec<Vec<f32>>>>,
    blocks: usize,
}

const BLOCK: usize = 3;

impl Paged {
    fn new(shape: KvShape, max: usize) -> Paged {
        let blocks = max.div_ceil(BLOCK);
        let mk = || {
            vec![
                vec![vec![vec![0.0; BLOCK * shape.head_dim]; blocks]; shape.n_kv_head];
                shape.n_layer
            ]
        };
        Paged {
            shape,
            len: 0,
            k: mk(),
            v: mk(),
            blocks,
        }
    }
}

impl KvStore for Paged {
    fn shape(&self) -> KvShape {
        self.shape
    }
    fn len(&self) -> usize {
        self.len
    }
    fn capacity(&self) -> usize {
        self.blocks * BLOCK
    }
    fn write(&mut self, layer: usize, k_rows: &[f32], v_rows: &[f32], n: usize) {
        let hd = self.shape.head_dim;
        let w = self.shape.n_kv_head * hd;
        for i in 0..n {
            let pos = self.len + i;
            let (b, o) = (pos / BLOCK, (pos % BLOCK) * hd);
            for h in 0..self.shape.n_kv_head {
                self.k[layer][h][b][o..o + hd].copy_from_slice(&k_rows[i * w + h * hd..][..hd]);
                self.v[layer][h][b][o..o + hd].copy_from_slice(&v_rows[i * w + h * hd..][..hd]);
            }
        }
    }
    fn advance(&mut self, n: usize) {
        self.len += n;
    }
    fn for_each_run(
        &self,
        layer: usize,
        kv_head: usize,
        upto: usize,
        f: &mut common::batch::KvRunFn<'_>,
    ) {
        let hd = self.shape.head_dim;
        for b in 0..upto.div_ceil(BLOCK) {
            let n = (upto - b * BLOCK).min(BLOCK);
            f(
                b * BLOCK,
                &self.k[layer][kv_head][b][..n * hd],
                &self.v[layer][kv_head][b][..n * hd],
            );
        }
    }
    fn bytes(&self) -> usize {
        self.blocks * BLOCK * self.shape.bytes_per_position()
    }
}

#[test]
fn paged_store_gives_the_contiguous_results() {
    let engine = llama();
    let shape = engine.kv_shape();
    let mut ws = engine.new_workspace();
    let mut contiguous = [new_kv(shape, 30), new_kv(shape, 30)];
    let mut paged = [Paged::new(shape, 30), Paged::new(shape, 30)];
    // Prompts of 7 and 4 tokens (runs of 3 split both), then 10 decode steps.
    let mut news: Vec<Vec<u32>> = vec![vec![5, 6, 7, 8, 9, 10, 11], vec![20, 21, 22, 23]];
    for step in 0..11 {
        let mut b = Batch::new();
        for (new, kv) in news.iter().zip(&contiguous) {
            b.push(new, kv.len()).unwrap();
        }
        let mut want = vec![0.0; 2 * 101];
        let mut got = vec![0.0; 2 * 101];
        let mut c: Vec<&mut KvCache> = contiguous.iter_mut().collect();
        engine
            .forward_batch(&b, &mut c, &mut ws, &mut want)
            .unwrap();
        let mut p: Vec<&mut Paged> = paged.iter_mut().collect();
        engine.forward_batch(&b, &mut p, &mut ws, &mut got).unwrap();
        let d = rel_diff(&got, &want);
        assert!(d <= 1e-5, "step {step}: paged vs contiguous {d:e}");
        news = (0..2)
            .map(|i| {
                vec![p05_kv_cache::sampling::argmax(
                    &want[i * 101..(i + 1) * 101],
                )]
            })
            .collect();
    }
}

/// One decode row over stores holding the same keys and values: the paged
/// store's runs give the contiguous result bit for bit, and both match the
/// f64 reference.
#[test]
fn attend_row_over_runs_matches_one_run_and_the_f64_reference() {
    use p05_kv_cache::attention::{attend_naive, attend_row};
    let shape = KvShape {
        n_layer: 2,
        n_kv_head: 2,
        head_dim: 8,
    };
    let w = shape.n_kv_head * shape.head_dim;
    for upto in [1usize, 2, 3, 4, 7, 17] {
        let mut c = new_kv(shape, 20);
        let mut p = Paged::new(shape, 20);
        for layer in 0..2 {
            let k = common::testdata::uniform(upto * w, 7 + upto as u64 + layer as u64);
            let v = common::testdata::uniform(upto * w, 70 + upto as u64 + layer as u64);
            c.write(layer, &k, &v, upto);
            KvStore::write(&mut p, layer, &k, &v, upto);
        }
        let q: Vec<f32> = common::testdata::uniform(8, 99)
            .iter()
            .map(|x| x * 4.0)
            .collect();
        let mut scores = vec![f32::NAN; upto];
        let (mut a, mut b) = (vec![0.0; 8], vec![0.0; 8]);
        attend_row(&q, &c, 1, 1, upto, 0.35, &mut scores, &mut a);
        attend_row(&q, &p, 1, 1, upto, 0.35, &mut scores, &mut b);
        assert_eq!(a, b, "upto {upto}");
        let want = attend_naive(&q, &c, 1, 1, upto, 0.35);
        let d = rel_diff(&a, &want);
        assert!(d <= 1e-6, "upto {upto}: {d:e} from the f64 reference");
    }
}

#[test]
fn a_malformed_step_is_an_error_and_touches_no_store() {
    let engine = llama();
    let shape = engine.kv_shape();
    let mut ws = engine.new_workspace();
    let mut a = new_kv(shape, 4);
    let mut b_kv = new_kv(shape, 4);
    let check = |batch: &Batch, stores: &mut [&mut KvCache], logits: usize, ws: &mut _| {
        let mut l = vec![0.0; logits];
        match engine.forward_batch(batch, stores, ws, &mut l) {
            Err(LocalModelError::Batch(e)) => e,
            other => panic!("expected a batch error, got {other:?}"),
        }
    };
    let mut batch = Batch::new();
    batch.push(&[1, 2], 0).unwrap();
    batch.push(&[3], 1).unwrap(); // b_kv is empty: position 1 is wrong
    let e = check(&batch, &mut [&mut a, &mut b_kv], 202, &mut ws);
    assert!(
        matches!(
            e,
            BatchError::Position {
                seq: 1,
                start_pos: 1,
                len: 0
            }
        ),
        "{e}"
    );
    let e = check(&batch, &mut [&mut a], 202, &mut ws);
    assert!(
        matches!(e, BatchError::StoreCount { stores: 1, seqs: 2 }),
        "{e}"
    );
    batch.clear();
    batch.push(&[1, 2, 3, 4, 5], 0).unwrap();
    let e = check(&batch, &mut [&mut a], 101, &mut ws);
    assert!(matches!(e, BatchError::StoreFull { .. }), "{e}");
    batch.clear();
    batch.push(&[1, 101], 0).unwrap();
    let e = check(&batch, &mut [&mut a], 101, &mut ws);
    assert!(matches!(e, BatchError::TokenId { id: 101, .. }), "{e}");
    batch.clear();
    batch.push(&[1], 0).unwrap();
    let e = check(&batch, &mut [&mut a], 100, &mut ws);
    assert!(matches!(e, BatchError::Logits { .. }), "{e}");
    assert_eq!((a.len(), b_kv.len()), (0, 0));
    assert!((0..a.shape().n_layer).all(|l| {
        let (k, v) = a.layer(l);
        k.iter().chain(v).all(|&x| x == 0.0)
    }));
}

#[test]
fn forward_all_gives_every_positions_logits() {
    // Row i of a scoring pass over ids (after a history of 5) is the last
    // logits of the prefix ids[..=i] stepped after the same history.
    let e = llama();
    let vocab = e.info().vocab_size;
    let mut rng = Rng::new(11);
    let (history, text) = (ids(&mut rng, 5, vocab), ids(&mut rng, 9, vocab));
    let mut cache = e.new_cache(32);
    let mut last = vec![0.0f32; vocab];
    e.step(&history, &mut cache, &mut last).unwrap();
    let mut all = vec![0.0f32; text.len() * vocab];
    e.forward_all(&text, &mut cache, &mut all).unwrap();
    for i in 0..text.len() {
        let mut c = e.new_cache(32);
        e.step(&history, &mut c, &mut last).unwrap();
        e.step(&text[..=i], &mut c, &mut last).unwrap();
        let d = rel_diff(&all[i * vocab..(i + 1) * vocab], &last);
        assert!(d < 1e-5, "position {i}: {d}");
    }
    // A buffer of the wrong size is an error naming the rows it needed.
    let mut short = vec![0.0f32; vocab];
    let e2 = e
        .forward_all(&text, &mut e.new_cache(32), &mut short)
        .unwrap_err();
    assert!(e2.to_string().contains("9 rows"), "{e2}");
}
