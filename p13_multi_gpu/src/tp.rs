//! A Llama split by tensor parallelism (Megatron-LM, section 3).
//!
//! Each rank loads its slice of every projection (Project 04's
//! [`Split`]): Q, K, V by whole heads and gate/up by MLP columns
//! (column-parallel: no communication, each rank computes its own heads
//! and its own columns of the MLP), O and down by input columns
//! (row-parallel: each rank's product is a partial sum over its heads or
//! columns). The forward is Project 05's, unchanged, on 1/P of the heads
//! and MLP width; what makes it tensor-parallel is that the two
//! row-parallel projections of each block are wrapped in the all-reduce
//! that completes their sums ([`RowParallel`], vLLM's `RowParallelLinear`
//! with `reduce_results`):
//!
//! ```text
//! per block, on every rank:
//!   h  = RMSNorm(x)                          replicated (x is the same on every rank)
//!   q, k, v = h Wq_r, h Wk_r, h Wv_r         its heads: (n, H/P·hd), (n, KV/P·hd)
//!   att = attention over its own K/V heads   (n, H/P·hd)
//!   o  = all_reduce(att Wo_r)                (n, hidden)   ← all-reduce 1
//!   x += o
//!   g, u = h' Wg_r, h' Wu_r                  its MLP columns (n, F/P)
//!   x += all_reduce(silu(g)·u Wd_r)          (n, hidden)   ← all-reduce 2
//! ```
//!
//! The LM head is replicated (every rank computes all logits) or
//! vocab-parallel ([`VocabParallel`]: each rank computes V/P logits, an
//! all-gather assembles them).

use std::path::Path;
use std::sync::{Arc, Mutex};

use p04_transformer::{HeadSplit, LinearWeights, ModelError, Proj, Split};
use p05_kv_cache::load::LoadedEngine;
// Native weights: a row-parallel slice of 1536/3 = 512 or 576/3 = 192
// input columns is 16 or 6 whole blocks of 32, so a rank's blocks are the
// file's own.
use p10_quant::Weights;

use crate::comm::Communicator;

fn collective(e: crate::comm::CommError) -> ModelError {
    ModelError::Collective(Box::new(e))
}

/// A row-parallel projection: this rank's partial product, then the
/// all-reduce that sums it over the ranks.
#[derive(Debug)]
pub struct RowParallel {
    inner: Box<dyn LinearWeights>,
    comm: Arc<dyn Communicator>,
    format: String,
}

impl RowParallel {
    pub fn new(inner: Box<dyn LinearWeights>, comm: Arc<dyn Communicator>) -> RowParallel {
        let format = format!("{} (row-parallel)", inner.format());
        RowParallel {
            inner,
            comm,
            format,
        }
    }
}

impl LinearWeights for RowParallel {
    fn out_features(&self) -> usize {
        self.inner.out_features()
    }

    fn in_features(&self) -> usize {
        self.inner.in_features()
    }

    fn apply_into(
        &self,
        x: &[f32],
        rows: usize,
        y: &mut [f32],
        threads: usize,
    ) -> Result<(), ModelError> {
        // y (rows, out): this rank's partial sum, then everyone's.
        self.inner.apply_into(x, rows, y, threads)?;
        self.comm.all_reduce_sum(y).map_err(collective)
    }

    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }

    fn format(&self) -> &str {
        &self.format
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A vocab-parallel LM head: this rank's V/P logits of each row, then an
/// all-gather into the whole (rows, V).
#[derive(Debug)]
pub struct VocabParallel {
    inner: Box<dyn LinearWeights>,
    comm: Arc<dyn Communicator>,
    format: String,
    /// (rows, V/P) this rank's, (P, rows, V/P) everyone's
    scratch: Mutex<(Vec<f32>, Vec<f32>)>,
}

impl VocabParallel {
    pub fn new(inner: Box<dyn LinearWeights>, comm: Arc<dyn Communicator>) -> VocabParallel {
        let format = format!("{} (vocab-parallel)", inner.format());
        VocabParallel {
            inner,
            comm,
            format,
            scratch: Mutex::new((Vec::new(), Vec::new())),
        }
    }
}

impl LinearWeights for VocabParallel {
    fn out_features(&self) -> usize {
        self.inner.out_features() * self.comm.world()
    }

    fn in_features(&self) -> usize {
        self.inner.in_features()
    }

    fn apply_into(
        &self,
        x: &[f32],
        rows: usize,
        y: &mut [f32],
        threads: usize,
    ) -> Result<(), ModelError> {
        let (part, world) = (self.inner.out_features(), self.comm.world());
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let (mine, all) = &mut *guard;
        mine.resize(rows * part, 0.0);
        all.resize(rows * part * world, 0.0);
        self.inner.apply_into(x, rows, mine, threads)?;
        self.comm.all_gather(mine, all).map_err(collective)?;
        // (P, rows, V/P) → (rows, V): rank p's logits are columns p·V/P.. of each row.
        let vocab = part * world;
        for p in 0..world {
            for r in 0..rows {
                y[r * vocab + p * part..][..part]
                    .copy_from_slice(&all[(p * rows + r) * part..][..part]);
            }
        }
        Ok(())
    }

    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }

    fn format(&self) -> &str {
        &self.format
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Load rank `comm.rank()` of `comm.world()`'s slice of the model at
/// `path` (a GGUF file, or an HF directory: f32 only) and wrap its
/// row-parallel projections (and a vocab-parallel head) in their
/// collectives. A world that does not divide the model's heads, K/V
/// heads or MLP width (or, for a vocab-parallel head, its vocabulary) is
/// refused with the numbers.
pub fn load_rank(
    path: &Path,
    weights: Weights,
    head: HeadSplit,
    comm: Arc<dyn Communicator>,
    threads: usize,
) -> Result<LoadedEngine, p05_kv_cache::LocalModelError> {
    let split = Split::new(comm.rank(), comm.world(), head).map_err(|e| ModelError::Config {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })?;
    let mut loaded = load_part(path, weights, split, threads)?;
    let m = &mut loaded.engine.model;
    if comm.world() > 1 {
        let wrap = |p: &mut Proj, f: &dyn Fn(Box<dyn LinearWeights>) -> Box<dyn LinearWeights>| {
            let taken = std::mem::replace(p, Proj::from_weights(Box::new(Empty)));
            *p = Proj::from_weights(f(taken.into_weights()));
        };
        let row = |w: Box<dyn LinearWeights>| -> Box<dyn LinearWeights> {
            Box::new(RowParallel::new(w, comm.clone()))
        };
        for b in m.blocks.iter_mut() {
            wrap(&mut b.wo, &row);
            wrap(&mut b.w_down, &row);
        }
        if head == HeadSplit::VocabParallel {
            wrap(&mut m.lm_head, &|w| {
                Box::new(VocabParallel::new(w, comm.clone()))
            });
        }
    }
    Ok(loaded)
}

/// `split`'s part of the model at `path`, in `weights`, its products on
/// `threads` threads (a pipeline stage's layers, or a tensor-parallel
/// rank's slices before their collectives are added).
pub fn load_part(
    path: &Path,
    weights: Weights,
    split: Split,
    threads: usize,
) -> Result<LoadedEngine, p05_kv_cache::LocalModelError> {
    let mut loaded = match weights {
        Weights::F32 => {
            p05_kv_cache::load::load_split(path, &p04_transformer::llama::F32Weights, split)?
        }
        Weights::Native => {
            let w = p10_quant::NativeWeights::detect();
            let mut l = p05_kv_cache::load::load_split(path, &w, split)?;
            l.engine.set_parallel(Arc::new(p10_quant::pool::GlobalPool));
            l
        }
    };
    loaded.engine.model.threads = threads.max(1);
    Ok(loaded)
}

/// A placeholder for the moment a projection is being wrapped.
#[derive(Debug)]
struct Empty;

impl LinearWeights for Empty {
    fn out_features(&self) -> usize {
        0
    }
    fn in_features(&self) -> usize {
        0
    }
    fn apply_into(&self, _: &[f32], _: usize, _: &mut [f32], _: usize) -> Result<(), ModelError> {
        Ok(())
    }
    fn weight_bytes(&self) -> usize {
        0
    }
    fn format(&self) -> &str {
        "empty"
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Bytes of weights this rank holds: its projections (the slices), the
/// embedding table and the norms (replicated).
pub fn weight_bytes(m: &p04_transformer::Llama) -> (usize, usize) {
    let mut proj = m.lm_head.weights().weight_bytes();
    let mut replicated = m.tok_embd.len() * 4 + m.out_norm.len() * 4;
    for b in &m.blocks {
        for p in [&b.wq, &b.wk, &b.wv, &b.wo, &b.w_gate, &b.w_up, &b.w_down] {
            proj += p.weights().weight_bytes();
        }
        replicated += (b.attn_norm.len() + b.ffn_norm.len()) * 4;
    }
    (proj, replicated)
}
