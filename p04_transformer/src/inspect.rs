//! `inspect`: what a GGUF file holds, derived from its header.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::gguf::{GgufError, GgufHeader, Value};

/// A human-readable summary: architecture, hyper-parameters, parameter count,
/// bytes by dtype, FLOPs per token.
pub fn summary(h: &GgufHeader) -> Result<String, GgufError> {
    let mut s = String::new();
    let arch = h.get_str("general.architecture")?;
    let _ = writeln!(
        s,
        "file: {} (GGUF v{}, alignment {})",
        h.path.display(),
        h.version,
        h.alignment
    );
    let _ = writeln!(s, "architecture: {arch}");
    if let Ok(name) = h.get_str("general.name") {
        let _ = writeln!(s, "name: {name}");
    }
    for key in [
        "block_count",
        "context_length",
        "embedding_length",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "rope.freq_base",
        "attention.layer_norm_rms_epsilon",
        "vocab_size",
    ] {
        if let Some(v) = h.metadata.get(&format!("{arch}.{key}")) {
            let shown = match v {
                Value::F32(x) => format!("{x}"),
                other => other
                    .as_u64()
                    .map_or_else(|| other.describe(), |u| u.to_string()),
            };
            let _ = writeln!(s, "  {key}: {shown}");
        }
    }
    let mut by_type: BTreeMap<String, (usize, usize, usize)> = BTreeMap::new();
    let mut params = 0usize;
    let mut matmul_params = 0usize;
    for t in &h.tensors {
        let e = by_type.entry(format!("{:?}", t.ty)).or_default();
        e.0 += 1;
        e.1 += t.numel();
        e.2 += t.n_bytes;
        params += t.numel();
        if t.dims.len() == 2 && t.name != "token_embd.weight" {
            matmul_params += t.numel();
        }
    }
    // Tied embeddings: the output projection reuses token_embd.
    let tied = !h.tensors.iter().any(|t| t.name == "output.weight");
    if tied {
        matmul_params += h
            .tensor("token_embd.weight")
            .map(|t| t.numel())
            .unwrap_or(0);
    }
    let _ = writeln!(
        s,
        "tensors: {} ({} parameters{})",
        h.tensors.len(),
        params,
        if tied {
            ", output tied to token_embd"
        } else {
            ""
        }
    );
    for (ty, (n, numel, bytes)) in &by_type {
        let _ = writeln!(
            s,
            "  {ty:<5} {n:>4} tensors {numel:>12} weights {bytes:>12} bytes ({:.2} bits/weight)",
            8.0 * *bytes as f64 / *numel as f64
        );
    }
    let n_layer = h.get_u64(&format!("{arch}.block_count")).unwrap_or(0) as usize;
    let d_model = h.get_u64(&format!("{arch}.embedding_length")).unwrap_or(0) as usize;
    let _ = writeln!(s, "FLOPs per token (2 per multiply-add): weights {}; attention adds 4 x layers x width x position = {} at position 1024", 2u128 * matmul_params as u128, 4u128 * n_layer as u128 * d_model as u128 * 1024);
    Ok(s)
}
