//! A weight matrix kept in its quantised blocks, as Project 04's
//! [`LinearWeights`]: y = x Wᵀ with the activations quantised per row to
//! 8 bits (Q8_1 for Q4_1 weights, Q8_0 otherwise, as llama.cpp does) and
//! integer dot products per block.
//!
//! ```text
//! apply(x (m, k), y (m, n)):
//!   xq = quantize each row of x           (m, k/32) blocks
//!   for each weight row r (split across the pool's threads):
//!     for each tile of 64 activation rows i:   (the weight row stays in L1)
//!       y[i, r] = dot(W[r], xq[i])
//! ```
//!
//! One loop for decode (m = 1: a GEMV, bound by the bytes of W) and for
//! prefill (m ≫ 1: each weight row is read once and used m times).

use std::cell::RefCell;

use p04_transformer::{GgmlType, LinearWeights, ModelError};

use crate::dot::Dot;
use crate::formats::{
    quantize_row_into, read_blocks, Block, BlockQ4_0, BlockQ4_1, BlockQ8_0, FormatError, QK,
};
use crate::panel::Panels;
use crate::pool::Pool;

/// The weights' blocks, row-major: row r is blocks r·(k/32)..(r+1)·(k/32).
#[derive(Clone, Debug, PartialEq)]
pub enum Blocks {
    Q4_1(Vec<BlockQ4_1>),
    Q4_0(Vec<BlockQ4_0>),
    Q8_0(Vec<BlockQ8_0>),
}

impl Blocks {
    fn len(&self) -> usize {
        match self {
            Blocks::Q4_1(b) => b.len(),
            Blocks::Q4_0(b) => b.len(),
            Blocks::Q8_0(b) => b.len(),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Blocks::Q4_1(_) => BlockQ4_1::NAME,
            Blocks::Q4_0(_) => BlockQ4_0::NAME,
            Blocks::Q8_0(_) => BlockQ8_0::NAME,
        }
    }

    fn block_bytes(&self) -> usize {
        match self {
            Blocks::Q4_1(_) => BlockQ4_1::BYTES,
            Blocks::Q4_0(_) => BlockQ4_0::BYTES,
            Blocks::Q8_0(_) => BlockQ8_0::BYTES,
        }
    }
}

/// A slice of one format's blocks.
#[derive(Clone, Copy, Debug)]
pub enum BlocksRef<'a> {
    Q4_1(&'a [BlockQ4_1]),
    Q4_0(&'a [BlockQ4_0]),
    Q8_0(&'a [BlockQ8_0]),
}

impl Blocks {
    /// Blocks `range` (of rows' blocks).
    pub fn slice(&self, range: std::ops::Range<usize>) -> BlocksRef<'_> {
        match self {
            Blocks::Q4_1(b) => BlocksRef::Q4_1(&b[range]),
            Blocks::Q4_0(b) => BlocksRef::Q4_0(&b[range]),
            Blocks::Q8_0(b) => BlocksRef::Q8_0(&b[range]),
        }
    }
}

/// Formats a matrix can be made in from f32 weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Q4_1,
    Q4_0,
    Q8_0,
    /// int8 per output channel: one f32 scale per row (amax / 127), no
    /// per-block scales. Held as Q8_0 blocks whose scale is 1, so the Q8_0
    /// kernels run it and the row's scale multiplies each output.
    I8Channel,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Q4_1 => BlockQ4_1::NAME,
            Format::Q4_0 => BlockQ4_0::NAME,
            Format::Q8_0 => BlockQ8_0::NAME,
            Format::I8Channel => "I8 per channel",
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MatrixError {
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("{rows} x {cols} weights need {need} blocks, got {got}")]
    Size {
        rows: usize,
        cols: usize,
        need: usize,
        got: usize,
    },
    #[error("GGML type {0:?} has no native kernels (Q4_0, Q4_1, Q8_0 do)")]
    Type(GgmlType),
    #[error("row permutation of length {got} for {rows} rows, or a source row out of range")]
    Permutation { rows: usize, got: usize },
    #[error("columns {start}..{end} of a matrix {cols} wide: a part must lie inside it, on {QK}-wide block boundaries")]
    Columns {
        start: usize,
        end: usize,
        cols: usize,
    },
    #[error("f32 product: {0}")]
    Gemm(#[from] p02_matmul_bench::GemmError),
    #[error("x has {x} values and y {y}; {m} rows need {} and {}", m * k, m * n)]
    Io {
        m: usize,
        x: usize,
        y: usize,
        k: usize,
        n: usize,
    },
}

/// W (rows = out features, cols = in features) in blocks.
#[derive(Debug)]
pub struct QuantMatrix {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) blocks: Blocks,
    /// The same rows repacked 16 side by side for the integer kernels.
    pub(crate) panels: Panels,
    pub(crate) dot: Dot,
    /// Products of this many rows or more take the f32 path.
    pub(crate) f32_rows: usize,
    /// int8 per channel: row r's outputs times `row_scale[r]`.
    pub(crate) row_scale: Option<Vec<f32>>,
}

impl QuantMatrix {
    /// From blocks (checked against the shape). `cols` must be a multiple of 32.
    pub fn new(rows: usize, cols: usize, blocks: Blocks, dot: Dot) -> Result<Self, MatrixError> {
        if !cols.is_multiple_of(QK) {
            return Err(FormatError::Ragged { len: cols }.into());
        }
        let need = rows
            .checked_mul(cols / QK)
            .ok_or(MatrixError::Permutation { rows, got: 0 })?;
        if blocks.len() != need {
            return Err(MatrixError::Size {
                rows,
                cols,
                need,
                got: blocks.len(),
            });
        }
        Ok(QuantMatrix {
            rows,
            cols,
            panels: panels_of(&blocks, rows, cols / QK),
            blocks,
            dot,
            f32_rows: usize::MAX,
            row_scale: None,
        })
    }

    /// From a GGUF tensor's bytes (type `ty`, shape (rows, cols)).
    pub fn from_gguf(
        ty: GgmlType,
        bytes: &[u8],
        rows: usize,
        cols: usize,
        dot: Dot,
    ) -> Result<Self, MatrixError> {
        let blocks = match ty {
            GgmlType::Q4_1 => Blocks::Q4_1(read_blocks(bytes)?),
            GgmlType::Q4_0 => Blocks::Q4_0(read_blocks(bytes)?),
            GgmlType::Q8_0 => Blocks::Q8_0(read_blocks(bytes)?),
            other => return Err(MatrixError::Type(other)),
        };
        QuantMatrix::new(rows, cols, blocks, dot)
    }

    /// Quantise f32 W (rows, cols) with this crate's quantisers.
    pub fn quantize(
        w: &[f32],
        rows: usize,
        cols: usize,
        format: Format,
        dot: Dot,
    ) -> Result<Self, MatrixError> {
        if w.len() != rows * cols {
            return Err(MatrixError::Size {
                rows,
                cols,
                need: rows * cols,
                got: w.len(),
            });
        }
        fn q<B: Block>(w: &[f32]) -> Result<Vec<B>, FormatError> {
            let mut out = Vec::new();
            quantize_row_into(w, &mut out)?;
            Ok(out)
        }
        if cols == 0 || !cols.is_multiple_of(QK) {
            return Err(FormatError::Ragged { len: cols }.into());
        }
        let blocks = match format {
            Format::Q4_1 => Blocks::Q4_1(q(w)?),
            Format::Q4_0 => Blocks::Q4_0(q(w)?),
            Format::Q8_0 => Blocks::Q8_0(q(w)?),
            Format::I8Channel => {
                let (blocks, scale) = quantize_i8_channel(w, cols);
                let m = QuantMatrix::new(rows, cols, Blocks::Q8_0(blocks), dot)?;
                return Ok(QuantMatrix {
                    row_scale: Some(scale),
                    ..m
                });
            }
        };
        QuantMatrix::new(rows, cols, blocks, dot)
    }

    /// The format's name ("Q4_1", ..., "I8 per channel").
    pub fn format_name(&self) -> &'static str {
        match self.row_scale {
            Some(_) => Format::I8Channel.name(),
            None => self.blocks.name(),
        }
    }

    /// Multiply each output row r of `y` (m, rows) by its channel's scale.
    pub(crate) fn scale_outputs(&self, y: &mut [f32]) {
        if let Some(s) = self.row_scale.as_ref().filter(|_| self.rows > 0) {
            for row in y.chunks_exact_mut(self.rows) {
                row.iter_mut().zip(s).for_each(|(v, s)| *v *= s);
            }
        }
    }

    /// Reorder rows: row r of the result is row `source[r]` of `self`.
    pub fn permute_rows(self, source: &[usize]) -> Result<Self, MatrixError> {
        if source.len() != self.rows {
            return Err(MatrixError::Permutation {
                rows: self.rows,
                got: source.len(),
            });
        }
        let cols = self.cols;
        self.select(Some(source), 0..cols)
    }

    /// Take the f32 path from `rows` rows on (`usize::MAX`: never, so
    /// every position meets 8-bit activations, as the accuracy studies
    /// measure).
    pub fn with_f32_rows(self, rows: usize) -> Self {
        QuantMatrix {
            f32_rows: rows,
            ..self
        }
    }

    /// int8 per channel: each row's scale (the blocks' own scales are 1).
    pub fn row_scale(&self) -> Option<&[f32]> {
        self.row_scale.as_deref()
    }

    pub fn blocks(&self) -> &Blocks {
        &self.blocks
    }

    pub fn dot(&self) -> Dot {
        self.dot
    }

    /// The f32 weights these blocks stand for (rows, cols): the reference
    /// the integer path is compared with.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        // Sizes checked at construction.
        let _ = match &self.blocks {
            Blocks::Q4_1(b) => crate::formats::dequantize_row(b, &mut out),
            Blocks::Q4_0(b) => crate::formats::dequantize_row(b, &mut out),
            Blocks::Q8_0(b) => crate::formats::dequantize_row(b, &mut out),
        };
        if let Some(s) = &self.row_scale {
            for (row, s) in out.chunks_exact_mut(self.cols).zip(s) {
                row.iter_mut().for_each(|v| *v *= s);
            }
        }
        out
    }

    /// y (m, rows) = x (m, cols) · Wᵀ on `threads` of `pool`'s
    /// participants: the integer path for few rows (decode), the f32 one
    /// for many (prefill; see [`F32_GEMM_ROWS`]).
    pub fn matmul(
        &self,
        x: &[f32],
        m: usize,
        y: &mut [f32],
        pool: &Pool,
        threads: usize,
    ) -> Result<(), MatrixError> {
        if self.takes_f32(m) {
            self.matmul_f32(x, m, y, threads)
        } else {
            self.matmul_int(x, m, y, pool, threads)
        }
    }

    /// Whether a product of `m` rows takes the f32 path.
    pub fn takes_f32(&self, m: usize) -> bool {
        m >= self.f32_rows && self.rows * self.cols <= F32_GEMM_MAX_WEIGHTS
    }

    /// Expand W into f32 and run Project 02's sgemm: each weight is
    /// expanded once and used m times, at f32 GEMM speed. By default the
    /// expansion happens inside p02's blocked loop, one (K block, sliver)
    /// at a time into the cache-resident panel ([`PanelExpansion::InLoop`]).
    pub fn matmul_f32(
        &self,
        x: &[f32],
        m: usize,
        y: &mut [f32],
        threads: usize,
    ) -> Result<(), MatrixError> {
        self.matmul_f32_with(x, m, y, threads, panel_expansion())
    }

    /// [`QuantMatrix::matmul_f32`] with the expansion named.
    pub fn matmul_f32_with(
        &self,
        x: &[f32],
        m: usize,
        y: &mut [f32],
        threads: usize,
        how: PanelExpansion,
    ) -> Result<(), MatrixError> {
        let (n, k) = self.check_io(x, m, y)?;
        let gemm = MatrixError::Gemm;
        let opts = p02_matmul_bench::GemmOpts {
            threads,
            ..Default::default()
        };
        let a = p02_matmul_bench::MatRef::row_major(x, m, k).map_err(gemm)?;
        let mut c = p02_matmul_bench::MatMut::row_major(y, m, n).map_err(gemm)?;
        if let (PanelExpansion::InLoop, Blocks::Q4_1(w), None) =
            (how, &self.blocks, &self.row_scale)
        {
            if self.dot.expands_slivers() {
                // Straight into the packed sliver: no row-major scratch, no
                // transpose.
                let per = k / QK;
                let produce =
                    |j0: usize, count: usize, p0: usize, kc: usize, nr: usize, dst: &mut [f32]| {
                        self.dot
                            .expand_sliver_q4_1(w, per, j0, count, p0 / QK, kc / QK, nr, dst)
                    };
                return p02_matmul_bench::sgemm_weight_slivers(a, n, QK, &produce, &mut c, opts)
                    .map_err(gemm);
            }
        }
        if how != PanelExpansion::Prepacked {
            // W[j0..j0 + count, p0..p0 + kc]: p0 and kc are whole blocks.
            let produce = |j0: usize, count: usize, p0: usize, kc: usize, out: &mut [f32]| {
                self.expand_rows(j0, count, p0 / QK, kc, out)
            };
            return p02_matmul_bench::sgemm_weight_rows(a, n, QK, &produce, &mut c, opts)
                .map_err(gemm);
        }
        // Each weight row expanded once, straight into p02's packed panels.
        let buf = PACKED.with(|b| b.take());
        let packed =
            p02_matmul_bench::PackedB::from_weight_rows_in(buf, n, k, threads, |j0, count, buf| {
                self.expand_rows(j0, count, 0, k, buf)
            });
        let r = p02_matmul_bench::sgemm_prepacked(a, &packed, &mut c, opts);
        PACKED.with(|b| b.replace(packed.into_buf()));
        r.map_err(gemm)
    }

    /// W[j0..j0 + count, 32·b0..32·b0 + kc] in f32 into `out` (count rows of
    /// kc, row-major): the blocks expanded, then int8-per-channel rows
    /// scaled. Both prefill expansions produce their rows through this.
    fn expand_rows(&self, j0: usize, count: usize, b0: usize, kc: usize, out: &mut [f32]) {
        let (per, nb) = (self.cols / QK, kc / QK);
        for (r, row) in out.chunks_exact_mut(kc).take(count).enumerate() {
            let first = (j0 + r) * per + b0;
            self.dot.expand(&self.blocks.slice(first..first + nb), row);
            if let Some(s) = &self.row_scale {
                let s = s[j0 + r];
                row.iter_mut().for_each(|v| *v *= s);
            }
        }
    }

    /// (n, k) once x is (m, k) and y is (m, n).
    pub(crate) fn check_io(
        &self,
        x: &[f32],
        m: usize,
        y: &[f32],
    ) -> Result<(usize, usize), MatrixError> {
        let (n, k) = (self.rows, self.cols);
        if Some(x.len()) != m.checked_mul(k) || Some(y.len()) != m.checked_mul(n) {
            return Err(MatrixError::Io {
                m,
                x: x.len(),
                y: y.len(),
                k,
                n,
            });
        }
        Ok((n, k))
    }
}

/// `blocks` (rows of `per`) as panels.
pub(crate) fn panels_of(blocks: &Blocks, rows: usize, per: usize) -> Panels {
    match blocks {
        Blocks::Q4_1(b) => Panels::from_q4_1(b, rows, per),
        Blocks::Q4_0(b) => Panels::from_q4_0(b, rows, per),
        Blocks::Q8_0(b) => Panels::from_q8_0(b, rows, per),
    }
}

thread_local! {
    /// The prefill path's packing buffer, kept between products.
    static PACKED: RefCell<p02_matmul_bench::AlignedBuf> = RefCell::new(Default::default());
}

/// Products of at least this many rows dequantise W and run f32 sgemm:
/// expanding a weight costs about as much as 16 integer multiply-adds with
/// it, and the f32 kernel is the faster one per multiply-add (see the
/// README's measurements).
pub const F32_GEMM_ROWS: usize = 16;

/// Larger matrices (the 49,152-row head: 113 MB in f32) always take the
/// integer path: expanding them would cost more memory than it saves time.
pub const F32_GEMM_MAX_WEIGHTS: usize = 8 << 20;

impl LinearWeights for QuantMatrix {
    fn out_features(&self) -> usize {
        self.rows
    }

    fn in_features(&self) -> usize {
        self.cols
    }

    fn apply_into(
        &self,
        x: &[f32],
        rows: usize,
        y: &mut [f32],
        threads: usize,
    ) -> Result<(), ModelError> {
        self.matmul(x, rows, y, Pool::global(), threads)
            .map_err(|e| ModelError::Weights {
                name: self.format_name().into(),
                source: Box::new(e),
            })
    }

    fn weight_bytes(&self) -> usize {
        self.blocks.len() * self.blocks.block_bytes()
            + self.row_scale.as_ref().map_or(0, |s| s.len() * 4)
    }

    fn format(&self) -> &str {
        self.format_name()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    /// Row-parallel segments: one quantisation and one dispatch for all S
    /// when every segment is a matrix of one format on the integer path.
    fn apply_segments(
        &self,
        others: &[&dyn LinearWeights],
        x: &[f32],
        rows: usize,
        partials: &mut [f32],
        y: &mut [f32],
        threads: usize,
    ) -> p04_transformer::proj::Unfused {
        crate::int_path::apply_segments(self, others, x, rows, (partials, y), threads)
    }

    /// q/k/v or gate/up of one token: one activation quantisation and one
    /// dispatch for all of them when they are matrices of one format on
    /// the integer path; one by one otherwise.
    fn apply_group(
        &self,
        others: &[&dyn LinearWeights],
        x: &[f32],
        rows: usize,
        ys: &mut [&mut [f32]],
        threads: usize,
    ) -> Result<(), ModelError> {
        use p04_transformer::proj::{apply_each, MAX_GROUP};
        // On the stack: a decode step allocates nothing.
        let mut group = [self; MAX_GROUP];
        if others.len() >= MAX_GROUP || self.takes_f32(rows) || !fused_groups() {
            return apply_each(self, others, x, rows, ys, threads);
        }
        for (g, o) in group[1..].iter_mut().zip(others) {
            match o.as_any().downcast_ref::<QuantMatrix>() {
                Some(m) if !m.takes_f32(rows) => *g = m,
                _ => return apply_each(self, others, x, rows, ys, threads),
            }
        }
        let group = &group[..=others.len()];
        match QuantMatrix::matmul_int_group(group, x, rows, ys, Pool::global(), threads) {
            Err(crate::int_path::GroupError::Mixed) => {
                apply_each(self, others, x, rows, ys, threads)
            }
            Err(crate::int_path::GroupError::Matrix(e)) => Err(ModelError::Weights {
                name: self.format_name().into(),
                source: Box::new(e),
            }),
            Ok(()) => Ok(()),
        }
    }
}

static FUSED_GROUPS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Run q/k/v and gate/up as fused groups (the default) or one by one, for
/// before/after measurements (`examples/decode_ab.rs`).
pub fn set_fused_groups(on: bool) {
    FUSED_GROUPS.store(on, std::sync::atomic::Ordering::Relaxed);
}

pub(crate) fn fused_groups() -> bool {
    FUSED_GROUPS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Where the prefill path expands W into p02's packed f32 panels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PanelExpansion {
    /// One (K block, sliver) at a time inside p02's blocked loop, into the
    /// panel the micro-kernel then reads from cache (the default): straight
    /// into the packed layout where the kernel path can
    /// ([`Dot::expands_slivers`], Q4_1), else as [`PanelExpansion::InLoopRows`].
    InLoop,
    /// In the loop, as rows into a scratch that p02 then transposes.
    InLoopRows,
    /// All of W first, into a whole packed copy (f32, 4 bytes a weight) that
    /// the GEMM then streams back from memory.
    Prepacked,
}

static EXPANSION: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Choose the prefill path's expansion, for side-by-side measurements
/// (`examples/prefill_ab.rs`).
pub fn set_panel_expansion(how: PanelExpansion) {
    EXPANSION.store(how as u8, std::sync::atomic::Ordering::Relaxed);
}

pub fn panel_expansion() -> PanelExpansion {
    match EXPANSION.load(std::sync::atomic::Ordering::Relaxed) {
        1 => PanelExpansion::InLoopRows,
        2 => PanelExpansion::Prepacked,
        _ => PanelExpansion::InLoop,
    }
}

/// f16 1.0: the block scale of int8-per-channel rows held as Q8_0.
const F16_ONE: u16 = 0x3c00;

/// Symmetric int8 per output channel: row r's scale is max|W[r]| / 127 and
/// q = round(w / scale) (0 for an all-zero row). Returns the rows as Q8_0
/// blocks of scale 1, and the scales.
pub fn quantize_i8_channel(w: &[f32], cols: usize) -> (Vec<BlockQ8_0>, Vec<f32>) {
    let mut blocks = Vec::with_capacity(w.len() / QK);
    let mut scales = Vec::with_capacity(w.len() / cols.max(1));
    for row in w.chunks_exact(cols) {
        let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        scales.push(scale);
        for chunk in row.chunks_exact(QK) {
            let mut b = BlockQ8_0 {
                d: F16_ONE,
                ..Default::default()
            };
            for (q, &v) in b.qs.iter_mut().zip(chunk) {
                *q = (v * inv).round().clamp(-127.0, 127.0) as i8;
            }
            blocks.push(b);
        }
    }
    (blocks, scales)
}
