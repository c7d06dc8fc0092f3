//! GPT-2 behind the `Model` seam: learned positions are looked up at each
//! token's absolute position; K and V go to the cache (n_kv_head = n_head).
//! Simpler than the Llama engine: its projections allocate their outputs.

use common::{Model, ModelInfo};
use p01_engine::ops::{gelu_inplace, layernorm_rows, GeluApprox};
use p04_transformer::gpt2::Gpt2;
use p04_transformer::llama::attend;
use p04_transformer::ModelError;

use crate::kv_cache::KvCache;
use crate::EngineError;

#[derive(Debug)]
pub struct Gpt2Engine {
    pub model: Gpt2,
    info: ModelInfo,
}

impl Gpt2Engine {
    pub fn new(model: Gpt2, info: ModelInfo) -> Gpt2Engine {
        Gpt2Engine { model, info }
    }

    /// Run `ids` at positions cache.len.., writing the last token's logits.
    pub fn step(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        logits: &mut [f32],
    ) -> Result<(), EngineError> {
        let m = &self.model;
        let c = &m.cfg;
        let (n, p0) = (ids.len(), cache.len);
        cache.check_step(ids, c.n_positions, c.vocab_size, logits.len())?;
        let (d, nh) = (c.n_embd, c.n_head);
        let hd = d / nh;
        let t = m.threads;
        let ln = |x: &[f32], (w, b): &(Vec<f32>, Vec<f32>)| {
            let mut y = vec![0.0f32; x.len()];
            layernorm_rows(x, d, w, b, c.layer_norm_eps, &mut y);
            y
        };
        // 1. Token + position embeddings at absolute positions p0..p0+n.
        let mut x = vec![0.0f32; n * d];
        for (r, &id) in ids.iter().enumerate() {
            let (id, pos) = (id as usize, p0 + r);
            for (j, xv) in x[r * d..(r + 1) * d].iter_mut().enumerate() {
                *xv = m.wte[id * d + j] + m.wpe[pos * d + j];
            }
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let mut scores = vec![0.0f32; p0 + n];
        for (l, blk) in m.blocks.iter().enumerate() {
            // 2. Attention over the cache.
            let qkv = blk.c_attn.forward(&ln(&x, &blk.ln_1), n, t)?; // (n, 3 d)
            let part = |p: usize| -> Vec<f32> {
                qkv.chunks_exact(3 * d)
                    .flat_map(|r| r[p * d..(p + 1) * d].iter().copied())
                    .collect()
            };
            let (q, k, v) = (part(0), part(1), part(2));
            cache.write(l, &k, &v, n);
            let mut att = vec![0.0f32; n * d];
            for i in 0..n {
                for h in 0..nh {
                    let (keys, values) = cache.head(l, h);
                    attend(
                        &q[i * d + h * hd..][..hd],
                        keys,
                        values,
                        hd,
                        p0 + i + 1,
                        scale,
                        &mut scores,
                        &mut att[i * d + h * hd..][..hd],
                    );
                }
            }
            let o = blk.attn_proj.forward(&att, n, t)?;
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            // 3. MLP.
            let mut h = blk.c_fc.forward(&ln(&x, &blk.ln_2), n, t)?;
            gelu_inplace(&mut h, GeluApprox::Tanh);
            let o = blk.mlp_proj.forward(&h, n, t)?;
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
        }
        cache.len += n;
        // 4. Last position through the final LayerNorm and the tied head.
        let h = ln(&x[(n - 1) * d..], &m.ln_f);
        p02_matmul_bench::linear(&h, 1, &m.wte, c.vocab_size, None, logits, t)
            .map_err(ModelError::from)?;
        Ok(())
    }
}

impl Model for Gpt2Engine {
    type Cache = KvCache;
    type Error = EngineError;

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn prefill(&self, ids: &[u32], max_len: usize) -> Result<(Vec<f32>, KvCache), EngineError> {
        if ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let c = &self.model.cfg;
        if max_len > c.n_positions || ids.len() > max_len {
            return Err(ModelError::Context {
                len: ids.len().max(max_len),
                ctx: c.n_positions,
            }
            .into());
        }
        let mut cache = KvCache::new(c.n_layer, c.n_head, c.n_embd / c.n_head, max_len);
        let mut logits = vec![0.0f32; c.vocab_size];
        self.step(ids, &mut cache, &mut logits)?;
        Ok((logits, cache))
    }

    fn decode(
        &self,
        token: u32,
        cache: &mut KvCache,
        logits: &mut [f32],
    ) -> Result<(), EngineError> {
        self.step(&[token], cache, logits)
    }

    fn cache_bytes(&self, cache: &KvCache) -> usize {
        cache.allocated_bytes()
    }
}
