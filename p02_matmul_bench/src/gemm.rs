//! The packed GEMM driver (BLIS's loops around the micro-kernel) and the
//! public [`sgemm`] every later crate calls.
//!
//! ```text
//! split C into one region per thread (rows, or columns when N is the larger side)
//! per thread:
//!   for jc in N by nc:              B panel (kc x nc) -> L3
//!     for pc in K by kc:            pack B[pc.., jc..] into nr-wide slivers (or use PackedB)
//!       for ic in M by mc:          pack A[ic.., pc..] into mr-tall slivers (row-major A: read in place)
//!         for jr in nc by nr:       one B sliver (kc x nr) stays in L1
//!           for ir in mc by mr:     micro-kernel: C[mr x nr] += A sliver . B sliver (registers)
//! ```
//! One fork-join per call: on this VM a wake-up of a sleeping pool thread
//! costs tens of microseconds, so splitting inside the K loop (a join per K
//! block) cost more than it saved at N <= 1024.

use std::cell::RefCell;

use rayon::prelude::*;

use crate::gemv;
use crate::kernels::MicroKernel;
use crate::mat::{MatMut, MatRef};
use crate::pack::{pack_a, pack_b};
use crate::GemmError;

struct SendPtr(*mut f32);
// SAFETY: shared only to let tasks write disjoint tiles of C.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// A method (not field access) so closures capture the Sync wrapper.
    fn get(&self) -> *mut f32 {
        self.0
    }
}

/// A packing buffer aligned to a cache line, so no vector load of a packed
/// sliver straddles two lines.
#[derive(Debug, Default)]
pub struct AlignedBuf {
    lines: Vec<Line>,
}

#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct Line([f32; 16]);

impl AlignedBuf {
    /// Floats held.
    pub fn len(&self) -> usize {
        self.lines.len() * 16
    }

    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    pub fn as_slice(&self) -> &[f32] {
        // SAFETY: as in `get`: contiguous initialised f32s.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len()) }
    }

    /// At least `n` floats, 64-byte aligned (contents unspecified).
    pub fn get(&mut self, n: usize) -> &mut [f32] {
        let lines = n.div_ceil(16);
        if self.lines.len() < lines {
            self.lines.resize(lines, Line([0.0; 16]));
        }
        // SAFETY: Line is repr(C) [f32; 16] with no padding, so `lines` lines
        // are 16 * lines contiguous, initialised f32s.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), n) }
    }
}

thread_local! {
    /// Per-thread packed-A buffer, reused across calls (an mc x kc block is
    /// ~150 KB: allocating it per block would page-fault every time).
    static A_PACK: RefCell<AlignedBuf> = RefCell::new(AlignedBuf::default());
    /// Packed-B panel of the calling thread, reused across calls.
    static B_PACK: RefCell<AlignedBuf> = RefCell::new(AlignedBuf::default());
}

/// Below this many multiply-adds a call stays on the calling thread (waking a
/// pool thread costs tens of microseconds on this VM; see p01's README).
pub const PAR_MIN_MACS: usize = 1 << 22;

/// The same for M = 1 (weights streamed once): 256K multiply-adds = 1 MB of f32 weights.
pub const PAR_MIN_MACS_M1: usize = 1 << 18;

/// Split 0..len into blocks of at most `max` (a multiple of `unit`), all about
/// equal: K = 784 with kc = 256 gives 4 x 196, not 3 x 256 + 16 (a 16-deep
/// block pays the C load/store of a full block for 1/16 of the work).
pub fn blocks(len: usize, max: usize, unit: usize) -> impl Iterator<Item = (usize, usize)> {
    let n = len.div_ceil(max.max(1)).max(1);
    let size = len.div_ceil(n).div_ceil(unit) * unit;
    (0..len)
        .step_by(size.max(1))
        .map(move |start| (start, size.min(len - start)))
}

/// Where the micro-kernel's B slivers come from.
#[derive(Clone, Copy)]
pub(crate) enum BSrc<'a> {
    /// Pack from a strided view on every call.
    Pack(&'a MatRef<'a>),
    /// Already packed once (weights), see [`PackedB`].
    Packed(&'a PackedB),
    /// Expanded per (K block, sliver) from a weight stored in another
    /// format, see [`crate::weight_rows`].
    Rows(&'a crate::weight_rows::WeightRows<'a>),
}

/// B packed once for a kernel: every (N panel, K block) in the order the
/// driver visits them. Weights are packed at load, so a call with few rows
/// (batched decode) does not re-pack K x N floats to do M x K x N work.
#[derive(Debug)]
pub struct PackedB {
    k: usize,
    n: usize,
    kernel: MicroKernel,
    buf: AlignedBuf,
    /// Start of panel (jc index, pc index), jc-major.
    offsets: Vec<usize>,
}

impl PackedB {
    /// Pack all of `b` (K, N) for `kernel`.
    pub fn new(b: MatRef, kernel: MicroKernel) -> PackedB {
        let (k, n) = (b.rows, b.cols);
        let (nr, kc, nc) = (kernel.nr, kernel.kc, kernel.nc);
        let mut offsets = Vec::new();
        let mut total = 0;
        for jc in (0..n).step_by(nc) {
            for (_, kcb) in blocks(k, kc, 1) {
                offsets.push(total);
                total += (nc.min(n - jc)).div_ceil(nr) * kcb * nr;
            }
        }
        let mut buf = AlignedBuf::default();
        let data = buf.get(total);
        let mut i = 0;
        for jc in (0..n).step_by(nc) {
            let ncb = nc.min(n - jc);
            for (pc, kcb) in blocks(k, kc, 1) {
                pack_b(
                    &b,
                    pc,
                    kcb,
                    jc,
                    ncb,
                    nr,
                    0..ncb.div_ceil(nr),
                    &mut data[offsets[i]..],
                );
                i += 1;
            }
        }
        PackedB {
            k,
            n,
            kernel,
            buf,
            offsets,
        }
    }

    /// Pack a PyTorch weight W (out, in), used as B = W^T (K = in, N = out).
    pub fn linear_weight(w: &[f32], out_f: usize, in_f: usize) -> Result<PackedB, GemmError> {
        if Some(w.len()) != out_f.checked_mul(in_f) {
            return Err(GemmError::Buffer {
                what: "linear weight",
                rows: out_f,
                cols: in_f,
                needed: out_f.checked_mul(in_f),
                len: w.len(),
            });
        }
        Ok(PackedB::new(
            MatRef::row_major(w, out_f, in_f)?.t(),
            MicroKernel::best(),
        ))
    }

    /// Pack W (out_f, in_f), used as B = Wᵀ, from a producer of its rows:
    /// `rows(j0, count, buf)` writes W's rows j0..j0 + count (row-major,
    /// `count` ≤ the kernel's NR) into `buf`, every value of it (the buffer
    /// is reused between slivers). A weight stored in another
    /// format (Project 10's quantised blocks) expands each row once,
    /// straight into the packed layout, with no f32 copy of W in between;
    /// slivers are filled on up to `threads` threads.
    pub fn from_weight_rows(
        out_f: usize,
        in_f: usize,
        threads: usize,
        rows: impl Fn(usize, usize, &mut [f32]) + Sync,
    ) -> PackedB {
        PackedB::from_weight_rows_in(AlignedBuf::default(), out_f, in_f, threads, rows)
    }

    /// [`PackedB::from_weight_rows`] into a recycled buffer (see
    /// [`PackedB::into_buf`]): a product that packs per call then faults in
    /// no fresh pages.
    pub fn from_weight_rows_in(
        mut buf: AlignedBuf,
        out_f: usize,
        in_f: usize,
        threads: usize,
        rows: impl Fn(usize, usize, &mut [f32]) + Sync,
    ) -> PackedB {
        let kernel = MicroKernel::best();
        let (k, n) = (in_f, out_f);
        let (nr, kc, nc) = (kernel.nr, kernel.kc, kernel.nc);
        debug_assert_eq!(nc % nr, 0, "panels hold whole slivers");
        let pcs: Vec<(usize, usize)> = blocks(k, kc, 1).collect();
        let mut offsets = Vec::new();
        let mut total = 0;
        for jc in (0..n).step_by(nc) {
            for &(_, kcb) in &pcs {
                offsets.push(total);
                total += (nc.min(n - jc)).div_ceil(nr) * kcb * nr;
            }
        }
        let data = SendPtr(buf.get(total).as_mut_ptr());
        // One sliver: NR weight rows, written into every K block's panel
        // (columns past N stay zero, as `pack_b` leaves them).
        let fill = |sliver: usize, w: &mut Vec<f32>| {
            let j0 = sliver * nr;
            let count = nr.min(n - j0);
            // Rows past N stay zero; the others are overwritten by `rows`.
            w.resize(nr * k, 0.0);
            w[count * k..].fill(0.0);
            rows(j0, count, &mut w[..count * k]);
            let (jci, s) = (j0 / nc, (j0 % nc) / nr);
            for (pci, &(pc, kcb)) in pcs.iter().enumerate() {
                let base = offsets[jci * pcs.len() + pci] + s * kcb * nr;
                // SAFETY: `base..base + kcb * nr` is this sliver's part of
                // panel (jci, pci), inside the `total` floats allocated; no
                // other sliver writes it, and `buf` outlives the threads.
                let dst = unsafe { std::slice::from_raw_parts_mut(data.get().add(base), kcb * nr) };
                crate::pack::transpose_sliver(w, k, pc, kcb, nr, dst);
            }
        };
        let slivers: Vec<usize> = (0..n.div_ceil(nc))
            .flat_map(|jci| {
                let first = jci * nc / nr;
                first..first + (nc.min(n - jci * nc)).div_ceil(nr)
            })
            .collect();
        let parts = threads.clamp(1, slivers.len().max(1));
        if parts == 1 {
            let mut w = Vec::new();
            slivers.iter().for_each(|&s| fill(s, &mut w));
        } else {
            let chunk = slivers.len().div_ceil(parts);
            slivers.par_chunks(chunk).for_each(|c| {
                let mut w = Vec::new();
                c.iter().for_each(|&s| fill(s, &mut w));
            });
        }
        PackedB {
            k,
            n,
            kernel,
            buf,
            offsets,
        }
    }

    /// The packing buffer, to reuse.
    pub fn into_buf(self) -> AlignedBuf {
        self.buf
    }

    pub fn rows(&self) -> usize {
        self.k
    }

    pub fn cols(&self) -> usize {
        self.n
    }

    /// Packed panel (jc index, pc index).
    fn panel_at(&self, jci: usize, pci: usize) -> &[f32] {
        let n_pc = blocks(self.k, self.kernel.kc, 1).count();
        let i = jci * n_pc + pci;
        let end = self.offsets.get(i + 1).copied().unwrap_or(self.buf.len());
        &self.buf.as_slice()[self.offsets[i]..end]
    }
}

/// C = alpha * A * B + beta * C through packing and `kernel` (never the
/// GEMV path), on up to `threads` threads: the packed path alone, for
/// comparisons. Shapes are checked as in [`sgemm`]; a kernel this CPU cannot
/// run is replaced by the best one it can.
pub fn gemm_packed(
    alpha: f32,
    a: MatRef,
    b: MatRef,
    beta: f32,
    c: &mut MatMut,
    kernel: MicroKernel,
    threads: usize,
) -> Result<(), GemmError> {
    check_args(&a, (b.rows, b.cols), c, None)?;
    let kernel = if kernel.supported() {
        kernel
    } else {
        MicroKernel::best()
    };
    gemm_dispatch(alpha, &a, BSrc::Pack(&b), b.cols, beta, c, kernel, threads);
    Ok(())
}

/// Split C into one region per thread, each computed by [`gemm_part`] on its
/// own thread: one fork-join per call (a fork-join per K block costs a
/// wake-up each on this VM).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_dispatch(
    alpha: f32,
    a: &MatRef,
    b: BSrc,
    n: usize,
    beta: f32,
    c: &mut MatMut,
    kernel: MicroKernel,
    threads: usize,
) {
    let (m, k) = (a.rows, a.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 || alpha == 0.0 {
        scale_c(c, beta);
        return;
    }
    let (mr, nr) = (kernel.mr, kernel.nr);
    // A single row is one pass over the weights: worth splitting from ~1 MB
    // of weights on (the wake-up then costs less than the streaming it halves).
    // So are fewer than 2 mr rows (a small batch's decode step: one or two
    // tile rows stream the weights once), judged by the weights' size alone
    // (SmolLM2's 576x576 projections at batch 8 went from one core to two:
    // batch-8 decode step 67 -> 62 ms median, A B A B x 3, noisy).
    let (work, min_macs) = if m < 2 * mr {
        (n * k, PAR_MIN_MACS_M1)
    } else {
        (m * n * k, PAR_MIN_MACS)
    };
    let threads = if work < min_macs { 1 } else { threads.max(1) };
    let c_ptr = SendPtr(c.data.as_mut_ptr());
    let ldc = c.ld;
    if threads == 1 {
        // SAFETY: the whole of C belongs to this call.
        unsafe {
            gemm_part(
                alpha,
                a,
                b,
                beta,
                k,
                n,
                kernel,
                0..m,
                0..n,
                c_ptr.get(),
                ldc,
            )
        };
        return;
    }
    // Split rows when each thread still gets whole register tiles and, when
    // packing B per call, B is not the smaller operand to duplicate; else columns.
    let split_rows = match b {
        BSrc::Pack(_) => m >= n || n < threads * nr,
        BSrc::Packed(_) => m >= threads * mr * 2 || n < threads * nr,
        // Columns, so each weight is expanded by one thread only.
        BSrc::Rows(_) => n < threads * nr,
    };
    let (len, unit) = if split_rows { (m, mr) } else { (n, nr) };
    let chunk = len.div_ceil(threads).div_ceil(unit) * unit;
    let parts = len.div_ceil(chunk);
    (0..parts).into_par_iter().for_each(|t| {
        let r = t * chunk..((t + 1) * chunk).min(len);
        let (rows, cols) = if split_rows { (r, 0..n) } else { (0..m, r) };
        // SAFETY: parts cover disjoint regions of C.
        unsafe {
            gemm_part(
                alpha,
                a,
                b,
                beta,
                k,
                n,
                kernel,
                rows,
                cols,
                c_ptr.get(),
                ldc,
            )
        };
    });
}

/// C[rows, cols] = alpha * A[rows, :] B[:, cols] + beta * C[rows, cols] on the
/// calling thread: the jc / pc / ic loops. `cols` starts at a multiple of nr.
///
/// # Safety
/// `c` points at C (leading dimension `ldc`) whose region rows x cols is
/// valid and written by no one else during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_part(
    alpha: f32,
    a: &MatRef,
    b: BSrc,
    beta: f32,
    k: usize,
    n: usize,
    kernel: MicroKernel,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    c: *mut f32,
    ldc: usize,
) {
    let (mr, nr, kc, mc, nc) = (kernel.mr, kernel.nr, kernel.kc, kernel.mc, kernel.nc);
    // K blocks: a weight producer reads whole blocks of its format.
    let k_unit = match b {
        BSrc::Rows(w) => w.k_unit(),
        _ => 1,
    };
    let mut rows_scratch = Vec::new();
    let mut local_b = AlignedBuf::default();
    let mut local_a = AlignedBuf::default();
    // Thread-local buffers (no rayon call happens while they are borrowed;
    // a re-entrant call on this thread would fall back to fresh ones).
    let b_guard = B_PACK.with(|x| x.try_borrow_mut().ok().map(|mut g| std::mem::take(&mut *g)));
    let a_guard = A_PACK.with(|x| x.try_borrow_mut().ok().map(|mut g| std::mem::take(&mut *g)));
    let (mut bbuf, mut abuf) = (
        b_guard.unwrap_or_else(|| std::mem::take(&mut local_b)),
        a_guard.unwrap_or_else(|| std::mem::take(&mut local_a)),
    );
    for (jci, jc) in (0..n).step_by(nc).enumerate() {
        let jend = (jc + nc).min(n);
        let (lo, hi) = (cols.start.max(jc), cols.end.min(jend));
        if lo >= hi {
            continue;
        }
        let (s0, s1) = ((lo - jc) / nr, (hi - jc).div_ceil(nr));
        for (pci, (pc, kcb)) in blocks(k, kc, k_unit).enumerate() {
            let beta_eff = if pc == 0 { beta } else { 1.0 };
            let b_slivers: &[f32] = match b {
                BSrc::Pack(bm) => {
                    let buf = bbuf.get((s1 - s0) * kcb * nr);
                    pack_b(bm, pc, kcb, jc, jend - jc, nr, s0..s1, buf);
                    buf
                }
                BSrc::Packed(p) => &p.panel_at(jci, pci)[s0 * kcb * nr..s1 * kcb * nr],
                BSrc::Rows(w) => {
                    let buf = bbuf.get((s1 - s0) * kcb * nr);
                    w.pack(jc + s0 * nr, jend, pc, kcb, nr, &mut rows_scratch, buf);
                    buf
                }
            };
            for (i, mcb) in blocks(rows.len(), mc, mr) {
                let ic = rows.start + i;
                // Row-major A is read in place (mr unit-stride row streams),
                // unless its row stride is a multiple of 1 KB and the kernel
                // is one that then loses to 4K aliasing (see
                // `MicroKernel::pack_aliased_a`).
                let aliased = kernel.pack_aliased_a && a.rs.is_multiple_of(256);
                let a_src = if a.cs == 1 && !aliased {
                    // Only a final partial sliver is packed, zero-padded.
                    let full = mcb / mr * mr;
                    let tail = abuf.get(if full < mcb { kcb * mr } else { 0 });
                    if full < mcb {
                        pack_a(a, ic + full, mcb - full, pc, kcb, mr, tail);
                    }
                    // SAFETY: (ic, pc) is an element of A (mcb, kcb >= 1).
                    let a_ic = unsafe { a.data.as_ptr().add(ic * a.rs + pc) };
                    ASrc::Direct {
                        a: a_ic,
                        lda: a.rs,
                        tail,
                    }
                } else {
                    let ap = abuf.get(mcb.div_ceil(mr) * kcb * mr);
                    pack_a(a, ic, mcb, pc, kcb, mr, ap);
                    ASrc::Packed(ap)
                };
                // SAFETY: the tile region is inside this part of C.
                unsafe {
                    macro_kernel(
                        &kernel,
                        kcb,
                        a_src,
                        b_slivers,
                        jc + s0 * nr,
                        hi,
                        ic,
                        mcb,
                        c,
                        ldc,
                        alpha,
                        beta_eff,
                    )
                };
            }
        }
    }
    B_PACK.with(|x| {
        if let Ok(mut g) = x.try_borrow_mut() {
            *g = bbuf;
        }
    });
    A_PACK.with(|x| {
        if let Ok(mut g) = x.try_borrow_mut() {
            *g = abuf;
        }
    });
}

/// Where the micro-kernel reads A from.
#[derive(Clone, Copy, Debug)]
enum ASrc<'a> {
    /// Packed mr-row slivers, each (kc, mr).
    Packed(&'a [f32]),
    /// In place: row-major A at (ic, pc) with row stride lda; the last
    /// partial sliver (if any) packed in `tail`.
    Direct {
        a: *const f32,
        lda: usize,
        tail: &'a [f32],
    },
}

/// The two inner loops: B slivers (L1) outer, A slivers (registers) inner.
///
/// # Safety
/// `c` points at C with leading dimension `ldc`; rows i0..i0+mcb and columns
/// j_first..j_end are valid and not written by any other task during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn macro_kernel(
    kernel: &MicroKernel,
    kc: usize,
    a_src: ASrc,
    b_slivers: &[f32],
    j_first: usize,
    j_end: usize,
    i0: usize,
    mcb: usize,
    c: *mut f32,
    ldc: usize,
    alpha: f32,
    beta: f32,
) {
    let (mr, nr) = (kernel.mr, kernel.nr);
    // Edge tiles: every kernel's mr * nr fits (checked at compile time in
    // kernels.rs, and here in release builds too: it guards raw writes).
    let mut tmp = [0.0f32; crate::kernels::MAX_TILE];
    assert!(
        mr * nr <= tmp.len(),
        "register tile {mr}x{nr} exceeds the edge buffer"
    );
    for (s, bp) in b_slivers.chunks_exact(kc * nr).enumerate() {
        let j = j_first + s * nr;
        let cols = nr.min(j_end - j);
        for ir in 0..mcb.div_ceil(mr) {
            let i = i0 + ir * mr;
            let rows = mr.min(i0 + mcb - i);
            let (ap, rsa, csa) = match a_src {
                ASrc::Packed(p) => (p[ir * kc * mr..].as_ptr(), 1, mr),
                ASrc::Direct { a, lda, .. } if rows == mr => {
                    // SAFETY: full slivers lie inside A (rows i..i+mr exist).
                    let a_i = unsafe { a.add(ir * mr * lda) };
                    (a_i, lda, 1)
                }
                ASrc::Direct { tail, .. } => (tail.as_ptr(), 1, mr),
            };
            // SAFETY: (i, j) is inside C per the contract.
            let ct = unsafe { c.add(i * ldc + j) };
            if rows == mr && cols == nr {
                // SAFETY: a full tile: mr rows of nr floats at stride ldc.
                unsafe { (kernel.func)(kc, ap, rsa, csa, bp.as_ptr(), ct, ldc, alpha, beta) };
            } else if rows == 1 && cols == nr {
                // SAFETY: one row of nr floats; the 1-row kernel reads only row 0 of the sliver.
                unsafe { (kernel.func1)(kc, ap, rsa, csa, bp.as_ptr(), ct, ldc, alpha, beta) };
            } else {
                // SAFETY: tmp holds a full mr x nr tile at stride nr.
                unsafe {
                    (kernel.func)(
                        kc,
                        ap,
                        rsa,
                        csa,
                        bp.as_ptr(),
                        tmp.as_mut_ptr(),
                        nr,
                        alpha,
                        0.0,
                    )
                };
                for r in 0..rows {
                    for q in 0..cols {
                        // SAFETY: r < rows, q < cols: inside this task's tile of C.
                        let cv = unsafe { &mut *ct.add(r * ldc + q) };
                        let old = if beta == 0.0 { 0.0 } else { beta * *cv };
                        *cv = tmp[r * nr + q] + old;
                    }
                }
            }
        }
    }
}

/// C = beta * C (beta == 0 writes zeros without reading C).
fn scale_c(c: &mut MatMut, beta: f32) {
    for i in 0..c.rows {
        let row = &mut c.data[i * c.ld..i * c.ld + c.cols];
        if beta == 0.0 {
            row.fill(0.0);
        } else {
            row.iter_mut().for_each(|v| *v *= beta);
        }
    }
}

/// Optional extras of [`sgemm`].
#[derive(Clone, Copy, Debug)]
pub struct GemmOpts<'a> {
    pub alpha: f32,
    /// 0 means C is write-only (not read; NaN in C is ignored).
    pub beta: f32,
    /// Added to every row of C (length N): the linear layer's bias.
    pub bias: Option<&'a [f32]>,
    /// Threads to use (1 = the calling thread only). Default: rayon's pool size.
    pub threads: usize,
}

impl Default for GemmOpts<'_> {
    fn default() -> Self {
        Self {
            alpha: 1.0,
            beta: 0.0,
            bias: None,
            threads: rayon::current_num_threads(),
        }
    }
}

/// `C = alpha * A * B + beta * C + bias`, single precision.
///
/// Contract:
/// - `a` is (M, K), `b` is (K, N), `c` is (M, N), all as strided views, so a
///   PyTorch weight W stored (out, in) is passed as `MatRef::row_major(w, out, in)?.t()`
///   (no copy; packing reads it through the strides).
/// - Shapes are checked (error, never a panic or an out-of-bounds read); the
///   views' constructors already checked that their strides stay in their buffers.
/// - beta == 0: C is not read. `bias`, if given, has length N.
/// - M = 1 with B unit-stride along a dimension takes the GEMV path (memory
///   bound: one pass over B, split over threads by columns).
/// - Result equals the f64 reference within k * eps * sum|a||b| per element
///   (tested); the summation order depends on the path and block sizes, not
///   on the thread count.
pub fn sgemm(a: MatRef, b: MatRef, c: &mut MatMut, opts: GemmOpts) -> Result<(), GemmError> {
    sgemm_with(a, b, c, opts, MicroKernel::best())
}

/// A (M, K) x B (K, N) -> C (M, N), and a bias of length N.
pub(crate) fn check_args(
    a: &MatRef,
    (k, n): (usize, usize),
    c: &MatMut,
    bias: Option<&[f32]>,
) -> Result<(), GemmError> {
    if a.cols != k || c.rows != a.rows || c.cols != n {
        return Err(GemmError::Shape {
            a: (a.rows, a.cols),
            b: (k, n),
            c: (c.rows, c.cols),
        });
    }
    match bias {
        Some(b) if b.len() != n => Err(GemmError::Bias { len: b.len(), n }),
        _ => Ok(()),
    }
}

/// [`sgemm`] with a chosen micro-kernel (falls back to the best one if `kernel`
/// is not supported here).
pub fn sgemm_with(
    a: MatRef,
    b: MatRef,
    c: &mut MatMut,
    opts: GemmOpts,
    kernel: MicroKernel,
) -> Result<(), GemmError> {
    check_args(&a, (b.rows, b.cols), c, opts.bias)?;
    if a.rows == 1 && gemv::handles(&b) {
        gemv::gemv(opts.alpha, a, b, opts.beta, c, opts.threads)?;
    } else {
        gemm_packed(opts.alpha, a, b, opts.beta, c, kernel, opts.threads)?;
    }
    add_bias(c, opts.bias);
    Ok(())
}

/// [`sgemm`] with B packed once ([`PackedB`]): C = alpha * A * B + beta * C + bias.
/// The kernel is the one B was packed for.
pub fn sgemm_prepacked(
    a: MatRef,
    b: &PackedB,
    c: &mut MatMut,
    opts: GemmOpts,
) -> Result<(), GemmError> {
    check_args(&a, (b.k, b.n), c, opts.bias)?;
    gemm_dispatch(
        opts.alpha,
        &a,
        BSrc::Packed(b),
        b.n,
        opts.beta,
        c,
        b.kernel,
        opts.threads,
    );
    add_bias(c, opts.bias);
    Ok(())
}

pub(crate) fn add_bias(c: &mut MatMut, bias: Option<&[f32]>) {
    if let Some(bias) = bias {
        for i in 0..c.rows {
            for (v, &bj) in c.data[i * c.ld..i * c.ld + c.cols].iter_mut().zip(bias) {
                *v += bj;
            }
        }
    }
}

/// y (rows, out) = x (rows, in) W^T + bias, with W as PyTorch stores it,
/// (out, in): the call every linear layer makes.
pub fn linear(
    x: &[f32],
    rows: usize,
    w: &[f32],
    out_f: usize,
    bias: Option<&[f32]>,
    y: &mut [f32],
    threads: usize,
) -> Result<(), GemmError> {
    let in_f = w.len().checked_div(out_f).unwrap_or(0);
    if out_f * in_f != w.len()
        || Some(x.len()) != rows.checked_mul(in_f)
        || Some(y.len()) != rows.checked_mul(out_f)
    {
        return Err(GemmError::Linear {
            x: x.len(),
            w: w.len(),
            y: y.len(),
            rows,
            out_f,
        });
    }
    let a = MatRef::row_major(x, rows, in_f)?;
    let b = MatRef::row_major(w, out_f, in_f)?.t();
    let mut c = MatMut::row_major(y, rows, out_f)?;
    sgemm(
        a,
        b,
        &mut c,
        GemmOpts {
            bias,
            threads,
            ..GemmOpts::default()
        },
    )
}
