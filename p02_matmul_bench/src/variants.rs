//! The teaching ladder, each step its own function computing C = A * B
//! (alpha = 1, beta = 0), each tested against [`crate::reference::gemm_ref`].
//!
//! 1. [`naive_ijk`]: the textbook triple loop; the k loop walks a column of B
//!    (stride N): a cache miss per multiply-add once B outgrows the cache.
//! 2. [`ikj`]: the same arithmetic reordered so the inner loop walks a row of
//!    B and a row of C: unit stride, auto-vectorised.
//! 3. [`b_transposed`]: transpose B once (O(KN)), then every C element is a
//!    dot product of two contiguous rows.
//! 4. [`blocked`]: ikj over tiles sized so a tile of B stays in L2 while a
//!    block of A's rows passes over it.
//! 5. `packed` ([`crate::gemm::gemm_packed`]): BLIS-style packing into
//!    micro-panels and a register-blocked SIMD micro-kernel; 6. the same over
//!    threads.

use crate::mat::{MatMut, MatRef};

/// 1. C[i][j] = sum_k A[i][k] * B[k][j], in that loop order.
pub fn naive_ijk(a: MatRef, b: MatRef, c: &mut MatMut) {
    for i in 0..a.rows {
        for j in 0..b.cols {
            let mut acc = 0.0f32;
            for p in 0..a.cols {
                acc += a.at(i, p) * b.at(p, j);
            }
            c.data[i * c.ld + j] = acc;
        }
    }
}

/// Contiguous row `i` of a view whose column stride is 1.
fn row<'a>(m: &MatRef<'a>, i: usize) -> &'a [f32] {
    &m.data[i * m.rs..i * m.rs + m.cols]
}

/// 2. Loop order i-k-j: C[i, :] += A[i][k] * B[k, :].
pub fn ikj(a: MatRef, b: MatRef, c: &mut MatMut) {
    let n = b.cols;
    for i in 0..a.rows {
        let ci = &mut c.data[i * c.ld..i * c.ld + n];
        ci.fill(0.0);
        for p in 0..a.cols {
            let aip = a.at(i, p);
            if b.cs == 1 {
                for (cv, &bv) in ci.iter_mut().zip(row(&b, p)) {
                    *cv += aip * bv;
                }
            } else {
                for (j, cv) in ci.iter_mut().enumerate() {
                    *cv += aip * b.at(p, j);
                }
            }
        }
    }
}

/// Dot product with 8 independent partial sums (so it vectorises and the
/// add latency is hidden), combined pairwise at the end.
pub fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let xc = x.chunks_exact(8);
    let yc = y.chunks_exact(8);
    let tail: f32 = xc
        .remainder()
        .iter()
        .zip(yc.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (xs, ys) in xc.zip(yc) {
        for l in 0..8 {
            acc[l] += xs[l] * ys[l];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// 3. Transpose B into a contiguous (N, K) copy, then C[i][j] = dot(A[i,:], Bt[j,:]).
pub fn b_transposed(a: MatRef, b: MatRef, c: &mut MatMut) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let mut bt = vec![0.0f32; n * k];
    for p in 0..k {
        for j in 0..n {
            bt[j * k + p] = b.at(p, j);
        }
    }
    let mut ai = vec![0.0f32; k];
    for i in 0..m {
        for (p, v) in ai.iter_mut().enumerate() {
            *v = a.at(i, p);
        }
        for j in 0..n {
            c.data[i * c.ld + j] = dot(&ai, &bt[j * k..(j + 1) * k]);
        }
    }
}

/// Tile sizes of [`blocked`]: a (BK x BJ) tile of B is 256 KB, half of this
/// machine's 512 KB L2; a row strip of C (BJ floats) stays in L1.
pub const BLOCK_I: usize = 64;
pub const BLOCK_K: usize = 256;
pub const BLOCK_J: usize = 256;

/// 4. Cache-blocked i-k-j.
pub fn blocked(a: MatRef, b: MatRef, c: &mut MatMut) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    for i in 0..m {
        c.data[i * c.ld..i * c.ld + n].fill(0.0);
    }
    for j0 in (0..n).step_by(BLOCK_J) {
        let j1 = (j0 + BLOCK_J).min(n);
        for p0 in (0..k).step_by(BLOCK_K) {
            let p1 = (p0 + BLOCK_K).min(k);
            for i0 in (0..m).step_by(BLOCK_I) {
                for i in i0..(i0 + BLOCK_I).min(m) {
                    let ci = &mut c.data[i * c.ld + j0..i * c.ld + j1];
                    for p in p0..p1 {
                        let aip = a.at(i, p);
                        if b.cs == 1 {
                            let bp = &b.data[p * b.rs + j0..p * b.rs + j1];
                            for (cv, &bv) in ci.iter_mut().zip(bp) {
                                *cv += aip * bv;
                            }
                        } else {
                            for (jj, cv) in ci.iter_mut().enumerate() {
                                *cv += aip * b.at(p, j0 + jj);
                            }
                        }
                    }
                }
            }
        }
    }
}
