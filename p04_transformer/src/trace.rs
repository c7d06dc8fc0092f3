//! `trace`: the shape of every stage with named axes, and causality shown
//! with real forwards.

use std::fmt::Write as _;

use crate::error::ModelError;
use crate::model::Transformer;

/// Stage-by-stage shapes for a sequence of `seq` tokens (batch 1).
pub fn shapes(model: &Transformer, seq: usize) -> String {
    let mut s = String::new();
    match model {
        Transformer::Llama(m) => {
            let c = &m.cfg;
            let _ = writeln!(s, "ids                 (batch=1, seq={seq})");
            let _ = writeln!(
                s,
                "token embedding     (batch=1, seq={seq}, width={})",
                c.hidden_size
            );
            let _ = writeln!(s, "x {} blocks, each:", c.n_layer);
            let _ = writeln!(
                s,
                "  rms_norm          (batch=1, seq={seq}, width={})",
                c.hidden_size
            );
            let _ = writeln!(s, "  q = h Wq^T        (batch=1, seq={seq}, n_head={}, head_dim={})  + RoPE on (pos, head_dim/2 pairs)", c.n_head, c.head_dim);
            let _ = writeln!(s, "  k, v              (batch=1, seq={seq}, n_kv_head={}, head_dim={})  each KV head serves {} query heads", c.n_kv_head, c.head_dim, c.n_head.checked_div(c.n_kv_head).unwrap_or(0));
            let _ = writeln!(s, "  scores = q k^T    (batch=1, n_head={}, seq_q={seq}, seq_k={seq})  / sqrt({}), key j > query i masked to -inf", c.n_head, c.head_dim);
            let _ = writeln!(
                s,
                "  softmax(scores) v (batch=1, seq={seq}, n_head*head_dim={})  -> Wo -> + x",
                c.n_head * c.head_dim
            );
            let _ = writeln!(s, "  rms_norm, SwiGLU  (batch=1, seq={seq}, intermediate={}) -> W_down (width={}) -> + x", c.intermediate_size, c.hidden_size);
            let _ = writeln!(
                s,
                "final rms_norm      (batch=1, seq={seq}, width={})",
                c.hidden_size
            );
            let _ = writeln!(
                s,
                "logits              (batch=1, seq={seq}, vocab={}){}",
                c.vocab_size,
                if m.tied {
                    "  head tied to the embedding"
                } else {
                    ""
                }
            );
        }
        Transformer::Gpt2(m) => {
            let c = &m.cfg;
            let hd = c.n_embd.checked_div(c.n_head).unwrap_or(0);
            let _ = writeln!(s, "ids                 (batch=1, seq={seq})");
            let _ = writeln!(
                s,
                "wte[ids] + wpe[pos] (batch=1, seq={seq}, width={})",
                c.n_embd
            );
            let _ = writeln!(s, "x {} blocks, each:", c.n_layer);
            let _ = writeln!(s, "  layer_norm, qkv   (batch=1, seq={seq}, 3*width={}) -> q, k, v (batch=1, seq={seq}, n_head={}, head_dim={hd})", 3 * c.n_embd, c.n_head);
            let _ = writeln!(
                s,
                "  scores            (batch=1, n_head={}, seq_q={seq}, seq_k={seq}), causal",
                c.n_head
            );
            let _ = writeln!(
                s,
                "  mlp               (batch=1, seq={seq}, 4*width={}) gelu(tanh)",
                4 * c.n_embd
            );
            let _ = writeln!(
                s,
                "logits              (batch=1, seq={seq}, vocab={})  head tied to wte",
                c.vocab_size
            );
        }
    }
    s
}

/// Causality, measured: (max |change| of earlier positions' logits when the
/// last token changes, |change| of the last position when the first changes).
pub fn causality(model: &Transformer, ids: &[u32]) -> Result<(f32, f32), ModelError> {
    let t = ids.len();
    if t == 0 {
        return Err(ModelError::EmptyInput { what: "causality" });
    }
    let v = model.vocab_size();
    // Checks every id against the vocabulary, so `id + 1` below cannot overflow.
    let base = model.forward(ids, 1, t)?;
    let mut last_changed = ids.to_vec();
    last_changed[t - 1] = (ids[t - 1] + 1) % v as u32;
    let a = model.forward(&last_changed, 1, t)?;
    let earlier = base.data()[..(t - 1) * v]
        .iter()
        .zip(&a.data()[..(t - 1) * v])
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    let mut first_changed = ids.to_vec();
    first_changed[0] = (ids[0] + 1) % v as u32;
    let b = model.forward(&first_changed, 1, t)?;
    let last = base.data()[(t - 1) * v..]
        .iter()
        .zip(&b.data()[(t - 1) * v..])
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    Ok((earlier, last))
}
