//! A row of activations quantised to 8 bits, laid out for the kernels.
//!
//! GGUF's Q8_1 and Q8_0 blocks keep each block's f16 scale beside its 32
//! codes. A weight matrix meets the same activation row once per weight
//! row (576 to 1,536 times per product at SmolLM2's sizes), so the kernels
//! would convert the same f16 scales that many times. `QRow` holds the
//! same numbers split in two:
//!
//! ```text
//!   codes:  [q_0 (32 × i8)][q_1 (32 × i8)] ...   two blocks = one 64-byte load
//!   scales: [d_0, s_0][d_1, s_1] ...            f32; s = d·Σq (Q8_1), 0 (Q8_0)
//!   sums:   Σq_0, Σq_1, ...                     i32, exact
//! ```
//!
//! f16 → f32 is exact, so a dot product over a `QRow` is the same
//! arithmetic as ggml's over the blocks (`dot::scalar` checks it bit for
//! bit). A `QRow` is only ever made from blocks or by a quantiser that
//! gives the blocks' values; nothing is lost by the layout.

use std::ops::Range;

use crate::formats::{f, BlockQ8_0, BlockQ8_1, QK};

/// Which 8-bit format the activations take: Q8_1 (with s, for weights
/// with a minimum, Q4_1) or Q8_0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActFormat {
    Q8_0,
    Q8_1,
}

/// Quantised activations: one or more rows of blocks, back to back.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QRow {
    codes: Vec<[i8; QK]>,
    scales: Vec<[f32; 2]>,
    /// Σ codes per block (exact): Q4_0's −8 and Q8_0's +128 offsets.
    sums: Vec<i32>,
}

/// A Q8_1 block as a `QRow` holds it: its codes, and [d, s] in f32.
pub(crate) fn q8_1_parts(b: &BlockQ8_1) -> ([i8; QK], [f32; 2]) {
    (b.qs, [f(b.d), f(b.s)])
}

/// A Q8_0 block as a `QRow` holds it: its codes, and [d, 0] in f32.
pub(crate) fn q8_0_parts(b: &BlockQ8_0) -> ([i8; QK], [f32; 2]) {
    (b.qs, [f(b.d), 0.0])
}

/// Blocks `range` of a [`QRow`]: what a kernel reads.
#[derive(Clone, Copy, Debug)]
pub struct QRowRef<'a> {
    codes: &'a [[i8; QK]],
    scales: &'a [[f32; 2]],
    sums: &'a [i32],
}

impl QRow {
    pub fn from_q8_1(b: &[BlockQ8_1]) -> QRow {
        let (codes, scales) = b.iter().map(q8_1_parts).unzip();
        QRow::with_sums(codes, scales)
    }

    pub fn from_q8_0(b: &[BlockQ8_0]) -> QRow {
        let (codes, scales) = b.iter().map(q8_0_parts).unzip();
        QRow::with_sums(codes, scales)
    }

    fn with_sums(codes: Vec<[i8; QK]>, scales: Vec<[f32; 2]>) -> QRow {
        let mut q = QRow {
            codes,
            scales,
            sums: Vec::new(),
        };
        q.fill_sums();
        q
    }

    /// Σ codes of every block, after a quantiser filled the codes.
    pub(crate) fn fill_sums(&mut self) {
        self.sums.clear();
        self.sums.extend(
            self.codes
                .iter()
                .map(|c| c.iter().map(|&q| q as i32).sum::<i32>()),
        );
    }

    /// Blocks.
    pub fn len(&self) -> usize {
        self.codes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.codes.is_empty()
    }

    /// Blocks `r` (panics outside the row, as slicing does).
    pub fn blocks(&self, r: Range<usize>) -> QRowRef<'_> {
        QRowRef {
            codes: &self.codes[r.clone()],
            scales: &self.scales[r.clone()],
            sums: &self.sums[r],
        }
    }

    pub fn all(&self) -> QRowRef<'_> {
        self.blocks(0..self.len())
    }

    /// `src`'s rows of `s·per` blocks regrouped segment by segment:
    /// segment j's blocks of every row (row-major, `per` each) at
    /// j·rows·per, so each segment reads as rows of its own (`segments.rs`
    /// in Project 04).
    pub(crate) fn regroup_from(&mut self, src: &QRow, segments: usize, per: usize) {
        let rows = src.len() / (segments * per).max(1);
        self.codes.clear();
        self.scales.clear();
        self.sums.clear();
        for j in 0..segments {
            for i in 0..rows {
                let r = (i * segments + j) * per..(i * segments + j + 1) * per;
                self.codes.extend_from_slice(&src.codes[r.clone()]);
                self.scales.extend_from_slice(&src.scales[r.clone()]);
                self.sums.extend_from_slice(&src.sums[r]);
            }
        }
    }

    /// `n` zero blocks, for a quantiser to fill in place.
    pub(crate) fn zeroed(&mut self, n: usize) -> (&mut [[i8; QK]], &mut [[f32; 2]]) {
        self.codes.clear();
        self.codes.resize(n, [0; QK]);
        self.scales.clear();
        self.scales.resize(n, [0.0; 2]);
        (&mut self.codes, &mut self.scales)
    }
}

impl<'a> QRowRef<'a> {
    pub fn len(&self) -> usize {
        self.codes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.codes.is_empty()
    }

    pub fn codes(&self) -> &'a [[i8; QK]] {
        self.codes
    }

    /// [d, s] per block.
    pub fn scales(&self) -> &'a [[f32; 2]] {
        self.scales
    }

    /// Σ codes per block.
    pub fn sums(&self) -> &'a [i32] {
        self.sums
    }

    /// Blocks `r` of this part.
    pub fn slice(&self, r: Range<usize>) -> QRowRef<'a> {
        QRowRef {
            codes: &self.codes[r.clone()],
            scales: &self.scales[r.clone()],
            sums: &self.sums[r],
        }
    }
}
