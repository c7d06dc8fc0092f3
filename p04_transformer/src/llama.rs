//! Llama-family forward pass (SmolLM2, TinyLlama, Llama 2/3 shapes): RMSNorm,
//! rotary position embeddings, grouped-query attention, SwiGLU, tied or
//! untied output head. One narrative `forward`, weights loaded from a GGUF
//! file or a Hugging Face directory.

use std::path::Path;

use common::Tensor;

use crate::error::ModelError;
use crate::model_file::GgufFile;
pub use crate::proj::{F32Weights, LinearWeights, Proj, ProjLoader};
use crate::segments::Segmented;
pub use crate::split::{HeadSplit, Keep, Role, Split, SplitError};
use crate::weights::{HfDir, Source};

/// Hyper-parameters (names follow the Llama paper / HF config).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    /// d_model
    pub hidden_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    /// SwiGLU hidden width.
    pub intermediate_size: usize,
    pub rope_theta: f32,
    pub rms_norm_eps: f32,
    pub max_seq: usize,
}

/// Where forward time goes.
#[derive(Clone, Copy, Debug, Default)]
pub struct Profile {
    /// The softmax(QK^T)V part (the rest is matmuls and elementwise ops).
    pub attention: std::time::Duration,
}

/// The sizes of the part of a block one process computes: the whole
/// model's, or under tensor parallelism 1/P of its heads and MLP width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartDims {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub intermediate_size: usize,
}

/// One decoder block's weights, (out, in) as PyTorch stores them.
#[derive(Debug)]
pub struct LlamaBlock {
    /// (hidden)
    pub attn_norm: Vec<f32>,
    /// (n_head * head_dim, hidden), rows in HF order (un-permuted from GGUF)
    pub wq: Proj,
    /// (n_kv_head * head_dim, hidden)
    pub wk: Proj,
    /// (n_kv_head * head_dim, hidden)
    pub wv: Proj,
    /// (hidden, n_head * head_dim)
    pub wo: Proj,
    /// (hidden)
    pub ffn_norm: Vec<f32>,
    /// (intermediate, hidden)
    pub w_gate: Proj,
    /// (intermediate, hidden)
    pub w_up: Proj,
    /// (hidden, intermediate)
    pub w_down: Proj,
}

/// A loaded Llama model (f32 weights).
#[derive(Debug)]
pub struct Llama {
    pub cfg: LlamaConfig,
    /// (vocab, hidden)
    pub tok_embd: Vec<f32>,
    pub blocks: Vec<LlamaBlock>,
    /// (hidden)
    pub out_norm: Vec<f32>,
    /// (vocab, hidden): its own matrix, or a packed copy of `tok_embd` when tied.
    pub lm_head: Proj,
    /// Whether the head is the embedding matrix.
    pub tied: bool,
    /// The part of each projection kept ([`Split::whole`] but under tensor
    /// parallelism); `cfg` is the whole model's either way.
    pub split: Split,
    /// Threads for the matmuls.
    pub threads: usize,
}

/// GGUF stores Q and K rows permuted for llama.cpp's interleaved RoPE: per
/// head, HF row (j, r) (j in {0, 1} halves, r < head_dim/2) sits at GGUF row
/// (r, j). For each HF row, the GGUF row it comes from.
pub fn qk_row_source(n_head: usize, head_dim: usize) -> Vec<usize> {
    let half = head_dim / 2;
    let mut src = vec![0; n_head * head_dim];
    for h in 0..n_head {
        for j in 0..2 {
            for r in 0..half {
                src[h * head_dim + j * half + r] = h * head_dim + 2 * r + j;
            }
        }
    }
    src
}

/// Undo GGUF's Q/K row permutation (see [`qk_row_source`]) so the HF
/// rotate-half RoPE applies. `None` unless `w` is (n_head * head_dim, cols).
pub fn unpermute_qk(w: &[f32], n_head: usize, head_dim: usize, cols: usize) -> Option<Vec<f32>> {
    let rows = n_head.checked_mul(head_dim)?;
    if rows.checked_mul(cols)? != w.len() {
        return None;
    }
    Keep::whole([rows, cols], Some(qk_row_source(n_head, head_dim))).take(w)
}

impl Llama {
    /// Heads and MLP width of this process's part of each block.
    pub fn part_dims(&self) -> PartDims {
        let (c, p) = (&self.cfg, self.split.size.max(1));
        PartDims {
            n_head: c.n_head / p,
            n_kv_head: self.split.kv_heads(c.n_kv_head).len(),
            intermediate_size: c.intermediate_size / p,
        }
    }

    /// Load from a GGUF file (architecture `llama`), every weight
    /// dequantised to f32.
    pub fn from_gguf(f: &GgufFile) -> Result<Llama, ModelError> {
        Llama::from_gguf_with(f, &F32Weights)
    }

    /// Load from a GGUF file, `loader` choosing each projection's weight
    /// format (Project 10 keeps the file's quantised blocks).
    pub fn from_gguf_with(f: &GgufFile, loader: &dyn ProjLoader) -> Result<Llama, ModelError> {
        Llama::from_gguf_split(f, loader, Split::whole())
    }

    /// [`Llama::from_gguf_with`] keeping only `split`'s part of each
    /// projection (a tensor-parallel rank's slice, Project 13); the
    /// embedding table and the norms are kept whole.
    pub fn from_gguf_split(
        f: &GgufFile,
        loader: &dyn ProjLoader,
        split: Split,
    ) -> Result<Llama, ModelError> {
        let h = &f.header;
        let arch = h.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(ModelError::Arch {
                path: f.path.clone(),
                found: arch.to_string(),
                supported: "llama",
            });
        }
        let u = |k: &str| h.get_u64(&format!("llama.{k}")).map(|v| v as usize);
        let hidden = u("embedding_length")?;
        let n_head = u("attention.head_count")?;
        let vocab = match h.get_u64("llama.vocab_size") {
            Ok(v) => v as usize,
            Err(_) => h.tensor("token_embd.weight")?.shape()[0],
        };
        let cfg = LlamaConfig {
            vocab_size: vocab,
            hidden_size: hidden,
            n_layer: u("block_count")?,
            n_head,
            n_kv_head: u("attention.head_count_kv").unwrap_or(n_head),
            head_dim: hidden.checked_div(n_head).unwrap_or(0),
            intermediate_size: u("feed_forward_length")?,
            rope_theta: h.get_f64("llama.rope.freq_base").unwrap_or(10_000.0) as f32,
            rms_norm_eps: h.get_f64("llama.attention.layer_norm_rms_epsilon")? as f32,
            max_seq: u("context_length")?,
        };
        validate(&cfg, &f.path)?;
        check_split(&split, &cfg, &f.path)?;
        let src = Source::Gguf(f);
        let (hd, d) = (cfg.head_dim, cfg.hidden_size);
        // A projection (out, in), or the part of it `split` keeps: in the
        // loader's format, else f32 (Q and K rows put back in HF order
        // either way).
        let native = |name: &str, keep: &Keep| {
            let Some(p) = loader.load(f, name, keep.full, keep)? else {
                return Ok(None);
            };
            if [p.out_features(), p.in_features()] != keep.shape() {
                return Err(ModelError::Shape {
                    path: f.path.clone(),
                    name: name.to_string(),
                    expected: keep.shape().to_vec(),
                    found: vec![p.out_features(), p.in_features()],
                });
            }
            Ok(Some(p))
        };
        let kept_f32 = |name: &str, keep: &Keep, w: &[f32]| kept_proj(&f.path, name, keep, w);
        let proj = |name: &str, role: Role, out: usize, inp: usize, heads: Option<usize>| {
            let keep = split.keep(role, &cfg, [out, inp], heads.map(|h| qk_row_source(h, hd)));
            let mut f32_w = None;
            by_segments(&keep, |k| match native(name, k)? {
                Some(p) => Ok(p),
                None => {
                    let w = match f32_w.take() {
                        Some(w) => w,
                        None => src.get(name, &[out, inp])?,
                    };
                    let p = kept_f32(name, k, &w);
                    f32_w = Some(w);
                    p
                }
            })
        };
        let mut blocks = Vec::with_capacity(cfg.n_layer);
        for i in split.layers(cfg.n_layer) {
            let g = |n: &str, shape: &[usize]| src.get(&format!("blk.{i}.{n}.weight"), shape);
            let p = |n: &str, role, out, inp, heads| {
                proj(&format!("blk.{i}.{n}.weight"), role, out, inp, heads)
            };
            let (q, kv, ff) = (cfg.n_head * hd, cfg.n_kv_head * hd, cfg.intermediate_size);
            blocks.push(LlamaBlock {
                attn_norm: g("attn_norm", &[d])?,
                wq: p("attn_q", Role::Q, q, d, Some(cfg.n_head))?,
                wk: p("attn_k", Role::K, kv, d, Some(cfg.n_kv_head))?,
                wv: p("attn_v", Role::V, kv, d, None)?,
                wo: p("attn_output", Role::O, d, q, None)?,
                ffn_norm: g("ffn_norm", &[d])?,
                w_gate: p("ffn_gate", Role::Gate, ff, d, None)?,
                w_up: p("ffn_up", Role::Up, ff, d, None)?,
                w_down: p("ffn_down", Role::Down, d, ff, None)?,
            });
        }
        let tied = !h.tensors.iter().any(|t| t.name == "output.weight");
        // The table on the first stage (and on the last when it is the
        // head); none elsewhere.
        let needs_table = split.is_first_stage() || (tied && split.is_last_stage());
        let mut tok_embd = match needs_table {
            true => src.get("token_embd.weight", &[cfg.vocab_size, d])?,
            false => Vec::new(),
        };
        // A tied head is the embedding table: in the loader's format if it
        // takes it, else the f32 table already read (or its part).
        let lm_head = if !split.is_last_stage() {
            Proj::new(&[], 0, d)?
        } else if !tied {
            proj("output.weight", Role::Head, cfg.vocab_size, d, None)?
        } else {
            let keep = split.keep(Role::Head, &cfg, [cfg.vocab_size, d], None);
            match native("token_embd.weight", &keep)? {
                Some(p) => p,
                None => kept_f32("token_embd.weight", &keep, &tok_embd)?,
            }
        };
        if !split.is_first_stage() {
            tok_embd = Vec::new();
        }
        Ok(Llama {
            tok_embd,
            out_norm: match split.is_last_stage() {
                true => src.get("output_norm.weight", &[d])?,
                false => Vec::new(),
            },
            lm_head,
            tied,
            split,
            blocks,
            threads: rayon_threads(),
            cfg,
        })
    }

    /// Load from a Hugging Face directory (`config.json` + `model.safetensors`).
    pub fn from_hf_dir(dir: &Path) -> Result<Llama, ModelError> {
        Llama::from_hf_dir_split(dir, Split::whole())
    }

    /// [`Llama::from_hf_dir`] keeping only `split`'s part of each projection.
    pub fn from_hf_dir_split(dir: &Path, split: Split) -> Result<Llama, ModelError> {
        let hf = HfDir::open(dir)?;
        let c = &hf.config;
        let n_head = hf.usize("num_attention_heads")?;
        let hidden = hf.usize("hidden_size")?;
        let cfg = LlamaConfig {
            vocab_size: hf.usize("vocab_size")?,
            hidden_size: hidden,
            n_layer: hf.usize("num_hidden_layers")?,
            n_head,
            n_kv_head: hf.usize("num_key_value_heads").unwrap_or(n_head),
            head_dim: hf
                .usize("head_dim")
                .unwrap_or(hidden.checked_div(n_head).unwrap_or(0)),
            intermediate_size: hf.usize("intermediate_size")?,
            // transformers 4 writes `rope_theta`; 5 nests it in `rope_parameters`.
            rope_theta: c["rope_theta"]
                .as_f64()
                .or_else(|| c["rope_parameters"]["rope_theta"].as_f64())
                .unwrap_or(10_000.0) as f32,
            rms_norm_eps: c["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
            max_seq: hf.usize("max_position_embeddings")?,
        };
        validate(&cfg, &hf.config_path)?;
        check_split(&split, &cfg, &hf.config_path)?;
        let src = Source::Hf(&hf);
        let proj = |name: &str, role: Role, out: usize, inp: usize, w: &[f32]| {
            let keep = split.keep(role, &cfg, [out, inp], None);
            by_segments(&keep, |k| kept_proj(&hf.weights.path, name, k, w))
        };
        let (hd, d) = (cfg.head_dim, cfg.hidden_size);
        let mut blocks = Vec::with_capacity(cfg.n_layer);
        for i in split.layers(cfg.n_layer) {
            let name = |n: &str| format!("model.layers.{i}.{n}.weight");
            let g = |n: &str, shape: &[usize]| src.get(&name(n), shape);
            let p = |n: &str, role, out, inp| proj(&name(n), role, out, inp, &g(n, &[out, inp])?);
            let (q, kv, ff) = (cfg.n_head * hd, cfg.n_kv_head * hd, cfg.intermediate_size);
            blocks.push(LlamaBlock {
                attn_norm: g("input_layernorm", &[d])?,
                wq: p("self_attn.q_proj", Role::Q, q, d)?,
                wk: p("self_attn.k_proj", Role::K, kv, d)?,
                wv: p("self_attn.v_proj", Role::V, kv, d)?,
                wo: p("self_attn.o_proj", Role::O, d, q)?,
                ffn_norm: g("post_attention_layernorm", &[d])?,
                w_gate: p("mlp.gate_proj", Role::Gate, ff, d)?,
                w_up: p("mlp.up_proj", Role::Up, ff, d)?,
                w_down: p("mlp.down_proj", Role::Down, d, ff)?,
            });
        }
        let tied = c["tie_word_embeddings"].as_bool().unwrap_or(false) || !hf.has("lm_head.weight");
        let (first, last) = (split.is_first_stage(), split.is_last_stage());
        let mut tok_embd = match first || (tied && last) {
            true => src.get("model.embed_tokens.weight", &[cfg.vocab_size, d])?,
            false => Vec::new(),
        };
        let lm_head = if !last {
            Proj::new(&[], 0, d)?
        } else if tied {
            proj(
                "model.embed_tokens.weight",
                Role::Head,
                cfg.vocab_size,
                d,
                &tok_embd,
            )?
        } else {
            let w = src.get("lm_head.weight", &[cfg.vocab_size, d])?;
            proj("lm_head.weight", Role::Head, cfg.vocab_size, d, &w)?
        };
        if !first {
            tok_embd = Vec::new();
        }
        Ok(Llama {
            lm_head,
            tied,
            split,
            tok_embd,
            out_norm: match last {
                true => src.get("model.norm.weight", &[d])?,
                false => Vec::new(),
            },
            blocks,
            threads: rayon_threads(),
            cfg,
        })
    }

    /// Logits (batch, seq, vocab) for `ids` (batch x seq, row-major), every
    /// position attending causally to the ones before it.
    pub fn forward(&self, ids: &[u32], batch: usize, seq: usize) -> Result<Tensor, ModelError> {
        self.forward_profiled(ids, batch, seq, &mut Profile::default())
    }

    /// [`Llama::forward`], adding the time spent in each kind of step to `prof`.
    pub fn forward_profiled(
        &self,
        ids: &[u32],
        batch: usize,
        seq: usize,
        prof: &mut Profile,
    ) -> Result<Tensor, ModelError> {
        let c = &self.cfg;
        check_ids(ids, batch, seq, c.vocab_size, c.max_seq)?;
        let (d, hd, nh, nkv) = (c.hidden_size, c.head_dim, c.n_head, c.n_kv_head);
        let rows = batch * seq;
        let t = self.threads;
        let lin = |x: &[f32], w: &Proj| w.apply(x, rows, t);

        // 1. Token embeddings: x (batch*seq, hidden).
        let mut x = vec![0.0f32; rows * d];
        for (r, &id) in ids.iter().enumerate() {
            let id = id as usize;
            x[r * d..(r + 1) * d].copy_from_slice(&self.tok_embd[id * d..(id + 1) * d]);
        }
        let (cos, sin) = rope_tables(seq, hd, c.rope_theta);

        for blk in &self.blocks {
            // 2. Attention sub-block: x += Wo . attn(RoPE(Wq h), RoPE(Wk h), Wv h), h = RMSNorm(x).
            let h = rms_norm(&x, d, &blk.attn_norm, c.rms_norm_eps);
            let mut q = lin(&h, &blk.wq)?; // (rows, n_head * head_dim)
            let mut k = lin(&h, &blk.wk)?; // (rows, n_kv_head * head_dim)
            let v = lin(&h, &blk.wv)?; // (rows, n_kv_head * head_dim)
            apply_rope(&mut q, batch, seq, nh, hd, &cos, &sin);
            apply_rope(&mut k, batch, seq, nkv, hd, &cos, &sin);
            let t0 = std::time::Instant::now();
            let att = causal_attention(&q, &k, &v, batch, seq, nh, nkv, hd); // (rows, n_head * head_dim)
            prof.attention += t0.elapsed();
            let o = lin(&att, &blk.wo)?;
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);

            // 3. MLP sub-block (SwiGLU): x += W_down (silu(W_gate h) * W_up h), h = RMSNorm(x).
            let h = rms_norm(&x, d, &blk.ffn_norm, c.rms_norm_eps);
            let mut g = lin(&h, &blk.w_gate)?;
            let u = lin(&h, &blk.w_up)?;
            g.iter_mut().zip(&u).for_each(|(g, u)| *g = silu(*g) * u);
            let down = lin(&g, &blk.w_down)?;
            x.iter_mut().zip(&down).for_each(|(x, o)| *x += o);
        }

        // 4. Final norm and the output head (tied: the embedding matrix).
        let h = rms_norm(&x, d, &self.out_norm, c.rms_norm_eps);
        let logits = lin(&h, &self.lm_head)?;
        Ok(Tensor::new(vec![batch, seq, c.vocab_size], logits).expect("sized from its shape"))
    }
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The f32 projection of `keep`'s part of tensor `name` (`w`, stored
/// (out, in)), or a shape error naming the file and tensor.
/// The projection `keep` names, made by `one` (a part of one segment):
/// as it is, or, for row-parallel weights summed in segments, one part
/// per segment folded in the all-reduce's order ([`Segmented`]).
fn by_segments(
    keep: &Keep,
    mut one: impl FnMut(&Keep) -> Result<Proj, ModelError>,
) -> Result<Proj, ModelError> {
    if keep.segments <= 1 {
        return one(keep);
    }
    let parts = (0..keep.segments)
        .map(|s| one(&keep.segment(s)).map(Proj::into_weights))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Proj::from_weights(Box::new(Segmented::new(parts)?)))
}

fn kept_proj(path: &Path, name: &str, keep: &Keep, w: &[f32]) -> Result<Proj, ModelError> {
    let [out, inp] = keep.full;
    let kept = keep.take(w).ok_or_else(|| ModelError::Shape {
        path: path.to_path_buf(),
        name: name.to_string(),
        expected: vec![out, inp],
        found: vec![w.len() / inp.max(1), inp],
    })?;
    Proj::new(&kept, keep.shape()[0], keep.shape()[1])
}

/// A split the model's sizes do not divide is a config error naming them.
fn check_split(split: &Split, c: &LlamaConfig, path: &Path) -> Result<(), ModelError> {
    split.check(c).map_err(|e| ModelError::Config {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })
}

fn validate(c: &LlamaConfig, path: &Path) -> Result<(), ModelError> {
    let bad = |msg: String| ModelError::Config {
        path: path.to_path_buf(),
        msg,
    };
    if c.n_head == 0 || c.n_kv_head == 0 || c.hidden_size == 0 || c.vocab_size == 0 {
        return Err(bad(format!("zero-sized config: {c:?}")));
    }
    if !c.n_head.is_multiple_of(c.n_kv_head) {
        return Err(bad(format!(
            "{} query heads do not divide into {} KV heads",
            c.n_head, c.n_kv_head
        )));
    }
    if !c.head_dim.is_multiple_of(2) || c.head_dim == 0 {
        return Err(bad(format!(
            "head_dim {} must be even and positive (RoPE rotates pairs)",
            c.head_dim
        )));
    }
    // Sizes a hostile file could make overflow or allocate without bound
    // (the block list, RoPE's (context, head_dim/2) tables) are capped
    // before anything is allocated; the tensors' own shapes are checked as
    // they are read.
    let widths = [
        ("hidden_size", Some(c.hidden_size)),
        ("intermediate_size", Some(c.intermediate_size)),
        ("n_head x head_dim", c.n_head.checked_mul(c.head_dim)),
        ("n_kv_head x head_dim", c.n_kv_head.checked_mul(c.head_dim)),
    ];
    for (what, w) in widths {
        if w.is_none_or(|w| w > limits::MAX_WIDTH) {
            return Err(bad(format!(
                "{what} is {w:?}: expected 1..={}",
                limits::MAX_WIDTH
            )));
        }
    }
    for (what, v, max) in [
        ("block_count", c.n_layer, limits::MAX_LAYERS),
        ("vocab_size", c.vocab_size, limits::MAX_VOCAB),
        ("context_length", c.max_seq, limits::MAX_CONTEXT),
    ] {
        if v > max {
            return Err(bad(format!("{what} is {v}: expected at most {max}")));
        }
    }
    Ok(())
}

/// Caps on a model file's hyper-parameters: a hundred times the largest
/// open models (405B: 126 layers, width 53,248, vocab 256K, context 128K),
/// far below what would overflow a product of two of them.
pub mod limits {
    pub const MAX_LAYERS: usize = 1 << 12;
    pub const MAX_WIDTH: usize = 1 << 22;
    pub const MAX_VOCAB: usize = 1 << 24;
    pub const MAX_CONTEXT: usize = 1 << 24;
}

/// Ids must be in the vocabulary and the sequence within the context.
pub fn check_ids(
    ids: &[u32],
    batch: usize,
    seq: usize,
    vocab: usize,
    ctx: usize,
) -> Result<(), ModelError> {
    if Some(ids.len()) != batch.checked_mul(seq) {
        return Err(ModelError::Input {
            len: ids.len(),
            batch,
            seq,
        });
    }
    if seq > ctx {
        return Err(ModelError::Context { len: seq, ctx });
    }
    if let Some((pos, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
        return Err(ModelError::TokenId { id, pos, vocab });
    }
    Ok(())
}

/// RMSNorm over each row: x / sqrt(mean(x^2) + eps) * w.
pub fn rms_norm(x: &[f32], d: usize, w: &[f32], eps: f32) -> Vec<f32> {
    let mut y = vec![0.0f32; x.len()];
    rms_norm_into(x, d, w, eps, &mut y);
    y
}

/// [`rms_norm`] into a caller-owned buffer of the same length as `x`.
pub fn rms_norm_into(x: &[f32], d: usize, w: &[f32], eps: f32, y: &mut [f32]) {
    if d == 0 {
        return; // no rows to normalise (and `chunks_exact(0)` would panic)
    }
    for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
        let ms = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / d as f64;
        let inv = (1.0 / (ms + f64::from(eps)).sqrt()) as f32;
        for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(w) {
            *y = w * (x * inv);
        }
    }
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// cos/sin tables (seq, head_dim/2): angle = pos / theta^(2i / head_dim),
/// computed in f32 as HF does.
pub fn rope_tables(seq: usize, hd: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    let half = hd / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / hd as f32))
        .collect();
    let mut cos = vec![0.0f32; seq * half];
    let mut sin = vec![0.0f32; seq * half];
    for p in 0..seq {
        for i in 0..half {
            let a = p as f32 * inv[i];
            cos[p * half + i] = a.cos();
            sin[p * half + i] = a.sin();
        }
    }
    (cos, sin)
}

/// Rotate-half RoPE in place on (batch*seq, n_heads*head_dim): for i < half,
/// (x_i, x_{i+half}) -> (x_i cos - x_{i+half} sin, x_{i+half} cos + x_i sin).
pub fn apply_rope(
    x: &mut [f32],
    batch: usize,
    seq: usize,
    n_heads: usize,
    hd: usize,
    cos: &[f32],
    sin: &[f32],
) {
    if hd == 0 {
        return; // nothing to rotate (and `chunks_exact_mut(0)` would panic)
    }
    let half = hd / 2;
    for b in 0..batch {
        for p in 0..seq {
            let row = &mut x[(b * seq + p) * n_heads * hd..(b * seq + p + 1) * n_heads * hd];
            for head in row.chunks_exact_mut(hd) {
                for i in 0..half {
                    let (c, s) = (cos[p * half + i], sin[p * half + i]);
                    let (x1, x2) = (head[i], head[i + half]);
                    head[i] = x1 * c - x2 * s;
                    head[i + half] = x2 * c + x1 * s;
                }
            }
        }
    }
}

/// One query row against keys and values 0..n (key s at `k[s*stride..]`,
/// value s at `v[s*stride..]`): out = sum_s softmax_s(q.k_s * scale) v_s.
/// Shared by the full-sequence pass and the KV-cache decode (Project 05), so
/// both do the same arithmetic in the same order.
///
/// # Panics
/// If `out` is not `q.len()` long, `scores` is shorter than `n`, or `k`/`v`
/// hold fewer than `n` rows: a caller's bug, checked up front so that no
/// length mismatch is silently truncated by a zip.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    stride: usize,
    n: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hd = q.len();
    let last = n.checked_sub(1).map_or(0, |l| l * stride + hd);
    assert!(
        out.len() == hd && scores.len() >= n && k.len() >= last && v.len() >= last,
        "attend: q and out must be head_dim ({hd}, out {}), scores hold n ({n}, have {}), \
         k and v hold n rows of stride {stride} ({last}, have {} and {})",
        out.len(),
        scores.len(),
        k.len(),
        v.len()
    );
    let mut max = f32::NEG_INFINITY;
    for (s, sc) in scores[..n].iter_mut().enumerate() {
        *sc = p02_matmul_bench::variants::dot(q, &k[s * stride..s * stride + hd]) * scale;
        max = max.max(*sc);
    }
    let mut sum = 0.0f32;
    for sc in &mut scores[..n] {
        *sc = (*sc - max).exp();
        sum += *sc;
    }
    out.fill(0.0);
    for (s, &p) in scores[..n].iter().enumerate() {
        let w = p / sum;
        for (o, &vv) in out.iter_mut().zip(&v[s * stride..s * stride + hd]) {
            *o += w * vv;
        }
    }
}

/// softmax(q k^T / sqrt(head_dim) + causal mask) v, per batch and query head;
/// query head h reads KV head h / (n_head / n_kv_head) (grouped-query attention).
#[allow(clippy::too_many_arguments)]
pub fn causal_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    batch: usize,
    seq: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
) -> Vec<f32> {
    // Query heads per KV head; a zero count (never from a validated
    // config) reads as 1 rather than dividing by zero.
    let group = nh.checked_div(nkv).unwrap_or(1).max(1);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0.0f32; batch * seq * nh * hd];
    let mut scores = vec![0.0f32; seq];
    for b in 0..batch {
        for h in 0..nh {
            let kvh = h / group;
            // Key/value s of this sequence and KV head: row (b*seq + s), column block kvh.
            let kv0 = (b * seq * nkv + kvh) * hd;
            for t in 0..seq {
                let qt = &q[((b * seq + t) * nh + h) * hd..][..hd];
                let o = &mut out[((b * seq + t) * nh + h) * hd..][..hd];
                // Query t sees keys 0..=t (the causal mask hides the future).
                attend(
                    qt,
                    &k[kv0..],
                    &v[kv0..],
                    nkv * hd,
                    t + 1,
                    scale,
                    &mut scores,
                    o,
                );
            }
        }
    }
    out
}
