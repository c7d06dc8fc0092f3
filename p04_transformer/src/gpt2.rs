//! GPT-2 forward pass: learned position embeddings, pre-LayerNorm blocks,
//! fused QKV projection, GELU (tanh form), tied output head. Loads the
//! published `gpt2` layout (no prefix) and `save_pretrained`'s
//! (`transformer.` prefix); Conv1D weights are stored (in, out).

use std::path::Path;

use common::Tensor;

use crate::error::ModelError;
use crate::llama::{causal_attention, check_ids};
use crate::proj::Proj;
use crate::weights::{HfDir, Source};

#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2Config {
    pub vocab_size: usize,
    pub n_positions: usize,
    /// d_model
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub layer_norm_eps: f32,
}

/// A Conv1D layer: y = x W + b. The checkpoint stores W as (in, out); it is
/// held as a [`Proj`] of Wᵀ (out, in), so any weight format (f32 packed
/// panels by default, Project 10's int8 per channel) can stand behind it.
#[derive(Debug)]
pub struct Conv1D {
    pub w: Proj,
    /// (out)
    pub b: Vec<f32>,
}

impl Conv1D {
    /// y (rows, out) = x (rows, in) W + b.
    pub fn forward(&self, x: &[f32], rows: usize, threads: usize) -> Result<Vec<f32>, ModelError> {
        let mut y = self.w.apply(x, rows, threads)?;
        let n = self.w.out_features();
        for row in y.chunks_exact_mut(n) {
            row.iter_mut().zip(&self.b).for_each(|(y, b)| *y += b);
        }
        Ok(y)
    }

    pub fn n_in(&self) -> usize {
        self.w.in_features()
    }

    pub fn n_out(&self) -> usize {
        self.w.out_features()
    }
}

/// Builds each projection from its f32 weights: `(name, W (out, in), out,
/// in)` → a [`Proj`] in the format the caller wants.
pub type MakeProj<'a> = dyn Fn(&str, &[f32], usize, usize) -> Result<Proj, ModelError> + 'a;

/// W (in, out) as stored by Conv1D → Wᵀ (out, in).
pub fn transpose_in_out(w: &[f32], n_in: usize, n_out: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; w.len()];
    for i in 0..n_in {
        for o in 0..n_out {
            t[o * n_in + i] = w[i * n_out + o];
        }
    }
    t
}

#[derive(Debug)]
pub struct Gpt2Block {
    /// ln_1 weight, bias: (n_embd)
    pub ln_1: (Vec<f32>, Vec<f32>),
    /// (n_embd, 3 n_embd): q, k, v side by side
    pub c_attn: Conv1D,
    /// (n_embd, n_embd)
    pub attn_proj: Conv1D,
    pub ln_2: (Vec<f32>, Vec<f32>),
    /// (n_embd, 4 n_embd)
    pub c_fc: Conv1D,
    /// (4 n_embd, n_embd)
    pub mlp_proj: Conv1D,
}

#[derive(Debug)]
pub struct Gpt2 {
    pub cfg: Gpt2Config,
    /// (vocab, n_embd), also the output head
    pub wte: Vec<f32>,
    /// (n_positions, n_embd)
    pub wpe: Vec<f32>,
    pub blocks: Vec<Gpt2Block>,
    pub ln_f: (Vec<f32>, Vec<f32>),
    pub threads: usize,
}

impl Gpt2 {
    /// Every projection as f32 packed panels.
    pub fn from_hf_dir(dir: &Path) -> Result<Gpt2, ModelError> {
        Self::from_hf_dir_with(dir, &|_, w, out, inp| Proj::new(w, out, inp))
    }

    /// Every projection (c_attn, c_proj, c_fc, mlp c_proj of each block)
    /// built by `make` from its f32 weights: the weight-format seam.
    pub fn from_hf_dir_with(dir: &Path, make: &MakeProj<'_>) -> Result<Gpt2, ModelError> {
        let hf = HfDir::open(dir)?;
        let cfg = Gpt2Config {
            vocab_size: hf.usize("vocab_size")?,
            n_positions: hf.usize("n_positions")?,
            n_embd: hf.usize("n_embd")?,
            n_layer: hf.usize("n_layer")?,
            n_head: hf.usize("n_head")?,
            layer_norm_eps: hf.config["layer_norm_epsilon"].as_f64().unwrap_or(1e-5) as f32,
        };
        if cfg.n_head == 0 || cfg.n_embd == 0 || !cfg.n_embd.is_multiple_of(cfg.n_head) {
            return Err(ModelError::Config {
                path: hf.config_path.clone(),
                msg: format!(
                    "n_embd {} is not a positive multiple of n_head {}",
                    cfg.n_embd, cfg.n_head
                ),
            });
        }
        use crate::llama::limits;
        for (what, v, lo, hi) in [
            // 4 x n_embd (the MLP width) must stay under the width cap.
            ("n_embd", cfg.n_embd, 1, limits::MAX_WIDTH / 4),
            ("n_layer", cfg.n_layer, 0, limits::MAX_LAYERS),
            ("vocab_size", cfg.vocab_size, 1, limits::MAX_VOCAB),
            ("n_positions", cfg.n_positions, 1, limits::MAX_CONTEXT),
        ] {
            if !(lo..=hi).contains(&v) {
                return Err(ModelError::Config {
                    path: hf.config_path.clone(),
                    msg: format!("{what} is {v}: expected {lo}..={hi}"),
                });
            }
        }
        if let Some(act) = hf.config["activation_function"].as_str() {
            if act != "gelu_new" && act != "gelu_pytorch_tanh" {
                return Err(ModelError::Config {
                    path: hf.config_path.clone(),
                    msg: format!("activation_function `{act}` is not supported (gelu_new)"),
                });
            }
        }
        // The published checkpoint has bare names; save_pretrained adds `transformer.`.
        let prefix = if hf.has("transformer.wte.weight") {
            "transformer."
        } else {
            ""
        };
        let src = Source::Hf(&hf);
        let g = |n: &str, shape: &[usize]| src.get(&format!("{prefix}{n}"), shape);
        let d = cfg.n_embd;
        let conv = |n: &str, n_in: usize, n_out: usize| -> Result<Conv1D, ModelError> {
            let w = g(&format!("{n}.weight"), &[n_in, n_out])?;
            Ok(Conv1D {
                w: make(n, &transpose_in_out(&w, n_in, n_out), n_out, n_in)?,
                b: g(&format!("{n}.bias"), &[n_out])?,
            })
        };
        let ln = |n: &str| -> Result<(Vec<f32>, Vec<f32>), ModelError> {
            Ok((
                g(&format!("{n}.weight"), &[d])?,
                g(&format!("{n}.bias"), &[d])?,
            ))
        };
        let mut blocks = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            blocks.push(Gpt2Block {
                ln_1: ln(&format!("h.{i}.ln_1"))?,
                c_attn: conv(&format!("h.{i}.attn.c_attn"), d, 3 * d)?,
                attn_proj: conv(&format!("h.{i}.attn.c_proj"), d, d)?,
                ln_2: ln(&format!("h.{i}.ln_2"))?,
                c_fc: conv(&format!("h.{i}.mlp.c_fc"), d, 4 * d)?,
                mlp_proj: conv(&format!("h.{i}.mlp.c_proj"), 4 * d, d)?,
            });
        }
        Ok(Gpt2 {
            wte: g("wte.weight", &[cfg.vocab_size, d])?,
            wpe: g("wpe.weight", &[cfg.n_positions, d])?,
            ln_f: ln("ln_f")?,
            blocks,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cfg,
        })
    }

    /// Logits (batch, seq, vocab) for `ids` (batch x seq), causal.
    pub fn forward(&self, ids: &[u32], batch: usize, seq: usize) -> Result<Tensor, ModelError> {
        let c = &self.cfg;
        check_ids(ids, batch, seq, c.vocab_size, c.n_positions)?;
        let (d, nh) = (c.n_embd, c.n_head);
        let hd = d / nh;
        let rows = batch * seq;
        let t = self.threads;
        let layer_norm = |x: &[f32], (w, b): &(Vec<f32>, Vec<f32>)| {
            let mut y = vec![0.0f32; x.len()];
            p01_engine::ops::layernorm_rows(x, d, w, b, c.layer_norm_eps, &mut y);
            y
        };

        // 1. Token + learned position embeddings: x (batch*seq, n_embd).
        let mut x = vec![0.0f32; rows * d];
        for (r, &id) in ids.iter().enumerate() {
            let (id, pos) = (id as usize, r % seq);
            for (j, xv) in x[r * d..(r + 1) * d].iter_mut().enumerate() {
                *xv = self.wte[id * d + j] + self.wpe[pos * d + j];
            }
        }
        for blk in &self.blocks {
            // 2. Attention: one fused projection gives q | k | v per row.
            let h = layer_norm(&x, &blk.ln_1);
            let qkv = blk.c_attn.forward(&h, rows, t)?; // (rows, 3 n_embd)
            let split = |part: usize| -> Vec<f32> {
                qkv.chunks_exact(3 * d)
                    .flat_map(|r| r[part * d..(part + 1) * d].iter().copied())
                    .collect()
            };
            let (q, k, v) = (split(0), split(1), split(2)); // each (rows, n_head * head_dim)
            let att = causal_attention(&q, &k, &v, batch, seq, nh, nh, hd);
            let o = blk.attn_proj.forward(&att, rows, t)?;
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            // 3. MLP: x += W_proj gelu_tanh(W_fc LN(x)).
            let h = layer_norm(&x, &blk.ln_2);
            let mut m = blk.c_fc.forward(&h, rows, t)?;
            p01_engine::ops::gelu_inplace(&mut m, p01_engine::ops::GeluApprox::Tanh);
            let o = blk.mlp_proj.forward(&m, rows, t)?;
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
        }
        // 4. Final LayerNorm; the head is the token embedding matrix (tied).
        let h = layer_norm(&x, &self.ln_f);
        let mut logits = vec![0.0f32; rows * c.vocab_size];
        p02_matmul_bench::linear(&h, rows, &self.wte, c.vocab_size, None, &mut logits, t)?;
        Ok(Tensor::new(vec![batch, seq, c.vocab_size], logits).expect("sized from its shape"))
    }
}
