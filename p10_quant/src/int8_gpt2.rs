//! int8 per output channel for GPT-2 layout models: every Conv1D projection
//! of Project 04's `Gpt2` (c_attn, attention c_proj, c_fc, MLP c_proj of
//! each block) quantised symmetrically per output row
//! ([`Format::I8Channel`]) through p04's weight-format seam
//! (`Gpt2::from_hf_dir_with`). The embeddings, the LayerNorms, the biases
//! and the tied head stay f32.
//!
//! The reference is the same model with f32 projections on the same ids:
//! argmax agreement per position, the largest logit difference, and the
//! mean KL divergence of the next-token distributions.

use std::path::Path;

use anyhow::{ensure, Context, Result};
use p04_transformer::{Gpt2, ModelError, Proj};

use crate::dot::Dot;
use crate::formats::QK;
use crate::matrix::{Format, QuantMatrix};
use crate::perplexity::{kl, log_softmax};

/// `dir` (a Hugging Face GPT-2 directory) with int8-per-channel projections.
pub fn load_int8(dir: &Path, dot: Dot) -> Result<Gpt2, ModelError> {
    Gpt2::from_hf_dir_with(dir, &|name, w, out, inp| {
        check_width(dir, name, out, inp)?;
        let m = QuantMatrix::quantize(w, out, inp, Format::I8Channel, dot).map_err(|e| {
            ModelError::Weights {
                name: format!("{}: {name}", dir.display()),
                source: Box::new(e),
            }
        })?;
        Ok(Proj::from_weights(Box::new(m)))
    })
}

/// The block kernels walk K in 32-value blocks: W (out, in) needs `in` a
/// positive multiple of 32 (GPT-2's widths, 768, 1024, ..., and the
/// fixtures' are).
pub fn check_width(dir: &Path, name: &str, out: usize, inp: usize) -> Result<(), ModelError> {
    if inp == 0 || !inp.is_multiple_of(QK) {
        return Err(ModelError::Shape {
            path: dir.to_path_buf(),
            name: name.to_string(),
            expected: vec![out, inp.div_ceil(QK).max(1) * QK],
            found: vec![out, inp],
        });
    }
    Ok(())
}

/// How far the int8 model is from the f32 one.
#[derive(Clone, Debug)]
pub struct Gpt2Int8Report {
    pub positions: usize,
    /// Positions where both pick the same next token.
    pub argmax_agree: usize,
    pub max_abs_logit_diff: f32,
    /// Mean over positions of KL(f32 ‖ int8), in nats.
    pub mean_kl: f64,
    /// Bytes of projection weights: f32, int8 per channel.
    pub weight_bytes: [usize; 2],
}

/// Compare the int8 and f32 models on `ids` (batch x seq).
pub fn compare(
    dir: &Path,
    ids: &[u32],
    batch: usize,
    seq: usize,
    dot: Dot,
) -> Result<Gpt2Int8Report> {
    let f = Gpt2::from_hf_dir(dir).with_context(|| format!("loading {}", dir.display()))?;
    let q = load_int8(dir, dot).with_context(|| format!("quantising {}", dir.display()))?;
    let lf = f.forward(ids, batch, seq)?;
    let lq = q.forward(ids, batch, seq)?;
    let vocab = f.cfg.vocab_size;
    ensure!(
        lf.data().len() == batch * seq * vocab,
        "logits of the wrong size"
    );
    let (mut agree, mut max_diff, mut kl_sum) = (0usize, 0.0f32, 0.0f64);
    let (mut log_f, mut log_q) = (Vec::new(), Vec::new());
    for (a, b) in lf
        .data()
        .chunks_exact(vocab)
        .zip(lq.data().chunks_exact(vocab))
    {
        agree += usize::from(common::argmax(a) == common::argmax(b));
        for (x, y) in a.iter().zip(b) {
            max_diff = max_diff.max((x - y).abs());
        }
        log_softmax(a, &mut log_f);
        log_softmax(b, &mut log_q);
        kl_sum += kl(&log_f, &log_q);
    }
    let positions = batch * seq;
    let bytes = |m: &Gpt2| -> usize {
        m.blocks
            .iter()
            .flat_map(|b| [&b.c_attn, &b.attn_proj, &b.c_fc, &b.mlp_proj])
            .map(|c| c.w.weights().weight_bytes())
            .sum()
    };
    Ok(Gpt2Int8Report {
        positions,
        argmax_agree: agree,
        max_abs_logit_diff: max_diff,
        mean_kl: kl_sum / positions.max(1) as f64,
        weight_bytes: [bytes(&f), bytes(&q)],
    })
}
