//! The integer kernel family: y[i, r] = dot(W[r], X[i]) for m activation
//! rows and the weight rows of some groups of a [`Panels`] (16 rows side
//! by side, see `panel.rs`), in register tiles of up to 8 activation rows
//! × one group.
//!
//! ```text
//! for each group of 16 weight rows g:                  (its panels stay in L1)
//!   for each tile of m_r ≤ 8 activation rows i0..:
//!     acc[m_r] = 0                                      16 f32 lanes: the group's rows
//!     for each block b, in order:
//!       w = the group's codes of block b, unpacked once per tile
//!       for each activation row i of the tile:
//!         p = Σ_k w[lane][k] · x_i[k]                   i32 per lane, exact
//!         acc[i] = fma(d_w[lane]·d_x, f32(p), acc[i])   (+ fma(m_w, s_x) for Q4_1)
//!     y[i, 16g + lane] = acc[i][lane]
//! ```
//!
//! Each weight block is unpacked once per m_r activation rows, and one
//! integer multiply-add instruction advances 16 outputs: the float work
//! (a convert, a multiply and one or two fused multiply-adds per block)
//! runs once per 16 outputs instead of once per output.
//!
//! **Batch invariance.** An output is one lane summed block by block, with
//! exact integer sums inside a block and the same float operations in the
//! same order on every path: its value cannot depend on m, on the tile or
//! thread it falls in, or on anything else in the product. The scalar
//! reference here does the same arithmetic with `f32::mul_add`, so every
//! path gives the same bits (tested on every path for m = 1…70 and ragged
//! shapes in `tests/tile.rs`). It differs from ggml's per-row sum
//! (`dot::scalar`) only in float rounding, within the bound tested there.

use crate::act::QRowRef;
use std::ops::Range;

use crate::formats::{f, QK};
use crate::panel::{Panels, GROUP};

/// Where a tile product writes: y[i·ld + r] for activation row i < m and
/// weight row r < n. Built from a slice ([`OutRows::new`]) or, for threads
/// that write disjoint columns of one y, from a raw pointer
/// ([`OutRows::from_raw`]).
#[derive(Clone, Copy, Debug)]
pub struct OutRows {
    ptr: *mut f32,
    ld: usize,
    m: usize,
    n: usize,
}

impl OutRows {
    /// Rows of `y` `ld` apart, m of them, n values written in each.
    /// None when y is too short or ld < n.
    pub fn new(y: &mut [f32], m: usize, n: usize, ld: usize) -> Option<OutRows> {
        let need = match m {
            0 => 0,
            _ => (m - 1).checked_mul(ld)?.checked_add(n)?,
        };
        (ld >= n && y.len() >= need).then_some(OutRows {
            ptr: y.as_mut_ptr(),
            ld,
            m,
            n,
        })
    }

    /// # Safety
    /// `ptr[i·ld + r]` must be writable for i < m, r < n, for as long as
    /// the product runs, and written by no one else meanwhile.
    pub unsafe fn from_raw(ptr: *mut f32, m: usize, n: usize, ld: usize) -> OutRows {
        OutRows { ptr, ld, m, n }
    }

    pub fn m(&self) -> usize {
        self.m
    }

    pub fn n(&self) -> usize {
        self.n
    }

    /// y[i, r] = v (out-of-range indices are a kernel bug: they panic).
    #[inline(always)]
    pub(crate) fn set(&self, i: usize, r: usize, v: f32) {
        assert!(
            i < self.m && r < self.n,
            "tile output ({i}, {r}) outside {} x {}",
            self.m,
            self.n
        );
        // SAFETY: inside the m × n window the constructor vouched for.
        unsafe { *self.ptr.add(i * self.ld + r) = v };
    }

    /// Where y[i, r0..r0 + len] starts (a kernel's vector store; a range
    /// outside the window is a kernel bug: it panics).
    #[inline(always)]
    pub(crate) fn row_at(&self, i: usize, r0: usize, len: usize) -> *mut f32 {
        assert!(
            i < self.m && r0 + len <= self.n,
            "tile store ({i}, {r0}+{len}) outside {} x {}",
            self.m,
            self.n
        );
        // SAFETY: inside the window (checked above).
        unsafe { self.ptr.add(i * self.ld + r0) }
    }
}

/// What the kernels need to know of a weight format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// d·Σ nib·x + m·s: 4-bit codes 0..15 and a minimum.
    Q4_1,
    /// d·Σ (nib − 8)·x.
    Q4_0,
    /// d·Σ q·x, q in −127..127.
    Q8_0,
}

/// The live weight rows of `groups` (16 a group, fewer in the last) when
/// the product fits: groups inside the panels, m·per activation blocks in
/// `x`, and `out` m × those rows. None otherwise.
pub(crate) fn check(
    p: &Panels,
    groups: &Range<usize>,
    x: QRowRef<'_>,
    out: &OutRows,
) -> Option<usize> {
    if groups.start > groups.end || groups.end > p.groups() {
        return None;
    }
    let n = (groups.end * GROUP)
        .min(p.rows())
        .saturating_sub(groups.start * GROUP);
    let fits = n == out.n && out.m.checked_mul(p.per()).is_some_and(|b| b <= x.len());
    fits.then_some(n)
}

/// Tiles of at most `MR` activation rows: calls `tile(i0, mr)` with `mr`
/// as a constant through `$f::<MR>`, so each tile height is a fully
/// unrolled kernel.
macro_rules! by_rows {
    ($mr:expr, $f:ident($($a:expr),*)) => {
        match $mr {
            1 => $f::<1>($($a),*),
            2 => $f::<2>($($a),*),
            3 => $f::<3>($($a),*),
            4 => $f::<4>($($a),*),
            5 => $f::<5>($($a),*),
            6 => $f::<6>($($a),*),
            7 => $f::<7>($($a),*),
            8 => $f::<8>($($a),*),
            _ => unreachable!("tiles are at most 8 rows"),
        }
    };
}
pub(crate) use by_rows;

/// Four activation codes (bytes 4c..4c + 4 of a block) as one i32, for a
/// kernel to broadcast to every lane.
#[inline(always)]
pub(crate) fn bcast4(q: &[i8; QK], c: usize) -> i32 {
    i32::from_le_bytes([
        q[4 * c] as u8,
        q[4 * c + 1] as u8,
        q[4 * c + 2] as u8,
        q[4 * c + 3] as u8,
    ])
}

/// The integer dot product of lane `lane` of group g's block b with
/// activation block `xb`: exact, in i32.
fn lane_dot(p: &Panels, g: usize, b: usize, lane: usize, q: &[i8; QK], sum: i32) -> i32 {
    let mut acc = 0i32;
    for (c, line) in p.codes(g, b).iter().enumerate() {
        for t in 0..4 {
            let byte = line.0[4 * lane + t] as i32;
            match p.kind() {
                Kind::Q4_1 | Kind::Q4_0 => {
                    acc += (byte & 0x0f) * q[4 * c + t] as i32;
                    acc += (byte >> 4) * q[QK / 2 + 4 * c + t] as i32;
                }
                Kind::Q8_0 => acc += byte * q[4 * c + t] as i32,
            }
        }
    }
    match p.kind() {
        Kind::Q4_1 => acc,
        Kind::Q4_0 => acc - 8 * sum,
        Kind::Q8_0 => acc - 128 * sum,
    }
}

/// The portable reference, and the arithmetic every path follows: per
/// output, block by block, acc = fma(d_w·d_x, f32(p), acc), then for Q4_1
/// acc = fma(m_w, s_x, acc). A shape that does not fit writes nothing.
pub fn reference(p: &Panels, groups: Range<usize>, x: QRowRef<'_>, out: OutRows) {
    let Some(n) = check(p, &groups, x, &out) else {
        return;
    };
    let per = p.per();
    for i in 0..out.m {
        for r in 0..n {
            let (g, lane) = ((groups.start * GROUP + r) / GROUP, r % GROUP);
            let mut acc = 0.0f32;
            for b in 0..per {
                let xb = i * per + b;
                let [dx, sx] = x.scales()[xb];
                let pi = lane_dot(p, g, b, lane, &x.codes()[xb], x.sums()[xb]);
                let sc = p.scales(g, b);
                acc = (f(sc[0][lane]) * dx).mul_add(pi as f32, acc);
                if p.kind() == Kind::Q4_1 {
                    acc = f(sc[1][lane]).mul_add(sx, acc);
                }
            }
            out.set(i, r, acc);
        }
    }
}
