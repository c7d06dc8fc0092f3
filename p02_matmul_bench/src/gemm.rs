//! The packed GEMM driver (BLIS's five loops around the micro-kernel) and the
//! public [`sgemm`] every later crate calls.
//!
//! ```text
//! for jc in N by nc:              B panel (kc x nc) -> L3
//!   for pc in K by kc:            pack B[pc.., jc..] into nr-wide slivers (shared by all threads)
//!     for ic in M by mc:  (threads)   pack A[ic.., pc..] into mr-tall slivers -> L2
//!       for jr in nc by nr:           one B sliver (kc x nr) -> L1
//!         for ir in mc by mr:         micro-kernel: C[mr x nr] += A sliver . B sliver (registers)
//! ```

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

thread_local! {
    /// Per-thread packed-A buffer, reused across calls (an mc x kc block is
    /// ~150 KB: allocating it per block would page-fault every time).
    static A_PACK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Below this many multiply-adds a call stays on the calling thread (waking a
/// pool thread costs tens of microseconds on this VM; see p01's README).
pub const PAR_MIN_MACS: usize = 1 << 22;

/// C = alpha * A * B + beta * C through packing and `kernel`, on up to
/// `threads` threads. Shapes must already agree (see [`sgemm`]).
pub fn gemm_packed(alpha: f32, a: MatRef, b: MatRef, beta: f32, c: &mut MatMut, kernel: MicroKernel, threads: usize) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 || alpha == 0.0 {
        scale_c(c, beta);
        return;
    }
    let (mr, nr) = (kernel.mr, kernel.nr);
    let threads = if m * n * k < PAR_MIN_MACS { 1 } else { threads.max(1) };
    // With threads, size M blocks so every thread gets one (prefill shapes
    // like M = 256 would otherwise leave a thread idle).
    let mc = if threads > 1 { kernel.mc.min(m.div_ceil(threads).div_ceil(mr) * mr) } else { kernel.mc };
    let m_blocks = m.div_ceil(mc);
    let ldc = c.ld;
    let c_ptr = SendPtr(c.data.as_mut_ptr());
    let mut b_pack: Vec<f32> = Vec::new();

    for jc in (0..n).step_by(kernel.nc) {
        let nc = kernel.nc.min(n - jc);
        let n_slivers = nc.div_ceil(nr);
        for pc in (0..k).step_by(kernel.kc) {
            let kc = kernel.kc.min(k - pc);
            let beta_eff = if pc == 0 { beta } else { 1.0 };
            // Pack the B panel once, in parallel over slivers.
            b_pack.resize(n_slivers * kc * nr, 0.0);
            let sliver_len = kc * nr;
            if threads > 1 {
                let per = n_slivers.div_ceil(threads);
                b_pack.par_chunks_mut(per * sliver_len).enumerate().for_each(|(t, chunk)| {
                    let s0 = t * per;
                    let s1 = (s0 + chunk.len() / sliver_len).min(n_slivers);
                    pack_b(&b, pc, kc, jc, nc, nr, s0..s1, chunk);
                });
            } else {
                pack_b(&b, pc, kc, jc, nc, nr, 0..n_slivers, &mut b_pack);
            }
            // Tasks: (M block, range of B slivers). Few M blocks -> split N too.
            let n_split = threads.div_ceil(m_blocks).min(n_slivers).max(1);
            let per_split = n_slivers.div_ceil(n_split);
            let task = |t: usize| {
                let (ib, js) = (t / n_split, t % n_split);
                let i0 = ib * mc;
                let mcb = mc.min(m - i0);
                let slivers = (js * per_split)..((js + 1) * per_split).min(n_slivers);
                A_PACK.with(|buf| {
                    let mut ap = buf.borrow_mut();
                    let need = mcb.div_ceil(mr) * kc * mr;
                    if ap.len() < need {
                        ap.resize(need, 0.0);
                    }
                    pack_a(&a, i0, mcb, pc, kc, mr, &mut ap);
                    // SAFETY: tasks cover disjoint (rows, columns) tiles of C; the
                    // packed buffers hold the slivers the kernel reads.
                    unsafe { macro_kernel(&kernel, kc, &ap, &b_pack, slivers, i0, mcb, jc, nc, c_ptr.get(), ldc, alpha, beta_eff) };
                });
            };
            let n_tasks = m_blocks * n_split;
            if threads > 1 && n_tasks > 1 {
                (0..n_tasks).into_par_iter().for_each(task);
            } else {
                (0..n_tasks).for_each(task);
            }
        }
    }
}

/// The two inner loops: B slivers (L1) outer, A slivers (registers) inner.
///
/// # Safety
/// `c` points at C with leading dimension `ldc`, rows i0..i0+mcb and columns
/// jc..jc+nc valid and not written by any other task during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn macro_kernel(
    kernel: &MicroKernel,
    kc: usize,
    a_pack: &[f32],
    b_pack: &[f32],
    slivers: std::ops::Range<usize>,
    i0: usize,
    mcb: usize,
    jc: usize,
    nc: usize,
    c: *mut f32,
    ldc: usize,
    alpha: f32,
    beta: f32,
) {
    let (mr, nr) = (kernel.mr, kernel.nr);
    let mut tmp = [0.0f32; 8 * 32]; // edge tiles (mr*nr <= 256)
    debug_assert!(mr * nr <= tmp.len());
    for s in slivers {
        let bp = b_pack[s * kc * nr..].as_ptr();
        let j = jc + s * nr;
        let cols = nr.min(jc + nc - j);
        for ir in 0..mcb.div_ceil(mr) {
            let ap = a_pack[ir * kc * mr..].as_ptr();
            let i = i0 + ir * mr;
            let rows = mr.min(i0 + mcb - i);
            // SAFETY: (i, j) is inside C per the contract.
            let ct = unsafe { c.add(i * ldc + j) };
            if rows == mr && cols == nr {
                // SAFETY: a full tile: mr rows of nr floats at stride ldc.
                unsafe { (kernel.func)(kc, ap, bp, ct, ldc, alpha, beta) };
            } else {
                // SAFETY: tmp holds a full mr x nr tile at stride nr.
                unsafe { (kernel.func)(kc, ap, bp, tmp.as_mut_ptr(), nr, alpha, 0.0) };
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

/// [`sgemm`] with a chosen micro-kernel (falls back to the best one if `kernel`
/// is not supported here).
pub fn sgemm_with(a: MatRef, b: MatRef, c: &mut MatMut, opts: GemmOpts, kernel: MicroKernel) -> Result<(), GemmError> {
    if a.cols != b.rows || c.rows != a.rows || c.cols != b.cols {
        return Err(GemmError::Shape {
            a: (a.rows, a.cols),
            b: (b.rows, b.cols),
            c: (c.rows, c.cols),
        });
    }
    if let Some(bias) = opts.bias {
        if bias.len() != b.cols {
            return Err(GemmError::Bias {
                len: bias.len(),
                n: b.cols,
            });
        }
    }
    let kernel = if kernel.supported() { kernel } else { MicroKernel::best() };
    if a.rows == 1 && gemv::handles(&b) {
        gemv::gemv(opts.alpha, a, b, opts.beta, c, opts.threads);
    } else {
        gemm_packed(opts.alpha, a, b, opts.beta, c, kernel, opts.threads);
    }
    if let Some(bias) = opts.bias {
        for i in 0..c.rows {
            for (v, &bj) in c.data[i * c.ld..i * c.ld + c.cols].iter_mut().zip(bias) {
                *v += bj;
            }
        }
    }
    Ok(())
}

/// y (rows, out) = x (rows, in) W^T + bias, with W as PyTorch stores it,
/// (out, in): the call every linear layer makes.
pub fn linear(x: &[f32], rows: usize, w: &[f32], out_f: usize, bias: Option<&[f32]>, y: &mut [f32], threads: usize) -> Result<(), GemmError> {
    let in_f = w.len().checked_div(out_f).unwrap_or(0);
    if out_f * in_f != w.len() || Some(x.len()) != rows.checked_mul(in_f) || Some(y.len()) != rows.checked_mul(out_f) {
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
    sgemm(a, b, &mut c, GemmOpts { bias, threads, ..GemmOpts::default() })
}
