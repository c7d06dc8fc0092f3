//! The CPU references the kernels are checked against, and the tolerances.
//!
//! - matmul: Project 02's f64-accumulating `gemm_ref` and its per-element
//!   bound `k * eps * sum|a_ik b_kj|` (any summation order stays inside).
//! - softmax: Project 01's `softmax_rows_inplace` (f64 sum).
//! - RMSNorm: the formula of Project 04's `rms_norm` (f64 sum of squares),
//!   repeated here because a crate may not depend on a later project.
//! - vector add: one f32 addition is correctly rounded on both sides, so
//!   the GPU must agree bit for bit.

pub use p01_engine::ops::softmax_rows_inplace;
pub use p02_matmul_bench::reference::{error_bound, gemm_ref};

/// y = w * (x / sqrt(mean(x^2) + eps)) per row, as Project 04 computes it.
pub fn rmsnorm_rows_ref(x: &[f32], width: usize, w: &[f32], eps: f32) -> Vec<f32> {
    let mut y = vec![0.0f32; x.len()];
    if width == 0 {
        return y;
    }
    for (xr, yr) in x.chunks_exact(width).zip(y.chunks_exact_mut(width)) {
        let ms = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / width as f64;
        let inv = (1.0 / (ms + f64::from(eps)).sqrt()) as f32;
        for ((y, &x), &w) in yr.iter_mut().zip(xr).zip(w) {
            *y = w * (x * inv);
        }
    }
    y
}

/// The bound for a row reduction of `width` f32 terms followed by a few
/// correctly-rounded-or-2-ulp operations (expf, rsqrtf, a multiply): the sum
/// in f32 may be off by `(width - 1) * eps` relative (Higham 3.1, terms of
/// one sign), the rest by a few eps. Relative to the reference value.
pub fn row_op_bound(width: usize, reference: f32) -> f64 {
    (width as f64 + 8.0) * f64::from(f32::EPSILON) * f64::from(reference.abs()) + 1e-30
}

/// The first index where `got` leaves `want` by more than `bound(i)`, with
/// both values, or None.
pub fn first_outside(
    got: &[f32],
    want: &[f32],
    bound: impl Fn(usize) -> f64,
) -> Option<(usize, f32, f32, f64)> {
    if got.len() != want.len() {
        return Some((got.len().min(want.len()), f32::NAN, f32::NAN, 0.0));
    }
    got.iter()
        .zip(want)
        .enumerate()
        .find(|(i, (g, w))| {
            let d = f64::from((**g - **w).abs());
            d.is_nan() || d > bound(*i)
        })
        .map(|(i, (g, w))| (i, *g, *w, bound(i)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmsnorm_reference_normalises_to_unit_rms() {
        let x = [3.0f32, 4.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let y = rmsnorm_rows_ref(&x, 4, &[1.0; 4], 0.0);
        // Row 0: mean square 25/4, rms 2.5.
        assert_eq!(&y[..4], &[1.2, 1.6, 0.0, 0.0]);
        assert_eq!(&y[4..], &[1.0; 4]);
    }

    #[test]
    fn first_outside_finds_the_first_offender_and_nan() {
        let want = [1.0f32, 2.0, 3.0];
        assert_eq!(first_outside(&[1.0, 2.0, 3.0], &want, |_| 0.0), None);
        assert_eq!(
            first_outside(&[1.0, 2.5, 3.0], &want, |_| 0.1).map(|t| t.0),
            Some(1)
        );
        assert_eq!(
            first_outside(&[1.0, 2.0, f32::NAN], &want, |_| 1.0).map(|t| t.0),
            Some(2)
        );
        assert!(first_outside(&[1.0], &want, |_| 1.0).is_some());
    }
}
