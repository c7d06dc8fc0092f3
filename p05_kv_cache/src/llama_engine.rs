//! SmolLM2 / Llama on the batched, ragged step, and behind the `Model` seam
//! as a one-sequence adapter over it.
//!
//! `forward_batch` is p04's forward narrative over all the step's tokens at
//! once: embeddings, then per layer RMSNorm → Q/K/V (one matmul over every
//! token of every sequence) → RoPE at each token's own position → K/V
//! appended to each sequence's store → attention per sequence → output
//! projection → SwiGLU MLP (one matmul again), and the head only for each
//! sequence's last token.

use std::sync::{Arc, Mutex};

use common::batch::{Batch, BatchModel, KvShape, KvStore};
use common::par::ForRanges;
use common::{Model, ModelInfo};
use p04_transformer::llama::{apply_rope, rms_norm_into, rope_tables, silu, Llama};
use p04_transformer::{ModelError, Proj};

use crate::attention::{attention_step, AttentionScratch, Heads};
use crate::kv_cache::KvCache;
use crate::LocalModelError;

/// A Llama with its RoPE tables precomputed for the whole context.
#[derive(Debug)]
pub struct LlamaEngine {
    pub model: Llama,
    info: ModelInfo,
    /// (context, head_dim / 2)
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// The `Model` adapter's step: one batch of one sequence and the
    /// workspace it runs in (a serial caller never waits on this lock).
    adapter: Mutex<(Batch, LlamaWorkspace)>,
    /// The threads the attention splits its rows over: rayon's by default,
    /// the projections' own pool where a weight format brings one.
    par: Arc<dyn ForRanges>,
}

/// The scratch buffers of one step, sized by its token count (they grow to
/// the largest step seen and are kept: a decode step then allocates nothing).
#[derive(Debug, Default)]
pub struct LlamaWorkspace {
    /// (n_tokens, hidden) the residual stream
    x: Vec<f32>,
    /// (n_tokens, hidden) normalised input of a sub-layer
    h: Vec<f32>,
    /// (n_tokens, n_head * head_dim)
    q: Vec<f32>,
    /// (n_tokens, n_kv_head * head_dim)
    k: Vec<f32>,
    v: Vec<f32>,
    /// (n_tokens, n_head * head_dim)
    att: Vec<f32>,
    /// (n_tokens, hidden) a sub-layer's output
    o: Vec<f32>,
    /// (n_tokens, intermediate)
    g: Vec<f32>,
    u: Vec<f32>,
    /// (n_seqs, hidden) each sequence's last row, then normalised
    last: Vec<f32>,
    last_h: Vec<f32>,
    attn: AttentionScratch,
}

/// A sequence's state between steps in the `Model` adapter: its K/V only.
#[derive(Debug)]
pub struct LlamaCache {
    pub kv: KvCache,
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
            adapter: Mutex::new((Batch::new(), LlamaWorkspace::default())),
            par: Arc::new(crate::simd::RayonRanges),
        }
    }

    /// Run the attention's rows on `par` (Project 10 hands its pool, so a
    /// step's products and attention share one set of threads).
    pub fn set_parallel(&mut self, par: Arc<dyn ForRanges>) {
        self.par = par;
    }

    /// An empty cache for up to `max_len` positions (never more than the
    /// context: a larger request could only allocate room no step may use).
    pub fn new_cache(&self, max_len: usize) -> LlamaCache {
        let s = self.kv_shape();
        LlamaCache {
            kv: KvCache::new(
                s.n_layer,
                s.n_kv_head,
                s.head_dim,
                max_len.min(self.model.cfg.max_seq),
            ),
        }
    }

    /// One sequence's step: `ids` at positions cache.len.., the last
    /// token's logits into `logits` (vocab). A batch of one.
    pub fn step(
        &self,
        ids: &[u32],
        cache: &mut LlamaCache,
        logits: &mut [f32],
    ) -> Result<(), LocalModelError> {
        let mut guard = self.adapter.lock().unwrap_or_else(|e| e.into_inner());
        let (batch, ws) = &mut *guard;
        common::batch::forward_one(self, batch, ws, ids, &mut cache.kv, logits)
    }

    /// One sequence's step that keeps the logits of every position, not
    /// only the last: `logits` is (ids.len(), vocab). What a perplexity pass
    /// needs: each position's prediction of the next token.
    pub fn forward_all(
        &self,
        ids: &[u32],
        cache: &mut LlamaCache,
        logits: &mut [f32],
    ) -> Result<(), LocalModelError> {
        let mut guard = self.adapter.lock().unwrap_or_else(|e| e.into_inner());
        let (batch, ws) = &mut *guard;
        batch.clear();
        batch.push(ids, cache.kv.len())?;
        let mut store = &mut cache.kv;
        self.forward(
            batch,
            std::slice::from_mut(&mut store),
            ws,
            None,
            Out::Logits(logits, Head::All),
        )
    }
}

/// Which rows of the final hidden state go through the LM head.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Head {
    /// Each sequence's last token (generation).
    Last,
    /// Every token (scoring a text).
    All,
}

impl BatchModel for LlamaEngine {
    type Workspace = LlamaWorkspace;
    /// This process's layers and K/V heads (a pipeline stage keeps its
    /// layers', a tensor-parallel rank its heads').
    fn kv_shape(&self) -> KvShape {
        let c = &self.model.cfg;
        KvShape {
            n_layer: self.model.blocks.len(),
            n_kv_head: self.model.part_dims().n_kv_head,
            head_dim: c.head_dim,
        }
    }

    fn new_workspace(&self) -> LlamaWorkspace {
        LlamaWorkspace::default()
    }

    fn forward_batch<S: KvStore>(
        &self,
        batch: &Batch,
        stores: &mut [&mut S],
        ws: &mut LlamaWorkspace,
        logits: &mut [f32],
    ) -> Result<(), LocalModelError> {
        self.forward(batch, stores, ws, None, Out::Logits(logits, Head::Last))
    }
}

/// Where a pipeline stage's step ends (Project 13).
#[derive(Debug)]
pub enum StageOut<'a> {
    /// The residual stream after this stage's layers, (n_tokens, hidden),
    /// for the next stage.
    Hidden(&'a mut Vec<f32>),
    /// The last stage: each sequence's last row through the head, (n_seqs, vocab).
    Logits(&'a mut [f32]),
}

/// What `forward` produces.
enum Out<'a> {
    Hidden(&'a mut Vec<f32>),
    Logits(&'a mut [f32], Head),
}

impl LlamaEngine {
    /// One pipeline stage's share of a step: this engine's layers (a
    /// stage keeps only its own, Project 04's `Split::stage`) over the
    /// step, starting from the previous stage's residual stream `input`
    /// (n_tokens, hidden), or from the embeddings on the first stage
    /// (`None`), and ending as `out` says.
    pub fn forward_stage<S: KvStore>(
        &self,
        batch: &Batch,
        stores: &mut [&mut S],
        ws: &mut LlamaWorkspace,
        input: Option<&[f32]>,
        out: StageOut<'_>,
    ) -> Result<(), LocalModelError> {
        let out = match out {
            StageOut::Hidden(h) => Out::Hidden(h),
            StageOut::Logits(l) => Out::Logits(l, Head::Last),
        };
        self.forward(batch, stores, ws, input, out)
    }
}

impl LlamaEngine {
    /// The step behind `forward_batch`, `forward_all` and
    /// `forward_stage`: every sequence's new tokens through this engine's
    /// layers, from the embeddings (or a previous stage's `input`), to the
    /// LM head (its `Head` picks the rows it sees: each sequence's last,
    /// or every token) or to the next stage.
    fn forward<S: KvStore>(
        &self,
        batch: &Batch,
        stores: &mut [&mut S],
        ws: &mut LlamaWorkspace,
        input: Option<&[f32]>,
        out: Out<'_>,
    ) -> Result<(), LocalModelError> {
        let m = &self.model;
        let c = &m.cfg;
        let (n, n_seqs) = (batch.n_tokens(), batch.n_seqs());
        let (logits_len, logit_rows) = match &out {
            Out::Logits(l, Head::All) => (l.len(), n),
            Out::Logits(l, Head::Last) => (l.len(), n_seqs),
            Out::Hidden(_) => (0, 0),
        };
        batch.check_rows(
            stores,
            self.kv_shape(),
            c.max_seq,
            c.vocab_size,
            logits_len,
            logit_rows,
        )?;
        if let Some(x) = input {
            if x.len() != n * c.hidden_size {
                return Err(LocalModelError::StageInput {
                    len: x.len(),
                    want: n * c.hidden_size,
                });
            }
        }
        // This process's heads and MLP width: the whole model's, or a
        // tensor-parallel rank's part (Project 13), whose row-parallel
        // projections (wo, w_down) complete their partial sums themselves.
        let part = m.part_dims();
        let (d, hd, nh, nkv, ff) = (
            c.hidden_size,
            c.head_dim,
            part.n_head,
            part.n_kv_head,
            part.intermediate_size,
        );
        let heads = Heads {
            n_head: nh,
            n_kv_head: nkv,
            head_dim: hd,
        };
        let (t, half, eps) = (m.threads, hd / 2, c.rms_norm_eps);
        // One thread asked for: the attention stays on this one too.
        let par: &dyn ForRanges = if t <= 1 {
            &common::par::Serial
        } else {
            &*self.par
        };
        let LlamaWorkspace {
            x,
            h,
            q,
            k,
            v,
            att,
            o,
            g,
            u,
            last,
            last_h,
            attn,
        } = ws;
        let (x, h) = (grow(x, n * d), grow(h, n * d)); // (n_tokens, hidden)
        let q = grow(q, n * nh * hd); // (n_tokens, n_head * head_dim)
        let (k, v) = (grow(k, n * nkv * hd), grow(v, n * nkv * hd)); // (n_tokens, n_kv_head * head_dim)
        let (att, o) = (grow(att, n * nh * hd), grow(o, n * d));
        let (g, u) = (grow(g, n * ff), grow(u, n * ff)); // (n_tokens, intermediate)

        // 1. Embeddings of every new token of every sequence (or the
        //    residual stream the previous pipeline stage hands over).
        match input {
            Some(prev) => x.copy_from_slice(prev),
            None => {
                for (r, &id) in batch.tokens().iter().enumerate() {
                    let id = id as usize;
                    x[r * d..(r + 1) * d].copy_from_slice(&m.tok_embd[id * d..(id + 1) * d]);
                }
            }
        }
        let scale = 1.0 / (hd as f32).sqrt();
        for (l, blk) in m.blocks.iter().enumerate() {
            // 2. Attention. Q, K, V for all tokens in one matmul each; each
            //    sequence's rows rotated at their own positions and its K/V
            //    appended to its own store; then attention per sequence.
            rms_norm_into(x, d, &blk.attn_norm, eps, h);
            Proj::apply_group(
                &[&blk.wq, &blk.wk, &blk.wv],
                h,
                n,
                &mut [&mut *q, &mut *k, &mut *v],
                t,
            )?;
            for (s, store) in batch.seqs().iter().zip(stores.iter_mut()) {
                let (cos, sin) = (
                    &self.cos[s.start_pos * half..],
                    &self.sin[s.start_pos * half..],
                );
                let rows = s.offset..s.offset + s.len;
                apply_rope(
                    &mut q[rows.start * nh * hd..rows.end * nh * hd],
                    1,
                    s.len,
                    nh,
                    hd,
                    cos,
                    sin,
                );
                let kr = &mut k[rows.start * nkv * hd..rows.end * nkv * hd];
                apply_rope(kr, 1, s.len, nkv, hd, cos, sin);
                store.write(l, kr, &v[rows.start * nkv * hd..rows.end * nkv * hd], s.len);
            }
            attention_step(q, batch, stores, l, heads, scale, attn, att, par)
                .map_err(ModelError::from)?;
            blk.wo.apply_into(att, n, o, t)?;
            x.iter_mut().zip(o.iter()).for_each(|(x, o)| *x += o);
            // 3. SwiGLU MLP over all tokens.
            rms_norm_into(x, d, &blk.ffn_norm, eps, h);
            Proj::apply_group(&[&blk.w_gate, &blk.w_up], h, n, &mut [&mut *g, &mut *u], t)?;
            g.iter_mut()
                .zip(u.iter())
                .for_each(|(g, u)| *g = silu(*g) * u);
            blk.w_down.apply_into(g, n, o, t)?;
            x.iter_mut().zip(o.iter()).for_each(|(x, o)| *x += o);
        }
        for (s, store) in batch.seqs().iter().zip(stores.iter_mut()) {
            store.advance(s.len);
        }
        // 4. The head: over every row when scoring a text, else only over
        //    each sequence's last row; or the stream to the next stage.
        let (logits, head) = match out {
            Out::Hidden(next) => {
                next.clear();
                next.extend_from_slice(x);
                return Ok(());
            }
            Out::Logits(l, h) => (l, h),
        };
        if head == Head::All {
            rms_norm_into(x, d, &m.out_norm, eps, h);
            m.lm_head.apply_into(h, n, logits, t)?;
            return Ok(());
        }
        let (last, last_h) = (grow(last, n_seqs * d), grow(last_h, n_seqs * d)); // (n_seqs, hidden)
        for (i, s) in batch.seqs().iter().enumerate() {
            let r = s.offset + s.len - 1;
            last[i * d..(i + 1) * d].copy_from_slice(&x[r * d..(r + 1) * d]);
        }
        rms_norm_into(last, d, &m.out_norm, eps, last_h);
        m.lm_head.apply_into(last_h, n_seqs, logits, t)?;
        Ok(())
    }
}

impl Model for LlamaEngine {
    type Cache = LlamaCache;
    type Error = LocalModelError;

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn prefill(
        &self,
        ids: &[u32],
        max_len: usize,
    ) -> Result<(Vec<f32>, LlamaCache), LocalModelError> {
        if ids.is_empty() {
            return Err(LocalModelError::EmptyPrompt);
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
    ) -> Result<(), LocalModelError> {
        self.step(&[token], cache, logits)
    }

    fn cache_bytes(&self, cache: &LlamaCache) -> usize {
        cache.kv.allocated_bytes()
    }
}
