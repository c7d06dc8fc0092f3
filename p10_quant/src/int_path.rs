//! The integer path of [`QuantMatrix`]: activations quantised to 8 bits
//! once, then block dot products, for one matrix or a group of matrices
//! that read the same x (q, k and v; gate and up).
//!
//! ```text
//! matmul_int_group([W_0, W_1, ..], x (m, k), [y_0, y_1, ..]):
//!   xq = quantize each row of x                 (m, k/32) blocks, once
//!   rows of all W_j in one range 0..Σ n_j, split across the pool's threads:
//!     y_j[:, rows] = the tile kernels over those rows and every row of xq
//!                    (`tile.rs`: register tiles, one fixed order per output)
//! ```
//!
//! A group costs one quantisation and one dispatch instead of one each:
//! at decode that is 90 fewer wake-ups per SmolLM2 token (30 layers,
//! 7 products become 4).

use std::cell::RefCell;

use crate::act::{ActFormat, QRow};
use crate::matrix::{MatrixError, QuantMatrix};
use crate::panel::{Panels, GROUP};
use crate::pool::Pool;
use crate::tile::{Kind, OutRows};
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
            let format = act_format(first.panels.kind());
            if mats.iter().any(|w| w.panels.kind() != first.panels.kind()) {
                return Err(GroupError::Mixed);
            }
            quantiser(dot).quantize(x, format, xq)?;
            let ps: [&Panels; MAX_GROUP] =
                std::array::from_fn(|j| &mats[j.min(mats.len() - 1)].panels);
            rows_times(&ps[..mats.len()], outs, (xq, 0), m, pool, threads, dot);
            Ok::<(), GroupError>(())
        })?;
        for (w, y) in mats.iter().zip(ys.iter_mut()) {
            w.scale_outputs(y);
        }
        Ok(())
    }
}

impl QuantMatrix {
    /// A row-parallel projection held as S column segments (Project 04's
    /// `segments.rs`), in one dispatch: x (m, S·k) quantised once (its
    /// blocks are per 32 columns, so a segment's are the same as if it
    /// were quantised alone), regrouped segment by segment, segment j's
    /// product over its k columns into partials[j] (m, n), and the S
    /// partials folded in the all-reduce's order into y (m, n). The same
    /// kernel calls on the same numbers as S separate products: the same
    /// bits, one quantisation and one wake-up instead of S.
    pub fn matmul_int_segments(
        parts: &[&QuantMatrix],
        x: &[f32],
        m: usize,
        partials: &mut [f32],
        y: &mut [f32],
        pool: &Pool,
        threads: usize,
    ) -> Result<(), GroupError> {
        let Some(first) = parts.first() else {
            return Ok(());
        };
        let (s, n, k) = (parts.len(), first.rows, first.cols);
        let same = |w: &&QuantMatrix| {
            w.rows == n
                && w.cols == k
                && w.dot == first.dot
                && w.panels.kind() == first.panels.kind()
                && w.row_scale.is_none()
                && !w.takes_f32(m)
        };
        if s > MAX_GROUP || !parts.iter().all(same) {
            return Err(GroupError::Mixed);
        }
        let sizes = (m.checked_mul(k * s), m.checked_mul(n));
        if sizes != (Some(x.len()), Some(y.len())) || Some(partials.len()) != m.checked_mul(n * s) {
            return Err(GroupError::Matrix(MatrixError::Io {
                m,
                x: x.len(),
                y: y.len(),
                k: k * s,
                n,
            }));
        }
        let mut outs = [Out {
            ptr: std::ptr::null_mut(),
            rows: 0,
        }; MAX_GROUP];
        for (o, p) in outs.iter_mut().zip(partials.chunks_exact_mut(m * n)) {
            *o = Out {
                ptr: p.as_mut_ptr(),
                rows: n,
            };
        }
        let dot = first.dot;
        SCRATCH.with(|sc| {
            let mut sc = sc.borrow_mut();
            let Scratch { xq, xs } = &mut *sc;
            quantiser(dot).quantize(x, act_format(first.panels.kind()), xq)?;
            xs.regroup_from(xq, s, first.panels.per());
            let ps: [&Panels; MAX_GROUP] = std::array::from_fn(|j| &parts[j.min(s - 1)].panels);
            let per_segment = m * first.panels.per();
            rows_times(
                &ps[..s],
                &outs[..s],
                (xs, per_segment),
                m,
                pool,
                threads,
                dot,
            );
            Ok::<(), GroupError>(())
        })?;
        p04_transformer::segments::fold_segments(partials, n, y);
        Ok(())
    }
}

/// [`QuantMatrix::matmul_int_segments`] behind Project 04's seam: None
/// (run them one by one) unless every segment is a matrix of this one's
/// format on the integer path.
pub(crate) fn apply_segments(
    first: &QuantMatrix,
    others: &[&dyn p04_transformer::proj::LinearWeights],
    x: &[f32],
    rows: usize,
    (partials, y): (&mut [f32], &mut [f32]),
    threads: usize,
) -> p04_transformer::proj::Unfused {
    if others.len() >= MAX_GROUP || !crate::matrix::fused_groups() {
        return None;
    }
    let mut parts = [first; MAX_GROUP];
    for (g, o) in parts[1..].iter_mut().zip(others) {
        *g = o.as_any().downcast_ref::<QuantMatrix>()?;
    }
    let parts = &parts[..=others.len()];
    match QuantMatrix::matmul_int_segments(parts, x, rows, partials, y, Pool::global(), threads) {
        Err(GroupError::Mixed) => None,
        Err(GroupError::Matrix(e)) => Some(Err(p04_transformer::error::ModelError::Weights {
            name: first.format_name().into(),
            source: Box::new(e),
        })),
        Ok(()) => {
            FUSED_SEGMENT_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some(Ok(()))
        }
    }
}

static FUSED_SEGMENT_CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Row-parallel products this process ran on the fused segments path
/// (the tests check that the path they compare is the one taken).
pub fn fused_segment_calls() -> u64 {
    FUSED_SEGMENT_CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The activations' 8-bit format a weight format's kernels read.
fn act_format(kind: Kind) -> ActFormat {
    match kind {
        Kind::Q4_1 => ActFormat::Q8_1,
        Kind::Q4_0 | Kind::Q8_0 => ActFormat::Q8_0,
    }
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

/// y_j[i, r] = dot(W_j[r], X[i]) for every row r of every matrix j and
/// every activation row i. The groups of 16 rows of all matrices are split
/// across threads as one range 0..Σ groups_j (so the split depends on the
/// matrices, never on m); each thread makes one tile-kernel call per
/// matrix over its groups and all of X (matrix j's X starts at block
/// j·x_step of `xq`: 0 for a group that reads one x, a segment's size for
/// row-parallel segments). (Chunks handed out as threads
/// come free balanced no better here and cost batch-1 decode ~20%.)
fn rows_times(
    ps: &[&Panels],
    outs: &[Out],
    (xq, x_step): (&QRow, usize),
    m: usize,
    pool: &Pool,
    threads: usize,
    dot: crate::Dot,
) {
    let total: usize = ps.iter().map(|p| p.groups()).sum();
    let body = |range: std::ops::Range<usize>| {
        let mut start = 0;
        for (j, (p, out)) in ps.iter().zip(outs).enumerate() {
            // This matrix's groups inside `range`, in its own numbering.
            let lo = range.start.max(start) - start;
            let hi = range.end.min(start + p.groups()).saturating_sub(start);
            start += p.groups();
            if lo >= hi {
                continue;
            }
            let (c0, c1) = (lo * GROUP, (hi * GROUP).min(out.rows));
            // SAFETY: y_j is (m, n_j), checked by `check_io`; this thread
            // writes columns c0..c1 of its m rows, which no other thread's
            // range covers, and y_j outlives `for_ranges`.
            let y = unsafe { OutRows::from_raw(out.ptr.add(c0), m, c1 - c0, out.rows) };
            let x0 = j * x_step;
            dot.tiles(p, lo..hi, xq.blocks(x0..x0 + m * p.per()), y);
        }
    };
    pool.for_ranges(total, threads, &body);
}

/// Per-thread buffer for the quantised activations (no allocation per
/// product once warm).
#[derive(Default)]
struct Scratch {
    xq: QRow,
    /// `xq` regrouped segment by segment (row-parallel segments).
    xs: QRow,
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
