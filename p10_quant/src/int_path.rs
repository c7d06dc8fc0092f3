//! The integer path of [`QuantMatrix`]: activations quantised to 8 bits
//! once, then block dot products, for one matrix or a group of matrices
//! that read the same x (q, k and v; gate and up).
//!
//! ```text
//! matmul_int_group([W_0, W_1, ..], x (m, k), [y_0, y_1, ..]):
//!   xq = quantize each row of x                 (m, k/32) blocks, once
//!   rows of all W_j in one range 0..Σ n_j, split across the pool's threads:
//!     for each tile of 64 activation rows i:    (the weight row stays in L1)
//!       y_j[i, r] = dot(W_j[r], xq[i])
//! ```
//!
//! A group costs one quantisation and one dispatch instead of one each:
//! at decode that is 90 fewer wake-ups per SmolLM2 token (30 layers,
//! 7 products become 4).

use std::cell::RefCell;

use crate::act::{ActFormat, QRow, QRowRef};
use crate::formats::QK;
use crate::matrix::{Blocks, MatrixError, QuantMatrix};
use crate::pool::Pool;
use p04_transformer::proj::MAX_GROUP;

/// Why a group cannot run fused.
#[derive(Debug)]
pub enum GroupError {
    /// Different block formats or widths (run them one by one).
    Mixed,
    Matrix(MatrixError),
}

impl From<MatrixError> for GroupError {
    fn from(e: MatrixError) -> Self {
        GroupError::Matrix(e)
    }
}

impl From<crate::formats::FormatError> for GroupError {
    fn from(e: crate::formats::FormatError) -> Self {
        GroupError::Matrix(e.into())
    }
}

impl QuantMatrix {
    /// The integer path: activations quantised to 8 bits, block dot products.
    pub fn matmul_int(
        &self,
        x: &[f32],
        m: usize,
        y: &mut [f32],
        pool: &Pool,
        threads: usize,
    ) -> Result<(), MatrixError> {
        match QuantMatrix::matmul_int_group(&[self], x, m, &mut [y], pool, threads) {
            Ok(()) => Ok(()),
            Err(GroupError::Matrix(e)) => Err(e),
            Err(GroupError::Mixed) => unreachable!("one matrix is one format"),
        }
    }

    /// ys[j] (m, n_j) = x (m, k) · mats[j]ᵀ for matrices of one block
    /// format and one width k, on the integer path, in one dispatch.
    pub fn matmul_int_group(
        mats: &[&QuantMatrix],
        x: &[f32],
        m: usize,
        ys: &mut [&mut [f32]],
        pool: &Pool,
        threads: usize,
    ) -> Result<(), GroupError> {
        let Some(first) = mats.first() else {
            return Ok(());
        };
        if ys.len() != mats.len()
            || mats.len() > MAX_GROUP
            || mats
                .iter()
                .any(|w| w.cols != first.cols || w.dot != first.dot)
        {
            return Err(GroupError::Mixed);
        }
        for (w, y) in mats.iter().zip(ys.iter()) {
            w.check_io(x, m, y)?;
        }
        // On the stack: a decode step allocates nothing.
        let mut outs = [Out {
            ptr: std::ptr::null_mut(),
            rows: 0,
        }; MAX_GROUP];
        for ((o, w), y) in outs.iter_mut().zip(mats).zip(ys.iter_mut()) {
            *o = Out {
                ptr: y.as_mut_ptr(),
                rows: w.rows,
            };
        }
        let outs = &outs[..mats.len()];
        let dot = first.dot;
        // Rows of k = 32·j values: quantising x as one long row gives each
        // row's blocks, back to back.
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            let xq = &mut s.xq;
            let per = first.cols / QK;
            // One arm per weight format: its blocks, its activation
            // blocks, its dot product.
            macro_rules! run {
                ($variant:ident, $format:ident, $dot:ident, $into:ident) => {{
                    let w = same(mats, |b| match b {
                        Blocks::$variant(b) => Some(&b[..]),
                        _ => None,
                    })?;
                    quantiser(dot).quantize(x, ActFormat::$format, xq)?;
                    let ws = &w[..mats.len()];
                    let one = |w: &[_], x: QRowRef<'_>| dot.$dot(w, x);
                    let into = |w: &[_], x: QRowRef<'_>, y: &mut [f32]| dot.$into(w, per, x, y);
                    rows_times(ws, outs, per, xq, m, pool, threads, one, into);
                }};
            }
            match &first.blocks {
                Blocks::Q4_1(_) => run!(Q4_1, Q8_1, q4_1, q4_1_into),
                Blocks::Q4_0(_) => run!(Q4_0, Q8_0, q4_0, q4_0_into),
                Blocks::Q8_0(_) => run!(Q8_0, Q8_0, q8_0, q8_0_into),
            }
            Ok::<(), GroupError>(())
        })?;
        for (w, y) in mats.iter().zip(ys.iter_mut()) {
            w.scale_outputs(y);
        }
        Ok(())
    }
}

/// Every matrix's blocks as the first one's format, or `Mixed` (at most
/// MAX_GROUP matrices; the unused entries empty).
fn same<'a, B>(
    mats: &[&'a QuantMatrix],
    get: impl Fn(&'a Blocks) -> Option<&'a [B]>,
) -> Result<[&'a [B]; MAX_GROUP], GroupError> {
    let mut out: [&[B]; MAX_GROUP] = [&[]; MAX_GROUP];
    for (o, w) in out.iter_mut().zip(mats) {
        *o = get(&w.blocks).ok_or(GroupError::Mixed)?;
    }
    Ok(out)
}

/// One output of a group: y_j's pointer and its row count n_j, shared by
/// the threads that write disjoint elements of it.
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    rows: usize,
}
// SAFETY: used only as described at the write in `rows_times`.
unsafe impl Sync for Out {}

/// y_j[i, r] = dot(W_j[r], X[i]) for every row r of every matrix j (the
/// rows of all of them split across threads as one range 0..Σ n_j) and
/// every activation row i (in tiles, so W_j[r] is reused from L1; one
/// activation row, decode's case, is one `dot_into` call per matrix).
#[allow(clippy::too_many_arguments)]
fn rows_times<W: Sync>(
    ws: &[&[W]],
    outs: &[Out],
    per: usize,
    xq: &QRow,
    m: usize,
    pool: &Pool,
    threads: usize,
    dot: impl Fn(&[W], QRowRef<'_>) -> f32 + Sync,
    dot_into: impl Fn(&[W], QRowRef<'_>, &mut [f32]) + Sync,
) {
    const TILE: usize = 64;
    let total: usize = outs.iter().map(|o| o.rows).sum();
    pool.for_ranges(total, threads, &|range| {
        let mut start = 0;
        for (w, out) in ws.iter().zip(outs) {
            // This matrix's rows inside `range`, in its own numbering.
            let lo = range.start.max(start) - start;
            let hi = range.end.min(start + out.rows).saturating_sub(start);
            start += out.rows;
            let n = out.rows;
            if m == 1 && lo < hi && !row_calls() {
                // Decode: this thread's rows of W_j in one call, into y_j[lo..hi].
                // SAFETY: hi ≤ n, so lo..hi is inside y_j (n long for one
                // row); the ranges of different threads are disjoint, and
                // y_j outlives `for_ranges`.
                let y = unsafe { std::slice::from_raw_parts_mut(out.ptr.add(lo), hi - lo) };
                dot_into(&w[lo * per..hi * per], xq.blocks(0..per), y);
                continue;
            }
            for i0 in (0..m).step_by(TILE) {
                for r in lo..hi {
                    let wr = &w[r * per..(r + 1) * per];
                    for i in i0..(i0 + TILE).min(m) {
                        let v = dot(wr, xq.blocks(i * per..(i + 1) * per));
                        // SAFETY: i < m and r < n, so the index is inside
                        // y_j (m·n long, checked by `check_io`); each row of
                        // the group belongs to one range, so no two threads
                        // write the same element, and y_j outlives
                        // `for_ranges`.
                        unsafe { *out.ptr.add(i * n + r) = v };
                    }
                }
            }
        }
    });
}

/// Per-thread buffer for the quantised activations (no allocation per
/// product once warm).
#[derive(Default)]
struct Scratch {
    xq: QRow,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

static SCALAR_QUANTISER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Quantise activations with the scalar reference even where the dot
/// products use SIMD, for before/after measurements of the SIMD quantiser
/// (`examples/decode_ab.rs quantiser`). Off by default.
pub fn set_scalar_quantiser(on: bool) {
    SCALAR_QUANTISER.store(on, std::sync::atomic::Ordering::Relaxed);
}

fn quantiser(dot: crate::Dot) -> crate::Dot {
    if SCALAR_QUANTISER.load(std::sync::atomic::Ordering::Relaxed) {
        crate::Dot::new(crate::Isa::Scalar).unwrap_or(dot)
    } else {
        dot
    }
}

static ROW_CALLS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// At decode, call the kernel once per weight row (as before `dot_into`)
/// rather than once per thread's share of a matrix, for before/after
/// measurements (`examples/decode_ab.rs calls`). Off by default.
pub fn set_row_calls(on: bool) {
    ROW_CALLS.store(on, std::sync::atomic::Ordering::Relaxed);
}

fn row_calls() -> bool {
    ROW_CALLS.load(std::sync::atomic::Ordering::Relaxed)
}
