//! int8 per output channel for our own f32 models: Project 01's MNIST MLP
//! (784-256-128-10, ReLU) with every linear layer's weights quantised
//! symmetrically per row ([`Format::I8Channel`]), run two ways:
//!
//! - W8A8: activations quantised to 8 bits per 32 values (Q8_0) and
//!   integer dot products, as decode runs SmolLM2;
//! - W8 (weight-only): the int8 weights expanded to f32, f32 activations,
//!   which isolates what the weights alone lose.
//!
//! The reference is Project 01's own f32 engine on the same digits.
//!
//! ```text
//! x (n, 784) ─ pad to 800 ─ W1 (256, 800) ─ +b1 ─ relu ─ W2 (128, 256) ─ +b2 ─ relu ─ W3 (10, 128) ─ +b3
//! ```
//! K must be a multiple of 32 for the block kernels: 784 inputs are padded
//! with zero columns (and zero activations), which adds nothing.

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use p04_transformer::LinearWeights;
use serde::Deserialize;

use crate::dot::Dot;
use crate::formats::QK;
use crate::matrix::{Format, QuantMatrix};
use crate::pool::Pool;

/// How the quantised layers run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// 8-bit activations, integer dot products.
    W8A8,
    /// int8 weights expanded to f32; f32 activations.
    W8,
}

/// One linear layer: W (out, in padded to 32) int8 per channel, bias f32.
#[derive(Debug)]
struct Layer {
    w: QuantMatrix,
    bias: Vec<f32>,
    in_features: usize,
    relu: bool,
}

/// A chain of linear (+ ReLU) layers read from a Project 01 graph.
#[derive(Debug)]
pub struct Int8Mlp {
    layers: Vec<Layer>,
}

#[derive(Deserialize)]
struct GraphFile {
    input: GraphInput,
    nodes: Vec<Node>,
}

#[derive(Deserialize)]
struct GraphInput {
    name: String,
}

#[derive(Deserialize)]
struct Node {
    op: String,
    inputs: Vec<String>,
    #[serde(default)]
    params: std::collections::BTreeMap<String, serde_json::Value>,
    output: String,
}

impl Int8Mlp {
    /// Read `dir/model.json` and `dir/weights.safetensors` (Project 01's
    /// format). Only chains of `linear` and `relu` are accepted.
    pub fn load(dir: &Path, dot: Dot) -> Result<Int8Mlp> {
        let json = dir.join("model.json");
        let g: GraphFile = serde_json::from_str(
            &std::fs::read_to_string(&json)
                .with_context(|| format!("reading {}", json.display()))?,
        )
        .with_context(|| format!("parsing {}", json.display()))?;
        let st = common::st::load(&dir.join("weights.safetensors"))?;
        let mut layers: Vec<Layer> = Vec::new();
        let mut prev = g.input.name.clone();
        for (i, n) in g.nodes.iter().enumerate() {
            ensure!(
                n.inputs == [prev.clone()],
                "{}: node {i} reads {:?}; only a chain (each node reading the one before) is supported",
                json.display(),
                n.inputs
            );
            match n.op.as_str() {
                "linear" => {
                    let param = |k: &str| n.params.get(k).and_then(|v| v.as_str());
                    let name = param("weight").context("linear without weight")?;
                    let w = st.tensor(name)?;
                    let &[out, inp] = w.shape() else {
                        bail!(
                            "{}: {name} has shape {:?}, not (out, in)",
                            json.display(),
                            w.shape()
                        );
                    };
                    ensure!(
                        out > 0 && inp > 0,
                        "{}: {name} has shape ({out}, {inp}); both must be at least 1",
                        json.display()
                    );
                    let bias = match param("bias") {
                        Some(b) => st.tensor(b)?.data().to_vec(),
                        None => vec![0.0; out],
                    };
                    ensure!(
                        bias.len() == out,
                        "{}: bias of {name} has {} values, {out} needed",
                        json.display(),
                        bias.len()
                    );
                    let padded = inp.div_ceil(QK) * QK;
                    let mut wp = vec![0.0f32; out * padded];
                    for (dst, src) in wp.chunks_exact_mut(padded).zip(w.data().chunks_exact(inp)) {
                        dst[..inp].copy_from_slice(src);
                    }
                    let m = QuantMatrix::quantize(&wp, out, padded, Format::I8Channel, dot)?;
                    layers.push(Layer {
                        w: m,
                        bias,
                        in_features: inp,
                        relu: false,
                    });
                }
                "relu" => match layers.last_mut() {
                    Some(l) if !l.relu => l.relu = true,
                    _ => bail!("{}: node {i}: relu must follow a linear", json.display()),
                },
                other => bail!(
                    "{}: node {i} is '{other}'; int8 evaluation supports linear and relu chains",
                    json.display()
                ),
            }
            prev = n.output.clone();
        }
        ensure!(!layers.is_empty(), "{}: no linear layers", json.display());
        for pair in layers.windows(2) {
            ensure!(
                pair[0].w.out_features() == pair[1].in_features,
                "{}: a layer of {} outputs feeds one of {} inputs",
                json.display(),
                pair[0].w.out_features(),
                pair[1].in_features
            );
        }
        Ok(Int8Mlp { layers })
    }

    pub fn in_features(&self) -> usize {
        self.layers[0].in_features
    }

    pub fn out_features(&self) -> usize {
        self.layers.last().map_or(0, |l| l.w.out_features())
    }

    /// Bytes of the quantised weights (int8 blocks and scales) and biases.
    pub fn weight_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| l.w.weight_bytes() + l.bias.len() * 4)
            .sum()
    }

    /// Logits (n, out) for images x (n, in).
    pub fn forward(
        &self,
        x: &[f32],
        n: usize,
        mode: Mode,
        pool: &Pool,
        threads: usize,
    ) -> Result<Vec<f32>> {
        ensure!(
            Some(x.len()) == n.checked_mul(self.in_features()),
            "input of {} values is not {n} rows of {}",
            x.len(),
            self.in_features()
        );
        let mut h = x.to_vec();
        for l in &self.layers {
            // (n, in) → (n, in padded to 32)
            let k = l.w.in_features();
            if k != l.in_features {
                let mut p = vec![0.0f32; n * k];
                for (dst, src) in p.chunks_exact_mut(k).zip(h.chunks_exact(l.in_features)) {
                    dst[..l.in_features].copy_from_slice(src);
                }
                h = p;
            }
            let out = l.w.out_features();
            let mut y = vec![0.0f32; n * out];
            match mode {
                Mode::W8A8 => l.w.matmul_int(&h, n, &mut y, pool, threads)?,
                Mode::W8 => l.w.matmul_f32(&h, n, &mut y, threads)?,
            }
            for row in y.chunks_exact_mut(out) {
                for (v, b) in row.iter_mut().zip(&l.bias) {
                    *v += b;
                    if l.relu {
                        *v = v.max(0.0);
                    }
                }
            }
            h = y;
        }
        Ok(h)
    }
}

/// The f32 engine's and both int8 modes' scores on a labelled set.
#[derive(Clone, Debug)]
pub struct Int8Report {
    pub n: usize,
    /// Correct predictions: f32, W8, W8A8.
    pub correct: [usize; 3],
    /// Argmax equal to f32's: W8, W8A8.
    pub agree: [usize; 2],
    /// max |logit − f32 logit|: W8, W8A8.
    pub max_diff: [f32; 2],
    /// Weight bytes: f32, int8 (with scales and biases).
    pub bytes: [usize; 2],
}

/// Project 01's MLP in `dir`, f32 (Project 01's engine) vs int8 per
/// channel, on `data` (safetensors with `images` (n, in) and `labels` (n)).
pub fn evaluate(dir: &Path, data: &Path, dot: Dot, threads: usize) -> Result<Int8Report> {
    let engine = p01_engine::engine::Graph::load(dir)?;
    let q = Int8Mlp::load(dir, dot)?;
    let mut f = common::st::load(data)?;
    let images = f.take("images")?;
    let labels = f.ints("labels")?.1.clone();
    let n = labels.len();
    let f32_logits = engine.forward(&images)?;
    let pool = Pool::global();
    let w8 = q.forward(images.data(), n, Mode::W8, pool, threads)?;
    let w8a8 = q.forward(images.data(), n, Mode::W8A8, pool, threads)?;
    let out = q.out_features();
    let argmax = |l: &[f32]| -> Vec<usize> {
        l.chunks_exact(out)
            .map(|r| common::argmax(r) as usize)
            .collect()
    };
    let (pf, p8, p88) = (argmax(f32_logits.data()), argmax(&w8), argmax(&w8a8));
    let correct = |p: &[usize]| {
        p.iter()
            .zip(&labels)
            .filter(|(p, l)| **p as i64 == **l)
            .count()
    };
    let agree = |p: &[usize]| p.iter().zip(&pf).filter(|(a, b)| a == b).count();
    let max_diff = |l: &[f32]| {
        l.iter()
            .zip(f32_logits.data())
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
    };
    Ok(Int8Report {
        n,
        correct: [correct(&pf), correct(&p8), correct(&p88)],
        agree: [agree(&p8), agree(&p88)],
        max_diff: [max_diff(&w8), max_diff(&w8a8)],
        bytes: [engine.stats().weight_bytes, q.weight_bytes()],
    })
}
