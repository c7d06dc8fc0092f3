//! A part of a block matrix: some of its rows, some of its columns. What a
//! tensor-parallel rank keeps (Project 13): whole rows for a column-parallel
//! projection, a range of input columns for a row-parallel one. Columns are
//! cut on block boundaries, so the part's blocks are the matrix's own,
//! copied, never re-quantised: a rank's weights are bit for bit the file's.

use std::ops::Range;

use crate::formats::QK;
use crate::matrix::{panels_of, Blocks, MatrixError, QuantMatrix};

impl QuantMatrix {
    /// Rows `rows` (row r of the part is row `rows[r]`; None: all, in
    /// order) and columns `cols`, which must start and end on a 32-wide
    /// block boundary.
    pub fn select(self, rows: Option<&[usize]>, cols: Range<usize>) -> Result<Self, MatrixError> {
        if cols.start > cols.end
            || cols.end > self.cols
            || !cols.start.is_multiple_of(QK)
            || !cols.end.is_multiple_of(QK)
        {
            return Err(MatrixError::Columns {
                start: cols.start,
                end: cols.end,
                cols: self.cols,
            });
        }
        let all: Vec<usize>;
        let rows = match rows {
            Some(r) => r,
            None => {
                all = (0..self.rows).collect();
                &all
            }
        };
        if rows.iter().any(|&r| r >= self.rows) {
            return Err(MatrixError::Permutation {
                rows: self.rows,
                got: rows.len(),
            });
        }
        let per = self.cols / QK;
        let kept = cols.start / QK..cols.end / QK;
        fn gather<B: Copy>(b: &[B], rows: &[usize], per: usize, kept: &Range<usize>) -> Vec<B> {
            rows.iter()
                .flat_map(|&r| &b[r * per..][kept.clone()])
                .copied()
                .collect()
        }
        let blocks = match &self.blocks {
            Blocks::Q4_1(b) => Blocks::Q4_1(gather(b, rows, per, &kept)),
            Blocks::Q4_0(b) => Blocks::Q4_0(gather(b, rows, per, &kept)),
            Blocks::Q8_0(b) => Blocks::Q8_0(gather(b, rows, per, &kept)),
        };
        let row_scale = self
            .row_scale
            .as_ref()
            .map(|s| rows.iter().map(|&r| s[r]).collect());
        Ok(QuantMatrix {
            rows: rows.len(),
            cols: cols.len(),
            panels: panels_of(&blocks, rows.len(), kept.len()),
            blocks,
            row_scale,
            ..self
        })
    }
}
