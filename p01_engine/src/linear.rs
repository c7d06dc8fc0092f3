//! `linear`: y = x W^T + b, the op that holds ~all of an MLP's FLOPs.
//!
//! PyTorch stores W as (out, in). At load we repack it once into column
//! *stripes* of [`STRIPE`] outputs: stripe s holds W^T[:, 16s..16s+16] as
//! (in, 16), contiguous, the last stripe zero-padded. A micro-kernel then
//! keeps an (MR rows x 16 columns) block of y in registers and streams one
//! stripe: per input feature k it loads 16 weights once and broadcasts MR
//! values of x, doing MR x 16 multiply-adds. Every stripe is a contiguous
//! stream (prefetcher-friendly) and odd widths need no tail code.
//!
//! Paths: AVX2+FMA intrinsics chosen at run time; a portable path over the
//! same packed layout; [`linear_ref`], the naive triple loop over the original
//! (out, in) weights, that tests hold both against.

use rayon::prelude::*;

/// Output columns per packed stripe (two AVX2 vectors of 8 f32).
pub const STRIPE: usize = 16;
/// Rows per micro-tile on the AVX2 path: 6 x 2 vectors = 12 accumulators of
/// the 16 ymm registers, leaving room for two weight vectors and a broadcast.
pub const MR: usize = 6;
/// Below this many multiply-adds a call stays on the calling thread. Waking a
/// sleeping pool thread on this VM costs tens of microseconds (measured: batch
/// 1 took 18 us on one thread, 52 us when fc1 was split over two), so a split
/// must bring at least ~1 ms of work (4M MACs at ~40 GMAC/s per core).
pub const PAR_MIN_MACS: usize = 1 << 22;
/// Rows at or above which threads split rows; below it they split stripes.
const ROW_SPLIT_MIN_ROWS: usize = 4 * MR;

/// What to apply to y before storing it (fusion saves a pass over y).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    None,
    Relu,
}

/// A linear layer's weights, packed once at load.
#[derive(Clone, Debug)]
pub struct Linear {
    pub in_features: usize,
    pub out_features: usize,
    /// (n_stripes, in_features, STRIPE): W^T in column stripes, zero-padded.
    packed: Vec<f32>,
    /// (n_stripes * STRIPE): bias, zero-padded (zeros when the layer has none).
    bias: Vec<f32>,
}

/// Naive reference: y[r, o] = b[o] + sum_k x[r, k] * w[o, k], with W as PyTorch
/// stores it, (out, in). x is (rows, in); returns (rows, out).
pub fn linear_ref(x: &[f32], rows: usize, w: &[f32], b: Option<&[f32]>, out_f: usize) -> Vec<f32> {
    let in_f = x.len().checked_div(rows).unwrap_or(0);
    let mut y = vec![0.0; rows * out_f];
    for r in 0..rows {
        for o in 0..out_f {
            let mut acc = 0.0f32;
            for k in 0..in_f {
                acc += x[r * in_f + k] * w[o * in_f + k];
            }
            y[r * out_f + o] = acc + b.map_or(0.0, |b| b[o]);
        }
    }
    y
}

impl Linear {
    /// Pack W (out, in) and optional b (out). Lengths are the caller's
    /// contract (the graph validates them at load); mismatches panic here.
    pub fn new(
        weight: &[f32],
        bias: Option<&[f32]>,
        out_features: usize,
        in_features: usize,
    ) -> Self {
        assert_eq!(
            weight.len(),
            out_features * in_features,
            "weight is (out, in)"
        );
        let n_stripes = out_features.div_ceil(STRIPE);
        let mut packed = vec![0.0f32; n_stripes * in_features * STRIPE];
        for o in 0..out_features {
            let (s, c) = (o / STRIPE, o % STRIPE);
            for k in 0..in_features {
                packed[(s * in_features + k) * STRIPE + c] = weight[o * in_features + k];
            }
        }
        let mut b = vec![0.0f32; n_stripes * STRIPE];
        if let Some(bias) = bias {
            assert_eq!(bias.len(), out_features, "bias is (out)");
            b[..out_features].copy_from_slice(bias);
        }
        Self {
            in_features,
            out_features,
            packed,
            bias: b,
        }
    }

    fn n_stripes(&self) -> usize {
        self.out_features.div_ceil(STRIPE)
    }

    /// Multiply-adds per input row.
    pub fn macs_per_row(&self) -> usize {
        self.in_features * self.out_features
    }

    /// y (rows, out) = act(x (rows, in) W^T + b). `threads` > 1 allows rayon.
    /// Panics if the slice lengths disagree with `rows` (engine contract).
    pub fn forward(&self, x: &[f32], rows: usize, y: &mut [f32], act: Activation, threads: usize) {
        self.forward_with(Kernel::detect(), x, rows, y, act, threads);
    }

    /// [`Linear::forward`] on a chosen kernel (tests hold every kernel to the
    /// reference). Falls back to the portable kernel if `kernel` is not
    /// supported by this CPU.
    pub fn forward_with(
        &self,
        kernel: Kernel,
        x: &[f32],
        rows: usize,
        y: &mut [f32],
        act: Activation,
        threads: usize,
    ) {
        let kernel = if kernel.supported() {
            kernel
        } else {
            Kernel::Portable
        };
        let (in_f, out_f) = (self.in_features, self.out_features);
        assert_eq!(x.len(), rows * in_f, "x is (rows, in)");
        assert_eq!(y.len(), rows * out_f, "y is (rows, out)");
        if rows == 0 || out_f == 0 {
            return;
        }
        let n_stripes = self.n_stripes();
        if threads <= 1 || rows * self.macs_per_row() < PAR_MIN_MACS {
            // SAFETY: x and y have the lengths asserted above; stripes 0..n_stripes exist.
            unsafe {
                self.run(
                    kernel,
                    x.as_ptr(),
                    rows,
                    y.as_mut_ptr(),
                    out_f,
                    0..n_stripes,
                    act,
                )
            };
        } else if rows >= ROW_SPLIT_MIN_ROWS {
            // Split rows into one contiguous chunk per thread (whole micro-tiles).
            let per = rows.div_ceil(threads).div_ceil(MR) * MR;
            y.par_chunks_mut(per * out_f)
                .zip(x.par_chunks(per * in_f))
                .for_each(|(yc, xc)| {
                    let r = xc.len() / in_f;
                    // SAFETY: xc is (r, in), yc is (r, out), disjoint per task.
                    unsafe {
                        self.run(
                            kernel,
                            xc.as_ptr(),
                            r,
                            yc.as_mut_ptr(),
                            out_f,
                            0..n_stripes,
                            act,
                        )
                    };
                });
        } else {
            // Few rows (decode-like): split stripes, so each core streams only
            // its share of the weights (and keeps that share in its own L2).
            let per = n_stripes.div_ceil(threads);
            let y_ptr = SendPtr(y.as_mut_ptr());
            (0..n_stripes.div_ceil(per)).into_par_iter().for_each(|t| {
                let s = t * per..((t + 1) * per).min(n_stripes);
                let y_ptr = &y_ptr;
                // SAFETY: tasks write disjoint column ranges (their stripes) of
                // every row of y; x is only read.
                unsafe { self.run(kernel, x.as_ptr(), rows, y_ptr.0, out_f, s, act) };
            });
        }
    }

    /// Compute stripes `stripes` of y for `rows` rows.
    ///
    /// # Safety
    /// `x` points at (rows, in_features) f32s; `y` at (rows, ldy) with
    /// ldy >= out_features; stripes lie within 0..n_stripes.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run(
        &self,
        kernel: Kernel,
        x: *const f32,
        rows: usize,
        y: *mut f32,
        ldy: usize,
        stripes: std::ops::Range<usize>,
        act: Activation,
    ) {
        let in_f = self.in_features;
        let relu = act == Activation::Relu;
        // Rows in blocks that stay in L2 while every stripe passes over them.
        const ROW_BLOCK: usize = 8 * MR;
        let mut r0 = 0;
        while r0 < rows {
            let rb = ROW_BLOCK.min(rows - r0);
            for s in stripes.clone() {
                let w = self.packed[s * in_f * STRIPE..].as_ptr();
                let b = self.bias[s * STRIPE..].as_ptr();
                let cols = STRIPE.min(self.out_features - s * STRIPE);
                let mut r = r0;
                while r < r0 + rb {
                    let mr = MR.min(r0 + rb - r);
                    // SAFETY: r < rows and s < n_stripes, inside the caller's ranges.
                    let (xt, yt) = unsafe { (x.add(r * in_f), y.add(r * ldy + s * STRIPE)) };
                    match kernel {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: Kernel::Avx2 is only chosen when avx2 and fma are detected.
                        Kernel::Avx2 => unsafe {
                            avx2::tile(mr, xt, in_f, w, b, yt, ldy, cols, relu)
                        },
                        // SAFETY: as above; the portable tile needs no CPU features.
                        Kernel::Portable => unsafe {
                            tile_portable(mr, xt, in_f, w, b, yt, ldy, cols, relu)
                        },
                    }
                    r += mr;
                }
            }
            r0 += rb;
        }
    }
}

/// ReLU that keeps NaN as NaN (as PyTorch does).
#[inline]
pub fn relu1(v: f32) -> f32 {
    if v < 0.0 {
        0.0
    } else {
        v
    }
}

struct SendPtr(*mut f32);
// SAFETY: used only to hand disjoint column ranges of one buffer to rayon tasks.
unsafe impl Sync for SendPtr {}

/// Which micro-kernel this CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Kernel {
    /// Whether this CPU can run the kernel.
    pub fn supported(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            Kernel::Portable => true,
        }
    }

    /// The fastest kernel this CPU supports (`P01_KERNEL=portable` forces the fallback).
    pub fn detect() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            use std::sync::OnceLock;
            static K: OnceLock<Kernel> = OnceLock::new();
            return *K.get_or_init(|| {
                let forced = std::env::var("P01_KERNEL").is_ok_and(|v| v == "portable");
                if !forced && Kernel::Avx2.supported() {
                    Kernel::Avx2
                } else {
                    Kernel::Portable
                }
            });
        }
        #[allow(unreachable_code)]
        Kernel::Portable
    }
}

/// Portable micro-tile over the packed layout: same arithmetic order as the
/// AVX2 tile (per row, per feature k, 16 multiply-adds), auto-vectorised.
///
/// # Safety
/// As [`Linear::run`]: x is (mr, in_f), w is (in_f, STRIPE), b is STRIPE long,
/// y rows have stride ldy and room for `cols` values.
#[allow(clippy::too_many_arguments)]
unsafe fn tile_portable(
    mr: usize,
    x: *const f32,
    in_f: usize,
    w: *const f32,
    b: *const f32,
    y: *mut f32,
    ldy: usize,
    cols: usize,
    relu: bool,
) {
    // SAFETY: lengths per the function contract.
    let (w, b) = unsafe {
        (
            std::slice::from_raw_parts(w, in_f * STRIPE),
            std::slice::from_raw_parts(b, STRIPE),
        )
    };
    for r in 0..mr {
        // SAFETY: row r of x is in_f long.
        let xr = unsafe { std::slice::from_raw_parts(x.add(r * in_f), in_f) };
        let mut acc = [0.0f32; STRIPE];
        acc.copy_from_slice(b);
        for (&a, wk) in xr.iter().zip(w.chunks_exact(STRIPE)) {
            let wk: &[f32; STRIPE] = wk.try_into().expect("chunks_exact");
            for (acc, &wv) in acc.iter_mut().zip(wk) {
                *acc += a * wv;
            }
        }
        for (c, &v) in acc.iter().take(cols).enumerate() {
            // SAFETY: y row r has room for `cols` values from here.
            unsafe { *y.add(r * ldy + c) = if relu { relu1(v) } else { v } };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{MR, STRIPE};
    use std::arch::x86_64::*;

    /// Dispatch a tile of `mr` (1..=MR) rows to its const-generic body.
    ///
    /// # Safety
    /// CPU has avx2+fma; pointers as in `tile_portable`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile(
        mr: usize,
        x: *const f32,
        in_f: usize,
        w: *const f32,
        b: *const f32,
        y: *mut f32,
        ldy: usize,
        cols: usize,
        relu: bool,
    ) {
        // SAFETY: forwarded contract.
        unsafe {
            match mr {
                6 => tile_n::<6>(x, in_f, w, b, y, ldy, cols, relu),
                5 => tile_n::<5>(x, in_f, w, b, y, ldy, cols, relu),
                4 => tile_n::<4>(x, in_f, w, b, y, ldy, cols, relu),
                3 => tile_n::<3>(x, in_f, w, b, y, ldy, cols, relu),
                2 => tile_n::<2>(x, in_f, w, b, y, ldy, cols, relu),
                1 => tile_n::<1>(x, in_f, w, b, y, ldy, cols, relu),
                _ => unreachable!("tile rows are 1..={MR}"),
            }
        }
    }

    /// (R rows x 16 columns) of y in 2R ymm accumulators.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_n<const R: usize>(
        x: *const f32,
        in_f: usize,
        w: *const f32,
        b: *const f32,
        y: *mut f32,
        ldy: usize,
        cols: usize,
        relu: bool,
    ) {
        // SAFETY: every pointer offset stays inside the ranges the caller
        // guarantees: x rows 0..R of in_f, w (in_f, 16), b 16, y rows 0..R
        // with `cols` (<= 16) writable values each.
        unsafe {
            let b0 = _mm256_loadu_ps(b);
            let b1 = _mm256_loadu_ps(b.add(8));
            let mut acc = [[b0, b1]; R];
            for k in 0..in_f {
                let w0 = _mm256_loadu_ps(w.add(k * STRIPE));
                let w1 = _mm256_loadu_ps(w.add(k * STRIPE + 8));
                for (r, a) in acc.iter_mut().enumerate() {
                    let xv = _mm256_broadcast_ss(&*x.add(r * in_f + k));
                    a[0] = _mm256_fmadd_ps(xv, w0, a[0]);
                    a[1] = _mm256_fmadd_ps(xv, w1, a[1]);
                }
            }
            let zero = _mm256_setzero_ps();
            for (r, a) in acc.iter().enumerate() {
                let (mut v0, mut v1) = (a[0], a[1]);
                if relu {
                    // max(0, v) returns v when v is NaN, as torch.relu does.
                    v0 = _mm256_max_ps(zero, v0);
                    v1 = _mm256_max_ps(zero, v1);
                }
                let yr = y.add(r * ldy);
                if cols == STRIPE {
                    _mm256_storeu_ps(yr, v0);
                    _mm256_storeu_ps(yr.add(8), v1);
                } else {
                    let mut tmp = [0.0f32; STRIPE];
                    _mm256_storeu_ps(tmp.as_mut_ptr(), v0);
                    _mm256_storeu_ps(tmp.as_mut_ptr().add(8), v1);
                    std::ptr::copy_nonoverlapping(tmp.as_ptr(), yr, cols);
                }
            }
        }
    }
}
