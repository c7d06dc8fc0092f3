//! Weight rows repacked for the tile kernels: 16 rows side by side, so
//! one 512-bit register holds 4 codes of each of 16 rows and one integer
//! multiply-add instruction (`vpdpbusd`) advances 16 dot products at once.
//!
//! ```text
//! group g = rows 16g..16g + 16, block b (32 values of each row):
//!   codes, Q4_1 / Q4_0: 4 lines of 64 bytes; line c, bytes 4l..4l + 4 =
//!                       row 16g + l's qs[4c..4c + 4]
//!                       (low nibbles: values 4c..4c + 4, high: 16 + 4c..)
//!   codes, Q8_0:        8 lines; line c, bytes 4l..4l + 4 = row 16g + l's
//!                       values 4c..4c + 4, plus 128 (as u8)
//!   scales:             d of the 16 rows (f16), and for Q4_1 their m
//! ```
//!
//! The same bytes as GGUF's blocks (20, 18 and 34 per row and block, less
//! Q8_0's and Q4_0's scales' padding to a whole line), read in the same
//! order at decode: group by group, block by block. A last group with
//! fewer than 16 rows is padded with zero rows (scales 0), which add
//! nothing and are never stored.
//!
//! Why this layout (llama.cpp repacks its Q4_0 for AVX2/AVX-512 the same
//! way): with one row's blocks in a register, every (activation row,
//! weight row) pair needs its own float convert, scale and add per block;
//! with 16 rows in the lanes, the lanes are the rows, so those float steps
//! run once per 16 outputs and the integer adds stay in the lanes. Each
//! output is then summed block by block in one lane with no horizontal
//! step: its arithmetic cannot depend on which tile or thread it is in.

use crate::formats::{BlockQ4_0, BlockQ4_1, BlockQ8_0, QK};
use crate::tile::Kind;

/// Weight rows in a group (the lanes of a 512-bit register of i32).
pub const GROUP: usize = 16;

/// 64 bytes, 64-aligned: one register's load.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Line(pub [u8; 64]);

impl Default for Line {
    fn default() -> Self {
        Line([0; 64])
    }
}

/// A weight matrix in groups of [`GROUP`] rows (see the module).
#[derive(Clone, Debug, PartialEq)]
pub struct Panels {
    kind: Kind,
    rows: usize,
    /// Blocks per row.
    per: usize,
    /// (groups, per, lines per block)
    codes: Vec<Line>,
    /// (groups, per, scales per block) × 16 f16: d, then m for Q4_1.
    scales: Vec<[u16; GROUP]>,
}

impl Panels {
    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Blocks per row.
    pub fn per(&self) -> usize {
        self.per
    }

    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }

    /// Lines of codes per (group, block): 4 for 4-bit codes, 8 for Q8_0.
    pub fn lines(&self) -> usize {
        lines(self.kind)
    }

    /// Scales per (group, block): d, and m for Q4_1.
    pub fn scale_sets(&self) -> usize {
        scale_sets(self.kind)
    }

    /// The code lines of (group g, block b).
    pub fn codes(&self, g: usize, b: usize) -> &[Line] {
        let l = self.lines();
        let at = (g * self.per + b) * l;
        &self.codes[at..at + l]
    }

    /// The scale sets of (group g, block b): [d] or [d, m].
    pub fn scales(&self, g: usize, b: usize) -> &[[u16; GROUP]] {
        let s = self.scale_sets();
        let at = (g * self.per + b) * s;
        &self.scales[at..at + s]
    }

    /// Bytes held (codes and scales).
    pub fn bytes(&self) -> usize {
        self.codes.len() * 64 + self.scales.len() * 2 * GROUP
    }

    /// `rows` rows of `per` Q4_1 blocks each (`w.len()` = rows·per).
    pub fn from_q4_1(w: &[BlockQ4_1], rows: usize, per: usize) -> Panels {
        Panels::pack(Kind::Q4_1, rows, per, |r, b, c, out, sc| {
            let blk = &w[r * per + b];
            out.copy_from_slice(&blk.qs[4 * c..4 * c + 4]);
            sc[0] = blk.d;
            sc[1] = blk.m;
        })
    }

    pub fn from_q4_0(w: &[BlockQ4_0], rows: usize, per: usize) -> Panels {
        Panels::pack(Kind::Q4_0, rows, per, |r, b, c, out, sc| {
            let blk = &w[r * per + b];
            out.copy_from_slice(&blk.qs[4 * c..4 * c + 4]);
            sc[0] = blk.d;
        })
    }

    pub fn from_q8_0(w: &[BlockQ8_0], rows: usize, per: usize) -> Panels {
        Panels::pack(Kind::Q8_0, rows, per, |r, b, c, out, sc| {
            let blk = &w[r * per + b];
            for (o, &q) in out.iter_mut().zip(&blk.qs[4 * c..4 * c + 4]) {
                *o = (q as u8) ^ 0x80;
            }
            sc[0] = blk.d;
        })
    }

    /// Lay out every (group, block, line): `fill(row, block, line, 4 bytes,
    /// scales)` writes a real row's part; padding rows stay zero (Q8_0's
    /// codes 128, which is 0).
    #[allow(clippy::needless_range_loop)] // `lane` places bytes and scales alike
    fn pack(
        kind: Kind,
        rows: usize,
        per: usize,
        fill: impl Fn(usize, usize, usize, &mut [u8], &mut [u16; 2]),
    ) -> Panels {
        let (l, s) = (lines(kind), scale_sets(kind));
        let groups = rows.div_ceil(GROUP);
        let pad = if kind == Kind::Q8_0 { 0x80 } else { 0 };
        let mut codes = vec![Line([pad; 64]); groups * per * l];
        let mut scales = vec![[0u16; GROUP]; groups * per * s];
        for g in 0..groups {
            for b in 0..per {
                let at = (g * per + b) * l;
                for lane in 0..GROUP.min(rows - g * GROUP) {
                    let r = g * GROUP + lane;
                    let mut sc = [0u16; 2];
                    for c in 0..l {
                        fill(
                            r,
                            b,
                            c,
                            &mut codes[at + c].0[4 * lane..4 * lane + 4],
                            &mut sc,
                        );
                    }
                    for (k, v) in sc.iter().take(s).enumerate() {
                        scales[(g * per + b) * s + k][lane] = *v;
                    }
                }
            }
        }
        Panels {
            kind,
            rows,
            per,
            codes,
            scales,
        }
    }
}

fn lines(kind: Kind) -> usize {
    match kind {
        Kind::Q4_1 | Kind::Q4_0 => QK / 8,
        Kind::Q8_0 => QK / 4,
    }
}

fn scale_sets(kind: Kind) -> usize {
    match kind {
        Kind::Q4_1 => 2,
        Kind::Q4_0 | Kind::Q8_0 => 1,
    }
}
