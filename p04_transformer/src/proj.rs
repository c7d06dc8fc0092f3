//! The weight-format seam: every projection y = x Wᵀ of a forward pass goes
//! through [`Proj`], which holds its weights in some format behind
//! [`LinearWeights`]. Here: f32 packed once for p02's micro-kernel. Project
//! 10 adds GGUF's quantised blocks (Q4_1, Q8_0, ...) and int8; a GPU backend
//! would add device-resident weights. The forward does not know which it
//! calls.
//!
//! A loader picks the format per tensor ([`ProjLoader`]); [`F32Weights`]
//! picks f32 for all, which is what Projects 04–09 run.

use std::fmt;

use crate::error::ModelError;
use crate::model_file::GgufFile;
use crate::split::Keep;

/// Weights W (out, in) of a projection, in some format.
pub trait LinearWeights: Send + Sync + fmt::Debug {
    fn out_features(&self) -> usize;
    fn in_features(&self) -> usize;

    /// x (rows, in) -> y (rows, out), into a caller-owned buffer; `threads`
    /// is how many cores the product may use.
    fn apply_into(
        &self,
        x: &[f32],
        rows: usize,
        y: &mut [f32],
        threads: usize,
    ) -> Result<(), ModelError>;

    /// Bytes of weights one full product reads (what a decode step streams).
    fn weight_bytes(&self) -> usize;

    /// The format's name ("f32 packed", "Q4_1", ...).
    fn format(&self) -> &str;

    /// These weights as `Any`, so a format can recognise its own kind
    /// among the projections of a group ([`LinearWeights::apply_group`]).
    fn as_any(&self) -> &dyn std::any::Any;

    /// Several projections of the same x at once (q, k and v; gate and
    /// up): ys[0] = x·selfᵀ, ys[i] = x·others[i−1]ᵀ, each (rows, its out).
    /// One by one here; a format may fuse them (Project 10 quantises x once
    /// and splits all their rows across its threads in one dispatch).
    fn apply_group(
        &self,
        others: &[&dyn LinearWeights],
        x: &[f32],
        rows: usize,
        ys: &mut [&mut [f32]],
        threads: usize,
    ) -> Result<(), ModelError> {
        apply_each(self, others, x, rows, ys, threads)
    }

    /// A row-parallel projection in S column segments
    /// ([`crate::segments::Segmented`]), self segment 0 and `others` the
    /// rest: partials[j] (rows, out) = x_j · segment_jᵀ, x_j being columns
    /// j·in..(j+1)·in of x (rows, S·in), then y (rows, out) their fold in
    /// the all-reduce's order. None (the default): no fused path here, and
    /// the caller runs each segment on its own; a format may do all S in
    /// one dispatch (Project 10), giving the same bits.
    fn apply_segments(
        &self,
        _others: &[&dyn LinearWeights],
        _x: &[f32],
        _rows: usize,
        _partials: &mut [f32],
        _y: &mut [f32],
        _threads: usize,
    ) -> Unfused {
        None
    }
}

/// What [`LinearWeights::apply_segments`] returns when the format has no
/// fused path: the caller runs the segments one by one.
pub type Unfused = Option<Result<(), ModelError>>;

/// [`LinearWeights::apply_group`] one projection at a time.
pub fn apply_each<W: LinearWeights + ?Sized>(
    first: &W,
    others: &[&dyn LinearWeights],
    x: &[f32],
    rows: usize,
    ys: &mut [&mut [f32]],
    threads: usize,
) -> Result<(), ModelError> {
    if ys.len() != others.len() + 1 {
        return Err(group_error(ys.len(), others.len() + 1));
    }
    let (y0, rest) = ys.split_at_mut(1);
    first.apply_into(x, rows, y0[0], threads)?;
    for (w, y) in others.iter().zip(rest.iter_mut()) {
        w.apply_into(x, rows, y, threads)?;
    }
    Ok(())
}

/// The most projections [`Proj::apply_group`] hands a format at once
/// (more run one by one).
pub const MAX_GROUP: usize = 4;

/// A group of `want` projections was given `got` outputs.
pub fn group_error(got: usize, want: usize) -> ModelError {
    ModelError::Group { got, want }
}

/// f32 weights packed once at load for p02's micro-kernel (packing per call
/// would cost as much as the matmul itself when only a few dozen rows pass
/// through).
#[derive(Debug)]
pub struct PackedF32 {
    packed: p02_matmul_bench::PackedB,
}

impl LinearWeights for PackedF32 {
    fn out_features(&self) -> usize {
        self.packed.cols()
    }

    fn in_features(&self) -> usize {
        self.packed.rows()
    }

    fn apply_into(
        &self,
        x: &[f32],
        rows: usize,
        y: &mut [f32],
        threads: usize,
    ) -> Result<(), ModelError> {
        use p02_matmul_bench::{sgemm_prepacked, GemmOpts, MatMut, MatRef};
        let (k, n) = (self.packed.rows(), self.packed.cols());
        let a = MatRef::row_major(x, rows, k)?;
        sgemm_prepacked(
            a,
            &self.packed,
            &mut MatMut::row_major(y, rows, n)?,
            GemmOpts {
                threads,
                ..GemmOpts::default()
            },
        )?;
        Ok(())
    }

    fn weight_bytes(&self) -> usize {
        self.packed.rows() * self.packed.cols() * 4
    }

    fn format(&self) -> &str {
        "f32 packed"
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A projection y = x Wᵀ, W (out, in), in whatever format it was loaded.
#[derive(Debug)]
pub struct Proj {
    w: Box<dyn LinearWeights>,
}

impl Proj {
    /// f32 W (out, in), packed.
    pub fn new(w: &[f32], out_f: usize, in_f: usize) -> Result<Proj, ModelError> {
        Ok(Proj {
            w: Box::new(PackedF32 {
                packed: p02_matmul_bench::PackedB::linear_weight(w, out_f, in_f)?,
            }),
        })
    }

    /// Weights in another format (Project 10's quantised blocks, ...).
    pub fn from_weights(w: Box<dyn LinearWeights>) -> Proj {
        Proj { w }
    }

    pub fn weights(&self) -> &dyn LinearWeights {
        &*self.w
    }

    /// The weights themselves, to wrap (Project 13 wraps a row-parallel
    /// projection in the all-reduce that completes its partial sums).
    pub fn into_weights(self) -> Box<dyn LinearWeights> {
        self.w
    }

    pub fn out_features(&self) -> usize {
        self.w.out_features()
    }

    pub fn in_features(&self) -> usize {
        self.w.in_features()
    }

    /// x (rows, in) -> (rows, out).
    pub fn apply(&self, x: &[f32], rows: usize, threads: usize) -> Result<Vec<f32>, ModelError> {
        let mut y = vec![0.0f32; rows * self.out_features()];
        self.apply_into(x, rows, &mut y, threads)?;
        Ok(y)
    }

    /// The same x through several projections (q, k, v; gate, up):
    /// ys[i] = x·projs[i]ᵀ, fused where the format can
    /// ([`LinearWeights::apply_group`]).
    pub fn apply_group(
        projs: &[&Proj],
        x: &[f32],
        rows: usize,
        ys: &mut [&mut [f32]],
        threads: usize,
    ) -> Result<(), ModelError> {
        let Some((first, rest)) = projs.split_first() else {
            return Err(group_error(ys.len(), 0));
        };
        if rest.len() >= MAX_GROUP {
            if ys.len() != projs.len() {
                return Err(group_error(ys.len(), projs.len()));
            }
            for (p, y) in projs.iter().zip(ys.iter_mut()) {
                p.apply_into(x, rows, y, threads)?;
            }
            return Ok(());
        }
        // On the stack: a decode step allocates nothing.
        let mut others = [first.weights(); MAX_GROUP - 1];
        for (o, p) in others.iter_mut().zip(rest) {
            *o = p.weights();
        }
        first
            .w
            .apply_group(&others[..rest.len()], x, rows, ys, threads)
    }

    /// x (rows, in) -> y (rows, out), into a caller-owned buffer (no
    /// allocation once the format's buffers are warm, on one thread).
    pub fn apply_into(
        &self,
        x: &[f32],
        rows: usize,
        y: &mut [f32],
        threads: usize,
    ) -> Result<(), ModelError> {
        self.w.apply_into(x, rows, y, threads)
    }
}

/// Chooses the format of each projection a GGUF loader reads.
pub trait ProjLoader {
    /// Tensor `name`, stored as W (`shape` = [out, in]), in this loader's
    /// format, or None for the f32 default: only the part `keep` names
    /// (its rows, in the order given, each mapped to the file's row: GGUF
    /// permutes Q and K rows; and its columns), of shape `keep.shape()`.
    fn load(
        &self,
        f: &GgufFile,
        name: &str,
        shape: [usize; 2],
        keep: &Keep,
    ) -> Result<Option<Proj>, ModelError>;
}

/// Every projection in f32 (Projects 04–09).
#[derive(Clone, Copy, Debug, Default)]
pub struct F32Weights;

impl ProjLoader for F32Weights {
    fn load(
        &self,
        _: &GgufFile,
        _: &str,
        _: [usize; 2],
        _: &Keep,
    ) -> Result<Option<Proj>, ModelError> {
        Ok(None)
    }
}
