//! Tolerance checks for parity tests: |a - e| <= atol + rtol * |e| elementwise,
//! reporting the worst element so a failure says where and by how much.

use crate::Tensor;

/// The result of comparing two buffers.
#[derive(Clone, Debug, PartialEq)]
pub struct Diff {
    /// Largest |actual - expected|.
    pub max_abs: f32,
    /// Flat index of that element.
    pub worst_index: usize,
    pub actual: f32,
    pub expected: f32,
    /// Elements outside `atol + rtol * |expected|`.
    pub n_bad: usize,
}

/// Compare two equal-length buffers. NaN anywhere counts as a failure.
pub fn diff(actual: &[f32], expected: &[f32], atol: f32, rtol: f32) -> Result<Diff, String> {
    if actual.len() != expected.len() {
        return Err(format!(
            "length mismatch: actual {} vs expected {}",
            actual.len(),
            expected.len()
        ));
    }
    let mut d = Diff {
        max_abs: 0.0,
        worst_index: 0,
        actual: actual.first().copied().unwrap_or(0.0),
        expected: expected.first().copied().unwrap_or(0.0),
        n_bad: 0,
    };
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let err = (a - e).abs();
        // NaN-safe: a NaN error compares as not <= and so fails.
        let bad = err
            .partial_cmp(&(atol + rtol * e.abs()))
            .is_none_or(|o| o.is_gt());
        if bad {
            d.n_bad += 1;
        }
        if err > d.max_abs || err.is_nan() && !d.max_abs.is_nan() {
            d.max_abs = err;
            d.worst_index = i;
            d.actual = a;
            d.expected = e;
        }
    }
    Ok(d)
}

/// Check `actual` against `expected` (shapes must match); on failure the
/// message names `what`, the worst index and both values.
pub fn check_close(
    what: &str,
    actual: &Tensor,
    expected: &Tensor,
    atol: f32,
    rtol: f32,
) -> Result<Diff, String> {
    if actual.shape() != expected.shape() {
        return Err(format!(
            "{what}: shape {:?} vs expected {:?}",
            actual.shape(),
            expected.shape()
        ));
    }
    let d = diff(actual.data(), expected.data(), atol, rtol).map_err(|e| format!("{what}: {e}"))?;
    if d.n_bad > 0 {
        return Err(format!(
            "{what}: {} of {} elements outside atol {atol:e} + rtol {rtol:e}; worst at flat index {} \
             (shape {:?}): got {} expected {} (|diff| {:e})",
            d.n_bad,
            actual.numel(),
            d.worst_index,
            actual.shape(),
            d.actual,
            d.expected,
            d.max_abs
        ));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_worst_and_fails_on_nan() {
        let d = diff(&[1.0, 2.5, 3.0], &[1.0, 2.0, 3.0], 1e-3, 0.0).unwrap();
        assert_eq!((d.worst_index, d.n_bad), (1, 1));
        assert_eq!(d.max_abs, 0.5);
        let d = diff(&[f32::NAN], &[0.0], 1.0, 1.0).unwrap();
        assert_eq!(d.n_bad, 1);
        assert!(diff(&[1.0], &[1.0, 2.0], 0.0, 0.0).is_err());
        let a = Tensor::new(vec![2], vec![1.0, 2.0]).unwrap();
        let b = Tensor::new(vec![1, 2], vec![1.0, 2.0]).unwrap();
        assert!(check_close("x", &a, &b, 1.0, 1.0).is_err());
        assert!(check_close("x", &a, &a.clone(), 0.0, 0.0).is_ok());
    }
}
