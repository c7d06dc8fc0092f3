//! A minimal f32 tensor: a shape and a row-major buffer whose length always
//! equals the product of the shape.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum TensorError {
    #[error("shape {shape:?} holds {expected} elements but the buffer has {found}")]
    LengthMismatch {
        shape: Vec<usize>,
        expected: usize,
        found: usize,
    },
    #[error("shape {shape:?} overflows usize when its dimensions are multiplied")]
    Overflow { shape: Vec<usize> },
    #[error("cannot reshape {from:?} into {to:?}: element counts differ")]
    Reshape { from: Vec<usize>, to: Vec<usize> },
    #[error("shapes differ: {left:?} vs {right:?}")]
    ShapeMismatch { left: Vec<usize>, right: Vec<usize> },
    #[error("a rank-0 tensor has no last dimension")]
    Scalar,
}

/// Number of elements of `shape`, or `None` on overflow.
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// A dense f32 tensor in row-major order.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    /// (product of `shape`) elements, last dimension fastest.
    data: Vec<f32>,
}

impl Tensor {
    /// Wrap `data` with `shape`; the lengths must agree.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Result<Self, TensorError> {
        let expected = checked_numel(&shape).ok_or_else(|| TensorError::Overflow {
            shape: shape.clone(),
        })?;
        if expected != data.len() {
            return Err(TensorError::LengthMismatch {
                shape,
                expected,
                found: data.len(),
            });
        }
        Ok(Self { shape, data })
    }

    /// A tensor of zeros.
    pub fn zeros(shape: Vec<usize>) -> Result<Self, TensorError> {
        let n = checked_numel(&shape).ok_or_else(|| TensorError::Overflow {
            shape: shape.clone(),
        })?;
        Ok(Self {
            shape,
            data: vec![0.0; n],
        })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    pub fn numel(&self) -> usize {
        self.data.len()
    }

    pub fn data(&self) -> &[f32] {
        &self.data
    }

    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }

    pub fn into_data(self) -> Vec<f32> {
        self.data
    }

    /// Size of the last dimension (the "width" every row-wise op works on).
    pub fn last_dim(&self) -> Result<usize, TensorError> {
        self.shape.last().copied().ok_or(TensorError::Scalar)
    }

    /// Number of rows when every dimension but the last is flattened.
    pub fn rows(&self) -> Result<usize, TensorError> {
        let w = self.last_dim()?;
        Ok(self.data.len().checked_div(w).unwrap_or(0))
    }

    /// The same data under another shape with the same element count.
    pub fn reshape(self, shape: Vec<usize>) -> Result<Self, TensorError> {
        if checked_numel(&shape) != Some(self.data.len()) {
            return Err(TensorError::Reshape {
                from: self.shape,
                to: shape,
            });
        }
        Ok(Self {
            shape,
            data: self.data,
        })
    }

    /// Row `i` of a tensor viewed as (rows, last_dim). Panics if out of range,
    /// like slice indexing.
    pub fn row(&self, i: usize) -> &[f32] {
        let w = self.shape.last().copied().unwrap_or(1);
        &self.data[i * w..(i + 1) * w]
    }

    /// Index of the largest element of each row (first one on ties).
    pub fn argmax_rows(&self) -> Result<Vec<usize>, TensorError> {
        let w = self.last_dim()?;
        if w == 0 {
            return Ok(Vec::new());
        }
        Ok(self
            .data
            .chunks_exact(w)
            .map(|row| argmax(row) as usize)
            .collect())
    }
}

/// Index of the largest value (the first on ties; 0 for an empty slice):
/// greedy decoding and every "which class" question in the workspace use
/// this one function. NaN never wins (every comparison with it is false).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_checks_length() {
        assert!(Tensor::new(vec![2, 3], vec![0.0; 6]).is_ok());
        assert_eq!(
            Tensor::new(vec![2, 3], vec![0.0; 5]),
            Err(TensorError::LengthMismatch {
                shape: vec![2, 3],
                expected: 6,
                found: 5
            })
        );
        assert!(matches!(
            Tensor::new(vec![usize::MAX, 3], vec![]),
            Err(TensorError::Overflow { .. })
        ));
    }

    #[test]
    fn reshape_and_rows() {
        let t = Tensor::new(vec![2, 3, 4], (0..24).map(|x| x as f32).collect()).unwrap();
        assert_eq!(t.rows().unwrap(), 6);
        assert_eq!(t.row(1), &[4.0, 5.0, 6.0, 7.0]);
        let t = t.reshape(vec![6, 4]).unwrap();
        assert_eq!(t.shape(), &[6, 4]);
        assert!(t.clone().reshape(vec![5, 5]).is_err());
        assert_eq!(t.argmax_rows().unwrap(), vec![3; 6]);
    }
}
