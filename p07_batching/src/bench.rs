//! `p07_batching bench-step`: the batched step's aggregate decode tok/s at
//! batch 1..32 and two positions, beside the same number of one-sequence
//! steps, with the bytes and FLOPs each step moves and the batch where the
//! roofline predicts the step turns compute-bound.
//!
//! Each timed step decodes one token for each of B sequences at position
//! `pos` (their stores are sized and their lengths set directly: the
//! attention's cost does not depend on the cached values).

use std::time::Duration;

use anyhow::Result;
use common::batch::{Batch, BatchModel, KvStore};
use common::stats::{time_it, BenchConfig, Summary};
use p05_kv_cache::kv_cache::KvCache;
use p05_kv_cache::llama_engine::LlamaEngine;

/// One (position, batch) point.
#[derive(Clone, Copy, Debug)]
pub struct StepPoint {
    pub pos: usize,
    pub batch: usize,
    /// Median seconds of one batched step (B tokens).
    pub batched_s: f64,
    /// Median seconds of one single-sequence step (B of them make the same work).
    pub single_s: f64,
    /// Seconds of one batched step: median, p95, ... over the samples.
    pub batched: Summary,
    /// Seconds of one single-sequence step: median, p95, ... over the samples.
    pub single: Summary,
    /// Bytes a step must read: the weights once, plus every sequence's K/V.
    pub bytes: f64,
    /// FLOPs of a step: projections and MLP (2 per weight per token) plus attention.
    pub flops: f64,
}

impl StepPoint {
    pub fn batched_tok_per_s(&self) -> f64 {
        self.batch as f64 / self.batched_s
    }

    pub fn single_tok_per_s(&self) -> f64 {
        1.0 / self.single_s
    }
}

/// f32 weights the matmuls of one token read (embeddings are a lookup).
pub fn matmul_params(engine: &LlamaEngine) -> usize {
    let c = &engine.model.cfg;
    let (d, q, kv, ff) = (
        c.hidden_size,
        c.n_head * c.head_dim,
        c.n_kv_head * c.head_dim,
        c.intermediate_size,
    );
    c.n_layer * (d * q + 2 * d * kv + q * d + 3 * d * ff) + c.vocab_size * d
}

/// `batch` contiguous caches that hold `pos` positions (their values do not
/// change a step's cost) with room for two more.
pub fn decode_stores(engine: &LlamaEngine, batch: usize, pos: usize) -> Vec<KvCache> {
    let s = engine.kv_shape();
    (0..batch)
        .map(|_| {
            let mut kv = KvCache::new(s.n_layer, s.n_kv_head, s.head_dim, pos + 2);
            kv.set_len(pos).expect("pos < pos + 2");
            kv
        })
        .collect()
}

/// Time the batched step and the single-sequence step at one point.
pub fn measure(
    engine: &LlamaEngine,
    batch: usize,
    pos: usize,
    samples: usize,
) -> Result<StepPoint> {
    let c = &engine.model.cfg;
    let vocab = c.vocab_size;
    let mut ws = engine.new_workspace();
    let cfg = BenchConfig {
        warmup_iters: 1,
        min_samples: samples,
        min_time: Duration::ZERO,
        max_samples: samples,
    };
    let mut kv = decode_stores(engine, batch, pos);
    let mut b = Batch::new();
    for i in 0..batch {
        b.push(&[100 + i as u32], pos)?;
    }
    let mut logits = vec![0.0f32; batch * vocab];
    let mut failed = None;
    let batched = time_it(cfg, || {
        let mut refs: Vec<&mut KvCache> = kv.iter_mut().collect();
        if let Err(e) = engine.forward_batch(&b, &mut refs, &mut ws, &mut logits) {
            failed = Some(e);
        }
        kv.iter_mut()
            .for_each(|s| s.set_len(pos).expect("pos < pos + 2"));
    });
    let mut one = Batch::new();
    one.push(&[100], pos)?;
    let mut single_kv = decode_stores(engine, 1, pos);
    let single = time_it(cfg, || {
        let mut refs: Vec<&mut KvCache> = single_kv.iter_mut().collect();
        if let Err(e) = engine.forward_batch(&one, &mut refs, &mut ws, &mut logits[..vocab]) {
            failed = Some(e);
        }
        single_kv[0].set_len(pos).expect("pos < pos + 2");
    });
    if let Some(e) = failed {
        return Err(e.into());
    }
    let params = matmul_params(engine) as f64;
    let kv_bytes = (batch * (pos + 1) * kv[0].shape().bytes_per_position()) as f64;
    let attn_flops = (4 * batch * (pos + 1) * c.n_layer * c.n_head * c.head_dim) as f64;
    Ok(StepPoint {
        pos,
        batch,
        batched_s: batched.median,
        single_s: single.median,
        batched,
        single,
        bytes: params * 4.0 + kv_bytes,
        flops: 2.0 * params * batch as f64 + attn_flops,
    })
}
