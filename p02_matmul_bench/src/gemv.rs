//! M = 1 (the decode shape): y = alpha * x B + beta * y. Each weight is used
//! once, so this is a pass over B at memory bandwidth; the kernels only have
//! to keep enough loads in flight. Threads split the columns of y, so each
//! core streams its own share of B.
//!
//! Two layouts of B (K, N):
//! - rs == 1 (B = W^T with W (N, K) row-major, PyTorch's weights): y[j] is
//!   dot(x, W[j, :]) over a contiguous row: 4 rows at a time share each load of x.
//! - cs == 1 (B row-major): y[j0..j0+64] += x[k] * B[k, j0..j0+64] for every k,
//!   the 64 partial sums held in registers.

use rayon::prelude::*;

use crate::kernels::MicroKernel;
use crate::mat::{MatMut, MatRef};
use crate::variants::dot;
use crate::GemmError;

/// Bytes of B below which one thread does it all. Waking a pool thread costs
/// tens of us on this VM; measured: 1.3 MB (q_proj) took 24 us on one thread
/// and 60 us split over two; 3.5 MB broke even; 113 MB (lm_head) ran 1.8x faster.
pub const PAR_MIN_BYTES: usize = 4 << 20;

/// Whether the GEMV path takes this B (unit stride along one dimension).
pub fn handles(b: &MatRef) -> bool {
    b.rs == 1 || b.cs == 1
}

/// y = alpha * x B + beta * y for one row x (1, K), B (K, N), y (1, N).
/// Shapes are checked (an error, as in [`crate::sgemm`]); a B that
/// [`handles`] refuses is computed by the packed path instead.
pub fn gemv(
    alpha: f32,
    x: MatRef,
    b: MatRef,
    beta: f32,
    y: &mut MatMut,
    threads: usize,
) -> Result<(), GemmError> {
    let (k, n) = (b.rows, b.cols);
    if x.rows != 1 {
        return Err(GemmError::Shape {
            a: (x.rows, x.cols),
            b: (k, n),
            c: (y.rows, y.cols),
        });
    }
    if !handles(&b) {
        return crate::gemm::gemm_packed(alpha, x, b, beta, y, MicroKernel::best(), threads);
    }
    crate::gemm::check_args(&x, (k, n), y, None)?;
    if n == 0 || k == 0 {
        // An empty sum: y = beta * y (beta == 0 writes zeros, reads nothing).
        for v in &mut y.data[..n] {
            *v = if beta == 0.0 { 0.0 } else { beta * *v };
        }
        return Ok(());
    }
    let xs: Vec<f32>;
    let x: &[f32] = if x.cs == 1 {
        &x.data[..k]
    } else {
        xs = (0..k).map(|p| x.at(0, p)).collect();
        &xs
    };
    let y_row = &mut y.data[..n];
    let threads = if k * n * 4 < PAR_MIN_BYTES {
        1
    } else {
        threads.max(1)
    };
    // Column chunks, multiples of 64 so the row-major kernel keeps full blocks.
    let chunk = n.div_ceil(threads).div_ceil(64) * 64;
    let run = |j0: usize, yc: &mut [f32]| {
        if b.rs == 1 {
            dot_rows(alpha, x, &b, beta, j0, yc);
        } else {
            axpy_cols(alpha, x, &b, beta, j0, yc);
        }
    };
    if threads > 1 {
        y_row
            .par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(t, yc)| run(t * chunk, yc));
    } else {
        run(0, y_row);
    }
    Ok(())
}

fn finish(alpha: f32, acc: f32, beta: f32, y: &mut f32) {
    *y = if beta == 0.0 {
        alpha * acc
    } else {
        alpha * acc + beta * *y
    };
}

/// y[j] for j in j0..j0+y.len(), B = W^T with W rows contiguous (stride b.cs).
fn dot_rows(alpha: f32, x: &[f32], b: &MatRef, beta: f32, j0: usize, y: &mut [f32]) {
    let k = b.rows;
    let w_row = |j: usize| &b.data[j * b.cs..j * b.cs + k];
    let mut j = 0;
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        while j + 4 <= y.len() {
            let rows = [
                w_row(j0 + j),
                w_row(j0 + j + 1),
                w_row(j0 + j + 2),
                w_row(j0 + j + 3),
            ];
            // SAFETY: avx2+fma detected; every row and x have k elements.
            let d = unsafe { x86::dot4(x, rows) };
            for (q, &v) in d.iter().enumerate() {
                finish(alpha, v, beta, &mut y[j + q]);
            }
            j += 4;
        }
    }
    while j < y.len() {
        let v = dot(x, w_row(j0 + j));
        finish(alpha, v, beta, &mut y[j]);
        j += 1;
    }
}

/// y[j0..] += sum_k x[k] * B[k, j0..] with B rows contiguous (stride b.rs).
fn axpy_cols(alpha: f32, x: &[f32], b: &MatRef, beta: f32, j0: usize, y: &mut [f32]) {
    const BLOCK: usize = 64;
    let mut acc = [0.0f32; BLOCK];
    for jb in (0..y.len()).step_by(BLOCK) {
        let w = BLOCK.min(y.len() - jb);
        let acc = &mut acc[..w];
        acc.fill(0.0);
        for (p, &xp) in x.iter().enumerate() {
            let start = p * b.rs + j0 + jb;
            for (a, &bv) in acc.iter_mut().zip(&b.data[start..start + w]) {
                *a += xp * bv;
            }
        }
        for (q, &v) in acc.iter().enumerate() {
            finish(alpha, v, beta, &mut y[jb + q]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Sum of the 8 lanes.
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// Four dot products of x with four rows, two accumulators per row
    /// (8 independent FMA chains), scalar tail.
    ///
    /// # Safety
    /// CPU has avx2+fma; each row has x.len() elements.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4(x: &[f32], rows: [&[f32]; 4]) -> [f32; 4] {
        let k = x.len();
        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
        let mut p = 0;
        // SAFETY: p + 16 <= k on every vector load.
        unsafe {
            while p + 16 <= k {
                let x0 = _mm256_loadu_ps(x.as_ptr().add(p));
                let x1 = _mm256_loadu_ps(x.as_ptr().add(p + 8));
                for (a, r) in acc.iter_mut().zip(&rows) {
                    a[0] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(r.as_ptr().add(p)), a[0]);
                    a[1] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(r.as_ptr().add(p + 8)), a[1]);
                }
                p += 16;
            }
        }
        let mut out = [0.0f32; 4];
        for (q, (a, r)) in acc.iter().zip(&rows).enumerate() {
            let tail: f32 = x[p..].iter().zip(&r[p..k]).map(|(u, v)| u * v).sum();
            out[q] = hsum(_mm256_add_ps(a[0], a[1])) + tail;
        }
        out
    }
}
