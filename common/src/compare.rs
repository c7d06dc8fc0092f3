//! Tolerance checks for parity tests: |a - e| <= atol + rtol * |e| elementwise,
//! reporting the worst element so a failure says where and by how much.

use thiserror::Error;

use crate::Tensor;

/// A comparison that failed, with what a reader needs to find the cause.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum CompareError {
    #[error("{what}length mismatch: actual {actual} vs expected {expected}")]
    Length {
        what: String,
        actual: usize,
        expected: usize,
    },
    #[error("{what}: shape {actual:?} vs expected {expected:?}")]
    Shape {
        what: String,
        actual: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error(
        "{what}: {} of {n} elements outside atol {atol:e} + rtol {rtol:e}; worst at flat index {} \
         (shape {shape:?}): got {} expected {} (|diff| {:e})",
        diff.n_bad, diff.worst_index, diff.actual, diff.expected, diff.max_abs
    )]
    Tolerance {
        what: String,
        n: usize,
        atol: f32,
        rtol: f32,
        shape: Vec<usize>,
        diff: Diff,
    },
}

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
pub fn diff(actual: &[f32], expected: &[f32], atol: f32, rtol: f32) -> Result<Diff, CompareError> {
    if actual.len() != expected.len() {
        return Err(CompareError::Length {
            what: String::new(),
            actual: actual.len(),
            expected: expected.len(),
        });
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
) -> Result<Diff, CompareError> {
    if actual.shape() != expected.shape() {
        return Err(CompareError::Shape {
            what: what.to_string(),
            actual: actual.shape().to_vec(),
            expected: expected.shape().to_vec(),
        });
    }
    let d = diff(actual.data(), expected.data(), atol, rtol)?;
    if d.n_bad > 0 {
        return Err(CompareError::Tolerance {
            what: what.to_string(),
            n: actual.numel(),
            atol,
            rtol,
            shape: actual.shape().to_vec(),
            diff: d,
        });
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
        assert!(matches!(
            diff(&[1.0], &[1.0, 2.0], 0.0, 0.0),
            Err(CompareError::Length {
                actual: 1,
                expected: 2,
                ..
            })
        ));
        let a = Tensor::new(vec![2], vec![1.0, 2.0]).unwrap();
        let b = Tensor::new(vec![1, 2], vec![1.0, 2.0]).unwrap();
        assert!(matches!(
            check_close("x", &a, &b, 1.0, 1.0),
            Err(CompareError::Shape { .. })
        ));
        let c = Tensor::new(vec![2], vec![1.0, 2.5]).unwrap();
        let e = check_close("logits", &c, &a, 0.1, 0.0).unwrap_err();
        assert!(matches!(&e, CompareError::Tolerance { diff, .. } if diff.worst_index == 1));
        assert!(e.to_string().contains("logits: 1 of 2 elements"), "{e}");
        assert!(check_close("x", &a, &a.clone(), 0.0, 0.0).is_ok());
    }
}
