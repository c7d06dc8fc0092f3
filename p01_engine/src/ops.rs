//! The elementwise and row-wise ops, float32 throughout, as pure functions.
//!
//! Each op works on a flat buffer viewed as (rows, width), i.e. over any
//! leading batch/sequence dimensions, writing into a caller-owned output so
//! the engine can run without allocating. `linear` lives in [`crate::linear`].
//! Tensor-level wrappers at the bottom are what tests call against PyTorch.

use common::Tensor;

use crate::error::OpError;
use crate::linear::{linear_ref, relu1, Linear};

/// ReLU in place: max(0, x), NaN preserved.
pub fn relu_inplace(x: &mut [f32]) {
    for v in x {
        *v = relu1(*v);
    }
}

/// Which GELU formula (PyTorch's `approximate` argument).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GeluApprox {
    /// 0.5 x (1 + erf(x / sqrt 2)): `approximate="none"`.
    Erf,
    /// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): `approximate="tanh"`.
    Tanh,
}

/// GELU in place.
pub fn gelu_inplace(x: &mut [f32], approx: GeluApprox) {
    match approx {
        GeluApprox::Erf => {
            for v in x {
                *v = 0.5 * *v * (1.0 + libm::erff(*v * std::f32::consts::FRAC_1_SQRT_2));
            }
        }
        GeluApprox::Tanh => {
            const K: f32 = 0.797_884_6; // sqrt(2 / pi)
            for v in x {
                let u = K * (*v + 0.044_715 * *v * *v * *v);
                *v = 0.5 * *v * (1.0 + u.tanh());
            }
        }
    }
}

/// LayerNorm over the last dimension: (x - mean) / sqrt(var + eps) * w + b,
/// biased variance, as torch.nn.LayerNorm. Statistics accumulate in f64.
pub fn layernorm_rows(x: &[f32], width: usize, w: &[f32], b: &[f32], eps: f32, y: &mut [f32]) {
    if width == 0 {
        return;
    }
    for (xr, yr) in x.chunks_exact(width).zip(y.chunks_exact_mut(width)) {
        let mean = xr.iter().map(|&v| f64::from(v)).sum::<f64>() / width as f64;
        let var = xr
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / width as f64;
        let inv = 1.0 / (var + f64::from(eps)).sqrt();
        for j in 0..width {
            yr[j] = ((f64::from(xr[j]) - mean) * inv) as f32 * w[j] + b[j];
        }
    }
}

/// Softmax over the last dimension, in place. The row max is subtracted
/// first so exp never overflows (exp(89) is already inf in f32); the result
/// is unchanged because softmax(x) = softmax(x - c).
pub fn softmax_rows_inplace(x: &mut [f32], width: usize) {
    if width == 0 {
        return;
    }
    for row in x.chunks_exact_mut(width) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f64;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += f64::from(*v);
        }
        for v in row.iter_mut() {
            *v = (f64::from(*v) / sum) as f32;
        }
    }
}

/// Embedding lookup: each id selects a row of `table` (vocab, dim). Ids come
/// as f32 (the engine's one input type) and must be integers in [0, vocab).
pub fn embedding_rows(
    ids: &[f32],
    table: &[f32],
    dim: usize,
    y: &mut [f32],
) -> Result<(), OpError> {
    let vocab = table.len().checked_div(dim).unwrap_or(0);
    for (i, &id) in ids.iter().enumerate() {
        if !(id >= 0.0 && id.fract() == 0.0 && (id as usize) < vocab) {
            return Err(OpError::EmbeddingId {
                index: i,
                id,
                vocab,
            });
        }
        let row = id as usize;
        y[i * dim..(i + 1) * dim].copy_from_slice(&table[row * dim..(row + 1) * dim]);
    }
    Ok(())
}

/// Residual add: y = a + b, elementwise.
pub fn add_into(a: &[f32], b: &[f32], y: &mut [f32]) {
    for ((y, &a), &b) in y.iter_mut().zip(a).zip(b) {
        *y = a + b;
    }
}

// ---- Tensor-level wrappers (shape-checked; used by tests and examples) ----

fn rows_width(x: &Tensor) -> Result<(usize, usize), OpError> {
    let w = x.last_dim().map_err(OpError::Tensor)?;
    Ok((x.rows().map_err(OpError::Tensor)?, w))
}

fn with_shape(shape: Vec<usize>, data: Vec<f32>) -> Result<Tensor, OpError> {
    Tensor::new(shape, data).map_err(OpError::Tensor)
}

/// y = x W^T + b with W (out, in), through the packed fast path.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor, OpError> {
    let (rows, in_f) = rows_width(x)?;
    let &[out_f, w_in] = w.shape() else {
        return Err(OpError::Shape(format!(
            "linear weight must be (out, in), got {:?}",
            w.shape()
        )));
    };
    if w_in != in_f {
        return Err(OpError::Shape(format!(
            "linear: x width {in_f} but weight is ({out_f}, {w_in})"
        )));
    }
    if let Some(b) = b {
        if b.shape() != [out_f] {
            return Err(OpError::Shape(format!(
                "linear: bias {:?}, expected [{out_f}]",
                b.shape()
            )));
        }
    }
    let lin = Linear::new(w.data(), b.map(Tensor::data), out_f, in_f);
    let mut y = vec![0.0; rows * out_f];
    lin.forward(x.data(), rows, &mut y, crate::linear::Activation::None, 1);
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("rank >= 1 checked") = out_f;
    with_shape(shape, y)
}

/// The naive reference of [`linear`], same checks.
pub fn linear_naive(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor, OpError> {
    let fast = linear(x, w, b)?; // shape checks and output shape
    let rows = x.rows().map_err(OpError::Tensor)?;
    let y = linear_ref(x.data(), rows, w.data(), b.map(Tensor::data), w.shape()[0]);
    with_shape(fast.shape().to_vec(), y)
}

pub fn relu(x: &Tensor) -> Tensor {
    let mut y = x.clone();
    relu_inplace(y.data_mut());
    y
}

pub fn gelu(x: &Tensor, approx: GeluApprox) -> Tensor {
    let mut y = x.clone();
    gelu_inplace(y.data_mut(), approx);
    y
}

pub fn layernorm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f32) -> Result<Tensor, OpError> {
    let (_, width) = rows_width(x)?;
    if w.shape() != [width] || b.shape() != [width] {
        return Err(OpError::Shape(format!(
            "layernorm: width {width} but weight {:?} and bias {:?}",
            w.shape(),
            b.shape()
        )));
    }
    let mut y = vec![0.0; x.numel()];
    layernorm_rows(x.data(), width, w.data(), b.data(), eps, &mut y);
    with_shape(x.shape().to_vec(), y)
}

pub fn softmax(x: &Tensor) -> Result<Tensor, OpError> {
    let (_, width) = rows_width(x)?;
    let mut y = x.clone();
    softmax_rows_inplace(y.data_mut(), width);
    Ok(y)
}

/// ids of any shape -> (ids.shape..., dim).
pub fn embedding(ids: &Tensor, table: &Tensor) -> Result<Tensor, OpError> {
    let &[_, dim] = table.shape() else {
        return Err(OpError::Shape(format!(
            "embedding table must be (vocab, dim), got {:?}",
            table.shape()
        )));
    };
    let mut y = vec![0.0; ids.numel() * dim];
    embedding_rows(ids.data(), table.data(), dim, &mut y)?;
    let mut shape = ids.shape().to_vec();
    shape.push(dim);
    with_shape(shape, y)
}

pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor, OpError> {
    if a.shape() != b.shape() {
        return Err(OpError::Shape(format!(
            "add: {:?} vs {:?}",
            a.shape(),
            b.shape()
        )));
    }
    let mut y = vec![0.0; a.numel()];
    add_into(a.data(), b.data(), &mut y);
    with_shape(a.shape().to_vec(), y)
}
