//! The reference every variant is tested against: C = alpha*A*B + beta*C (+ bias)
//! with f64 accumulation, plus the per-element error bound the tests use.

use crate::mat::{MatMut, MatRef};

/// f64-accumulating reference. Returns, per element of C, sum_k |a_ik * b_kj|
/// (the scale the rounding error of an f32 dot product is proportional to).
pub fn gemm_ref(
    alpha: f32,
    a: MatRef,
    b: MatRef,
    beta: f32,
    c: &mut MatMut,
    bias: Option<&[f32]>,
) -> Vec<f64> {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    assert_eq!(b.rows, k, "inner dimensions");
    assert_eq!((c.rows, c.cols), (m, n), "output shape");
    let mut scale = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f64;
            let mut abs = 0.0f64;
            for p in 0..k {
                let t = f64::from(a.at(i, p)) * f64::from(b.at(p, j));
                acc += t;
                abs += t.abs();
            }
            let cij = &mut c.data[i * c.ld + j];
            let old = if beta == 0.0 {
                0.0
            } else {
                f64::from(beta) * f64::from(*cij)
            };
            let bias_j = bias.map_or(0.0, |b| f64::from(b[j]));
            *cij = (f64::from(alpha) * acc + old + bias_j) as f32;
            scale[i * n + j] = f64::from(alpha.abs()) * abs + old.abs() + bias_j.abs();
        }
    }
    scale
}

/// Worst-case bound for a float32 result summed in any order: the classic
/// |error| <= k * eps * sum |a_i b_i| (Higham, Accuracy and Stability, 3.1),
/// with a factor 2 for the alpha/beta/bias roundings, plus one ulp-scale floor.
pub fn error_bound(k: usize, scale: f64) -> f64 {
    2.0 * (k as f64 + 2.0) * f64::from(f32::EPSILON) * scale + 1e-30
}
