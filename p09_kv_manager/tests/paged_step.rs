//! The batched step through block tables equals the step through p05's
//! contiguous caches: SmolLM2, three sequences (prompt chunks and decodes)
//! in one ragged batch, blocks of 16 and of 5 (positions straddle blocks).

use common::batch::{Batch, BatchModel};
use p05_kv_cache::kv_cache::KvCache;
use p05_kv_cache::llama_engine::LlamaEngine;
use p08_continuous::runner::{KvStorage, PlannedSeq, SeqKv};
use p09_kv_manager::{BlockPool, KvManager};

fn smollm2() -> LlamaEngine {
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).unwrap_or_else(|e| panic!("{e}"));
    p05_kv_cache::load::load(&path).unwrap().engine
}

/// Run the same steps (each: per sequence the tokens it brings) through
/// contiguous caches and through a paged manager; compare logits.
fn compare(engine: &LlamaEngine, block_size: usize, prompts: &[Vec<u32>], steps: usize) {
    let shape = engine.kv_shape();
    let vocab = engine.model.cfg.vocab_size;
    let mut ws = engine.new_workspace();
    let mut kv: Vec<KvCache> = prompts
        .iter()
        .map(|p| {
            KvCache::new(
                shape.n_layer,
                shape.n_kv_head,
                shape.head_dim,
                p.len() + steps,
            )
        })
        .collect();
    let mut m = KvManager::new(BlockPool::new(shape, block_size, 64).unwrap(), true);
    let mut storage = m.new_storage();
    for (i, p) in prompts.iter().enumerate() {
        assert_eq!(m.admit(i as u64, p, b"", p.len() + steps), Some(0));
    }
    let mut inputs: Vec<Vec<u32>> = prompts.to_vec();
    let mut worst = 0.0f32;
    for step in 0..=steps {
        let mut batch = Batch::new();
        for (i, t) in inputs.iter().enumerate() {
            batch.push(t, kv[i].len()).unwrap();
        }
        let n = prompts.len();
        let mut want = vec![0.0f32; n * vocab];
        let mut refs: Vec<&mut KvCache> = kv.iter_mut().collect();
        engine
            .forward_batch(&batch, &mut refs, &mut ws, &mut want)
            .unwrap();
        let chunks: Vec<(u64, usize, usize)> = batch
            .seqs()
            .iter()
            .enumerate()
            .map(|(i, s)| (i as u64, s.start_pos, s.len))
            .collect();
        for &(id, start, len) in &chunks {
            assert!(m.grow(id, start, start + len));
        }
        // The plan as the runner gets it: each sequence's block table.
        let seqs: Vec<PlannedSeq> = chunks
            .iter()
            .zip(&inputs)
            .map(|(&(id, start, _), t)| PlannedSeq {
                id,
                start,
                tokens: t.clone(),
                kv: SeqKv::Blocks(m.table(id).unwrap().to_vec()),
                logits: true,
            })
            .collect();
        let mut got = vec![0.0f32; n * vocab];
        {
            let mut stores = storage.stores(&seqs).unwrap();
            let mut refs: Vec<&mut _> = stores.iter_mut().collect();
            engine
                .forward_batch(&batch, &mut refs, &mut ws, &mut got)
                .unwrap();
        }
        // Per sequence: max |diff| relative to the row's logit scale (the
        // attention sums over blocks instead of one run: same terms, other
        // grouping), within 1e-5 as Project 07's batched-vs-alone test.
        for (i, (a, b)) in want.chunks(vocab).zip(got.chunks(vocab)).enumerate() {
            let scale = a.iter().fold(0.0f32, |s, x| s.max(x.abs()));
            let d = common::compare::diff(a, b, 0.0, 0.0).unwrap().max_abs / scale;
            worst = worst.max(d);
            assert!(d <= 1e-5, "step {step}, block size {block_size}, sequence {i}: logits differ by {d:e} of scale");
        }
        // Greedy next tokens: identical, and fed to both.
        // The workspace's one greedy rule (first index on ties).
        let argmax = common::argmax;
        inputs = (0..n)
            .map(|i| {
                let (w, g) = (
                    argmax(&want[i * vocab..(i + 1) * vocab]),
                    argmax(&got[i * vocab..(i + 1) * vocab]),
                );
                assert_eq!(w, g, "step {step}: greedy tokens differ");
                vec![w]
            })
            .collect();
    }
    eprintln!("block size {block_size}: worst relative logit diff {worst:e}");
}

#[test]
fn paged_steps_equal_contiguous_steps() {
    let engine = smollm2();
    let prompts = vec![
        (1..40).collect::<Vec<u32>>(),
        vec![5, 6, 7],
        (300..317).collect(),
    ];
    compare(&engine, 16, &prompts, 6);
    compare(&engine, 5, &prompts, 6);
}
