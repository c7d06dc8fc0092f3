//! Strided matrix views. A view is (rows, cols) with a row stride and a
//! column stride in elements, so a transpose is a swap of strides and a
//! sub-matrix or padded leading dimension is just a stride: every variant and
//! the packing routines read operands through these, never by assumption.
//!
//! The fields are private to the crate: the unsafe kernels trust that every
//! element a view names lies inside its buffer, and only the checked
//! constructors establish that. Outside code reads the shape through
//! accessors and cannot forge or stretch a view:
//!
//! ```compile_fail,E0451
//! // A 1,000 x 1,000 "view" of one float: does not compile (private fields).
//! let one = [0.0f32];
//! let v = p02_matmul_bench::MatRef { data: &one, rows: 1000, cols: 1000, rs: 1000, cs: 1 };
//! ```
//!
//! ```compile_fail,E0616
//! // Growing a checked view after the fact: does not compile either.
//! let buf = [0.0f32; 4];
//! let mut v = p02_matmul_bench::MatRef::row_major(&buf, 2, 2).unwrap();
//! v.rows = 1000;
//! ```
//!
//! ```compile_fail,E0616
//! let mut buf = [0.0f32; 4];
//! let mut c = p02_matmul_bench::MatMut::row_major(&mut buf, 2, 2).unwrap();
//! c.ld = 1000;
//! ```
//!
//! ```
//! // The checked way: a view too big for its buffer is an error.
//! let buf = [0.0f32; 4];
//! assert!(p02_matmul_bench::MatRef::row_major(&buf, 1000, 1000).is_err());
//! let v = p02_matmul_bench::MatRef::row_major(&buf, 2, 2).unwrap();
//! assert_eq!((v.rows(), v.cols(), v.rs(), v.cs()), (2, 2, 2, 1));
//! ```

use crate::GemmError;

/// A read-only strided view of f32s: element (i, j) is `data[i*rs + j*cs]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    pub(crate) data: &'a [f32],
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// Row stride (elements).
    pub(crate) rs: usize,
    /// Column stride (elements).
    pub(crate) cs: usize,
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

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Row stride (elements).
    pub fn rs(&self) -> usize {
        self.rs
    }

    /// Column stride (elements).
    pub fn cs(&self) -> usize {
        self.cs
    }

    /// The whole buffer the view reads from.
    pub fn data(&self) -> &'a [f32] {
        self.data
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
    pub(crate) data: &'a mut [f32],
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// Leading dimension (elements from one row to the next).
    pub(crate) ld: usize,
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

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Leading dimension (elements).
    pub fn ld(&self) -> usize {
        self.ld
    }

    /// The whole buffer (its length cannot change through this borrow, so
    /// the checked extent still holds).
    pub fn as_slice(&self) -> &[f32] {
        self.data
    }

    /// Row i's `cols` values. Panics if i >= rows, like slice indexing.
    pub fn row(&self, i: usize) -> &[f32] {
        assert!(i < self.rows, "row {i} of a {}-row matrix", self.rows);
        &self.data[i * self.ld..i * self.ld + self.cols]
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
