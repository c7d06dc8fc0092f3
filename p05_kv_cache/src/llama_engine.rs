//! SmolLM2 / Llama behind the `Model` seam: prefill fills the cache with the
//! prompt's keys and values; decode runs one token against them.
//!
//! `step` handles n new tokens at positions len..len+n (n = prompt length at
//! prefill, 1 at decode): the same narrative as p04's forward, except that K
//! and V go into the cache and each query attends over the cached positions.

use common::{Model, ModelInfo};
use p04_transformer::llama::{apply_rope, attend, rms_norm_into, rope_tables, silu, Llama};
use p04_transformer::ModelError;
use rayon::prelude::*;

use crate::kv_cache::KvCache;
use crate::EngineError;

/// A Llama with its RoPE tables precomputed for the whole context.
#[derive(Debug)]
pub struct LlamaEngine {
    pub model: Llama,
    info: ModelInfo,
    /// (context, head_dim / 2)
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// A sequence's state: the cache and every activation buffer a step needs
/// (they grow at prefill; a decode step then allocates nothing).
#[derive(Debug)]
pub struct LlamaCache {
    pub kv: KvCache,
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    scores: Vec<f32>,
}

fn grow(b: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if b.len() < n {
        b.resize(n, 0.0);
    }
    &mut b[..n]
}

impl LlamaEngine {
    pub fn new(model: Llama, info: ModelInfo) -> LlamaEngine {
        let c = &model.cfg;
        let (cos, sin) = rope_tables(c.max_seq, c.head_dim, c.rope_theta);
        LlamaEngine {
            model,
            info,
            cos,
            sin,
        }
    }

    /// An empty cache for up to `max_len` positions.
    pub fn new_cache(&self, max_len: usize) -> LlamaCache {
        let c = &self.model.cfg;
        LlamaCache {
            kv: KvCache::new(c.n_layer, c.n_kv_head, c.head_dim, max_len),
            x: Vec::new(),
            h: Vec::new(),
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            att: Vec::new(),
            o: Vec::new(),
            g: Vec::new(),
            u: Vec::new(),
            scores: vec![0.0; max_len],
        }
    }

    /// Run `ids` at positions cache.len.., writing the last token's logits.
    pub fn step(
        &self,
        ids: &[u32],
        cache: &mut LlamaCache,
        logits: &mut [f32],
    ) -> Result<(), EngineError> {
        let m = &self.model;
        let c = &m.cfg;
        let n = ids.len();
        let p0 = cache.kv.len;
        cache
            .kv
            .check_step(ids, c.max_seq, c.vocab_size, logits.len())?;
        let (d, hd, nh, nkv, ff) = (
            c.hidden_size,
            c.head_dim,
            c.n_head,
            c.n_kv_head,
            c.intermediate_size,
        );
        let t = m.threads;
        let half = hd / 2;
        let LlamaCache {
            kv,
            x,
            h,
            q,
            k,
            v,
            att,
            o,
            g,
            u,
            scores,
        } = cache;
        let (x, h) = (grow(x, n * d), grow(h, n * d));
        let (q, k, v) = (
            grow(q, n * nh * hd),
            grow(k, n * nkv * hd),
            grow(v, n * nkv * hd),
        );
        let (att, o) = (grow(att, n * nh * hd), grow(o, n * d));
        let (g, u) = (grow(g, n * ff), grow(u, n * ff));

        // 1. Embeddings of the new tokens.
        for (r, &id) in ids.iter().enumerate() {
            let id = id as usize;
            x[r * d..(r + 1) * d].copy_from_slice(&m.tok_embd[id * d..(id + 1) * d]);
        }
        let (cos, sin) = (&self.cos[p0 * half..], &self.sin[p0 * half..]);
        let scale = 1.0 / (hd as f32).sqrt();
        for (l, blk) in m.blocks.iter().enumerate() {
            // 2. Attention: project, rotate at their absolute positions, append to the cache,
            //    then each new query attends over positions 0..=its own.
            rms_norm_into(x, d, &blk.attn_norm, c.rms_norm_eps, h);
            blk.wq.apply_into(h, n, q, t)?;
            blk.wk.apply_into(h, n, k, t)?;
            blk.wv.apply_into(h, n, v, t)?;
            apply_rope(q, 1, n, nh, hd, cos, sin);
            apply_rope(k, 1, n, nkv, hd, cos, sin);
            kv.write(l, k, v, n);
            let kv_ref: &KvCache = kv;
            // Query row i (position p0 + i) attends over cached positions 0..=p0 + i.
            let attend_row = |i: usize, row: &mut [f32], scores: &mut [f32]| {
                for head in 0..nh {
                    let (keys, values) = kv_ref.head(l, head / (nh / nkv));
                    let qi = &q[(i * nh + head) * hd..][..hd];
                    attend(
                        qi,
                        keys,
                        values,
                        hd,
                        p0 + i + 1,
                        scale,
                        scores,
                        &mut row[head * hd..(head + 1) * hd],
                    );
                }
            };
            if n == 1 {
                for (i, row) in att.chunks_exact_mut(nh * hd).enumerate() {
                    attend_row(i, row, scores);
                }
            } else {
                // Prefill: per head, S = Q K^T and O = softmax(S) V as two
                // matmuls over all n queries at once (heads in parallel).
                let per_head: Vec<Vec<f32>> = (0..nh)
                    .into_par_iter()
                    .map(|head| {
                        prefill_head(q, kv_ref, l, head / (nh / nkv), head, nh, hd, p0, n, scale)
                    })
                    .collect::<Result<_, _>>()?;
                for (head, oh) in per_head.iter().enumerate() {
                    for i in 0..n {
                        att[(i * nh + head) * hd..][..hd]
                            .copy_from_slice(&oh[i * hd..(i + 1) * hd]);
                    }
                }
            }
            blk.wo.apply_into(att, n, o, t)?;
            x.iter_mut().zip(o.iter()).for_each(|(x, o)| *x += o);
            // 3. SwiGLU MLP.
            rms_norm_into(x, d, &blk.ffn_norm, c.rms_norm_eps, h);
            blk.w_gate.apply_into(h, n, g, t)?;
            blk.w_up.apply_into(h, n, u, t)?;
            g.iter_mut()
                .zip(u.iter())
                .for_each(|(g, u)| *g = silu(*g) * u);
            blk.w_down.apply_into(g, n, o, t)?;
            x.iter_mut().zip(o.iter()).for_each(|(x, o)| *x += o);
        }
        kv.len += n;
        // 4. Only the last position's logits are needed to continue.
        let last = &x[(n - 1) * d..n * d];
        rms_norm_into(last, d, &m.out_norm, c.rms_norm_eps, &mut h[..d]);
        m.lm_head.apply_into(&h[..d], 1, logits, t)?;
        Ok(())
    }
}

/// One head's causal attention for n queries at positions p0..p0+n over the
/// cached keys 0..p0+n, as two matmuls: S = scale Q K^T (n, p0+n), the causal
/// mask and a row softmax, then O = S V (n, head_dim).
#[allow(clippy::too_many_arguments)]
fn prefill_head(
    q: &[f32],
    kv: &KvCache,
    layer: usize,
    kv_head: usize,
    head: usize,
    nh: usize,
    hd: usize,
    p0: usize,
    n: usize,
    scale: f32,
) -> Result<Vec<f32>, EngineError> {
    use p02_matmul_bench::{sgemm, GemmOpts, MatMut, MatRef};
    let keys_n = p0 + n;
    let (keys, values) = kv.head(layer, kv_head);
    let one = GemmOpts {
        threads: 1,
        ..GemmOpts::default()
    };
    let gemm_err = |e| EngineError::Model(ModelError::Gemm(e));
    let qh = MatRef::new(&q[head * hd..], n, hd, nh * hd, 1).map_err(gemm_err)?;
    let kt = MatRef::new(keys, keys_n, hd, hd, 1).map_err(gemm_err)?.t();
    let mut s = vec![0.0f32; n * keys_n];
    sgemm(
        qh,
        kt,
        &mut MatMut::row_major(&mut s, n, keys_n).map_err(gemm_err)?,
        GemmOpts {
            alpha: scale,
            ..one
        },
    )
    .map_err(gemm_err)?;
    for (i, row) in s.chunks_exact_mut(keys_n).enumerate() {
        let visible = p0 + i + 1; // the causal mask: keys after position p0 + i are hidden
        let max = row[..visible]
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for x in &mut row[..visible] {
            *x = (*x - max).exp();
            sum += *x;
        }
        for x in &mut row[..visible] {
            *x /= sum;
        }
        row[visible..].fill(0.0);
    }
    let v = MatRef::new(values, keys_n, hd, hd, 1).map_err(gemm_err)?;
    let mut o = vec![0.0f32; n * hd];
    sgemm(
        MatRef::row_major(&s, n, keys_n).map_err(gemm_err)?,
        v,
        &mut MatMut::row_major(&mut o, n, hd).map_err(gemm_err)?,
        one,
    )
    .map_err(gemm_err)?;
    Ok(o)
}

impl Model for LlamaEngine {
    type Cache = LlamaCache;
    type Error = EngineError;

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn prefill(&self, ids: &[u32], max_len: usize) -> Result<(Vec<f32>, LlamaCache), EngineError> {
        if ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if max_len > self.model.cfg.max_seq || ids.len() > max_len {
            return Err(ModelError::Context {
                len: ids.len().max(max_len),
                ctx: self.model.cfg.max_seq.min(max_len.max(ids.len())),
            }
            .into());
        }
        let mut cache = self.new_cache(max_len);
        let mut logits = vec![0.0f32; self.model.cfg.vocab_size];
        self.step(ids, &mut cache, &mut logits)?;
        Ok((logits, cache))
    }

    fn decode(
        &self,
        token: u32,
        cache: &mut LlamaCache,
        logits: &mut [f32],
    ) -> Result<(), EngineError> {
        self.step(&[token], cache, logits)
    }

    fn cache_bytes(&self, cache: &LlamaCache) -> usize {
        cache.kv.allocated_bytes()
    }
}
