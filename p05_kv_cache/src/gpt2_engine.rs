//! GPT-2 on the batched, ragged step and behind the `Model` seam: learned
//! positions are looked up at each token's absolute position; K and V go to
//! each sequence's store (n_kv_head = n_head). Simpler than the Llama
//! engine: its projections allocate their outputs, and its workspace holds
//! only the attention's scratch.

use std::sync::Mutex;

use common::batch::{Batch, BatchModel, KvShape, KvStore};
use common::{Model, ModelInfo};
use p01_engine::ops::{gelu_inplace, layernorm_rows, GeluApprox};
use p04_transformer::gpt2::Gpt2;
use p04_transformer::ModelError;

use crate::attention::{attention_step, AttentionScratch, Heads};
use crate::kv_cache::KvCache;
use crate::LocalModelError;

#[derive(Debug)]
pub struct Gpt2Engine {
    pub model: Gpt2,
    info: ModelInfo,
    /// The `Model` adapter's batch of one and its workspace.
    adapter: Mutex<(Batch, AttentionScratch)>,
}

impl Gpt2Engine {
    pub fn new(model: Gpt2, info: ModelInfo) -> Gpt2Engine {
        Gpt2Engine {
            model,
            info,
            adapter: Mutex::new((Batch::new(), AttentionScratch::default())),
        }
    }

    /// One sequence's step: `ids` at positions cache.len.., the last
    /// token's logits into `logits`. A batch of one.
    pub fn step(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        logits: &mut [f32],
    ) -> Result<(), LocalModelError> {
        let mut guard = self.adapter.lock().unwrap_or_else(|e| e.into_inner());
        let (batch, ws) = &mut *guard;
        common::batch::forward_one(self, batch, ws, ids, cache, logits)
    }
}

impl BatchModel for Gpt2Engine {
    type Workspace = AttentionScratch;
    fn kv_shape(&self) -> KvShape {
        let c = &self.model.cfg;
        KvShape {
            n_layer: c.n_layer,
            n_kv_head: c.n_head,
            head_dim: c.n_embd / c.n_head,
        }
    }

    fn new_workspace(&self) -> AttentionScratch {
        AttentionScratch::default()
    }

    fn forward_batch<S: KvStore>(
        &self,
        batch: &Batch,
        stores: &mut [&mut S],
        ws: &mut AttentionScratch,
        logits: &mut [f32],
    ) -> Result<(), LocalModelError> {
        let m = &self.model;
        let c = &m.cfg;
        batch.check(
            stores,
            self.kv_shape(),
            c.n_positions,
            c.vocab_size,
            logits.len(),
        )?;
        let (n, n_seqs) = (batch.n_tokens(), batch.n_seqs());
        let (d, nh) = (c.n_embd, c.n_head);
        let hd = d / nh;
        let heads = Heads {
            n_head: nh,
            n_kv_head: nh,
            head_dim: hd,
        };
        let t = m.threads;
        let ln = |x: &[f32], (w, b): &(Vec<f32>, Vec<f32>)| {
            let mut y = vec![0.0f32; x.len()];
            layernorm_rows(x, d, w, b, c.layer_norm_eps, &mut y);
            y
        };
        // 1. Token + position embeddings, each token at its own sequence's position.
        let mut x = vec![0.0f32; n * d]; // (n_tokens, n_embd)
        for s in batch.seqs() {
            for r in 0..s.len {
                let (id, pos) = (batch.tokens()[s.offset + r] as usize, s.start_pos + r);
                let row = &mut x[(s.offset + r) * d..(s.offset + r + 1) * d];
                for (j, xv) in row.iter_mut().enumerate() {
                    *xv = m.wte[id * d + j] + m.wpe[pos * d + j];
                }
            }
        }
        let scale = 1.0 / (hd as f32).sqrt();
        for (l, blk) in m.blocks.iter().enumerate() {
            // 2. Attention: Q, K, V for all tokens; K/V to each sequence's store.
            let qkv = blk.c_attn.forward(&ln(&x, &blk.ln_1), n, t)?; // (n_tokens, 3 n_embd)
            let part = |p: usize| -> Vec<f32> {
                qkv.chunks_exact(3 * d)
                    .flat_map(|r| r[p * d..(p + 1) * d].iter().copied())
                    .collect()
            };
            let (q, k, v) = (part(0), part(1), part(2)); // each (n_tokens, n_embd)
            for (s, store) in batch.seqs().iter().zip(stores.iter_mut()) {
                let rows = s.offset * d..(s.offset + s.len) * d;
                store.write(l, &k[rows.clone()], &v[rows], s.len);
            }
            let mut att = vec![0.0f32; n * d];
            attention_step(
                &q,
                batch,
                stores,
                l,
                heads,
                scale,
                ws,
                &mut att,
                &crate::simd::RayonRanges,
            )
            .map_err(ModelError::from)?;
            let o = blk.attn_proj.forward(&att, n, t)?;
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            // 3. MLP.
            let mut h = blk.c_fc.forward(&ln(&x, &blk.ln_2), n, t)?;
            gelu_inplace(&mut h, GeluApprox::Tanh);
            let o = blk.mlp_proj.forward(&h, n, t)?;
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
        }
        for (s, store) in batch.seqs().iter().zip(stores.iter_mut()) {
            store.advance(s.len);
        }
        // 4. Each sequence's last row through the final LayerNorm and the tied head.
        let last: Vec<f32> = batch
            .seqs()
            .iter()
            .flat_map(|s| {
                x[(s.offset + s.len - 1) * d..(s.offset + s.len) * d]
                    .iter()
                    .copied()
            })
            .collect(); // (n_seqs, n_embd)
        let h = ln(&last, &m.ln_f);
        p02_matmul_bench::linear(&h, n_seqs, &m.wte, c.vocab_size, None, logits, t)
            .map_err(ModelError::from)?;
        Ok(())
    }
}

impl Model for Gpt2Engine {
    type Cache = KvCache;
    type Error = LocalModelError;

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn prefill(&self, ids: &[u32], max_len: usize) -> Result<(Vec<f32>, KvCache), LocalModelError> {
        if ids.is_empty() {
            return Err(LocalModelError::EmptyPrompt);
        }
        let c = &self.model.cfg;
        if max_len > c.n_positions || ids.len() > max_len {
            return Err(ModelError::Context {
                len: ids.len().max(max_len),
                ctx: c.n_positions,
            }
            .into());
        }
        let s = self.kv_shape();
        let mut cache = KvCache::new(s.n_layer, s.n_kv_head, s.head_dim, max_len);
        let mut logits = vec![0.0f32; c.vocab_size];
        self.step(ids, &mut cache, &mut logits)?;
        Ok((logits, cache))
    }

    fn decode(
        &self,
        token: u32,
        cache: &mut KvCache,
        logits: &mut [f32],
    ) -> Result<(), LocalModelError> {
        self.step(&[token], cache, logits)
    }

    fn cache_bytes(&self, cache: &KvCache) -> usize {
        cache.allocated_bytes()
    }
}
