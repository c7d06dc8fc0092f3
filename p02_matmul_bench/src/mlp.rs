//! Back to Project 01: the MNIST MLP with every layer through this crate's
//! sgemm (weights packed once at load; batch 1 takes the GEMV path over the
//! raw weights), to compare with p01's own kernel and PyTorch.

use std::path::Path;

use anyhow::Result;

/// 784 -> 256 -> 128 -> 10 with ReLU, weights as PyTorch stores them.
#[derive(Debug)]
pub struct Mlp {
    layers: Vec<Layer>,
}

#[derive(Debug)]
struct Layer {
    /// (out, in), as PyTorch stores it: the GEMV path reads it directly.
    weight: Vec<f32>,
    /// W^T packed once for the micro-kernel.
    packed: crate::PackedB,
    /// (out)
    bias: Vec<f32>,
    out: usize,
}

/// Activation buffers, reused across calls.
#[derive(Debug, Default)]
pub struct MlpBuffers {
    h: [Vec<f32>; 3],
}

impl Mlp {
    /// Load fc1..fc3 from p01's `weights.safetensors`.
    pub fn load(weights: &Path) -> Result<Mlp> {
        let f = common::st::load(weights)?;
        let mut layers = Vec::new();
        for i in 1..=3 {
            let w = f.tensor(&format!("fc{i}.weight"))?;
            let b = f.tensor(&format!("fc{i}.bias"))?;
            let &[out, inp] = w.shape() else {
                anyhow::bail!("fc{i}.weight must be (out, in)")
            };
            let packed = crate::PackedB::linear_weight(w.data(), out, inp)?;
            layers.push(Layer {
                weight: w.data().to_vec(),
                packed,
                bias: b.data().to_vec(),
                out,
            });
        }
        Ok(Mlp { layers })
    }

    /// Logits (batch, 10) for x (batch, 784).
    pub fn forward<'b>(
        &self,
        x: &[f32],
        batch: usize,
        bufs: &'b mut MlpBuffers,
        threads: usize,
    ) -> Result<&'b [f32]> {
        for (i, l) in self.layers.iter().enumerate() {
            let (done, rest) = bufs.h.split_at_mut(i);
            let input: &[f32] = if i == 0 { x } else { &done[i - 1] };
            let y = &mut rest[0];
            y.resize(batch * l.out, 0.0);
            if batch == 1 {
                crate::linear(input, 1, &l.weight, l.out, Some(&l.bias), y, threads)?;
            } else {
                let a = crate::MatRef::row_major(input, batch, l.packed.rows())?;
                let mut c = crate::MatMut::row_major(y, batch, l.out)?;
                let opts = crate::GemmOpts {
                    bias: Some(&l.bias),
                    threads,
                    ..Default::default()
                };
                crate::sgemm_prepacked(a, &l.packed, &mut c, opts)?;
            }
            if i + 1 < self.layers.len() {
                p01_engine::ops::relu_inplace(y);
            }
        }
        Ok(&bufs.h[self.layers.len() - 1])
    }
}
