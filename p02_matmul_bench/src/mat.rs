//! Strided matrix views. A view is (rows, cols) with a row stride and a
//! column stride in elements, so a transpose is a swap of strides and a
//! sub-matrix or padded leading dimension is just a stride: every variant and
//! the packing routines read operands through these, never by assumption.

use crate::GemmError;

/// A read-only strided view of f32s: element (i, j) is `data[i*rs + j*cs]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    /// Row stride (elements).
    pub rs: usize,
    /// Column stride (elements).
    pub cs: usize,
}

/// Index of the last element a (rows, cols, rs, cs) view touches, plus one;
/// `None` on overflow. An empty view needs no storage.
fn extent(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<usize> {
    if rows == 0 || cols == 0 {
        return Some(0);
    }
    (rows - 1)
        .checked_mul(rs)?
        .checked_add((cols - 1).checked_mul(cs)?)?
        .checked_add(1)
}

impl<'a> MatRef<'a> {
    /// A strided view; checks that every element lies inside `data`.
    pub fn new(
        data: &'a [f32],
        rows: usize,
        cols: usize,
        rs: usize,
        cs: usize,
    ) -> Result<Self, GemmError> {
        match extent(rows, cols, rs, cs) {
            Some(n) if n <= data.len() => Ok(Self {
                data,
                rows,
                cols,
                rs,
                cs,
            }),
            _ => Err(GemmError::Buffer {
                what: "matrix view",
                rows,
                cols,
                needed: extent(rows, cols, rs, cs),
                len: data.len(),
            }),
        }
    }

    /// A dense row-major (rows, cols) view.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Result<Self, GemmError> {
        Self::new(data, rows, cols, cols, 1)
    }

    /// The transpose, as a view of the same memory.
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Element (i, j). Panics out of range, like slice indexing.
    #[inline(always)]
    pub fn at(&self, i: usize, j: usize) -> f32 {
        self.data[i * self.rs + j * self.cs]
    }
}

/// A mutable row-major view with leading dimension `ld` (>= cols).
#[derive(Debug)]
pub struct MatMut<'a> {
    pub data: &'a mut [f32],
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
}

impl<'a> MatMut<'a> {
    pub fn new(
        data: &'a mut [f32],
        rows: usize,
        cols: usize,
        ld: usize,
    ) -> Result<Self, GemmError> {
        match extent(rows, cols, ld, 1) {
            Some(n) if n <= data.len() && (ld >= cols || rows <= 1) => Ok(Self {
                data,
                rows,
                cols,
                ld,
            }),
            needed => Err(GemmError::Buffer {
                what: "output matrix",
                rows,
                cols,
                needed,
                len: data.len(),
            }),
        }
    }

    pub fn row_major(data: &'a mut [f32], rows: usize, cols: usize) -> Result<Self, GemmError> {
        Self::new(data, rows, cols, cols)
    }

    /// Re-borrow.
    pub fn rb(&mut self) -> MatMut<'_> {
        MatMut {
            data: self.data,
            rows: self.rows,
            cols: self.cols,
            ld: self.ld,
        }
    }
}
