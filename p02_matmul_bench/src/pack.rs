//! Packing: copy a block of an operand (any strides) into the order the
//! micro-kernel reads it, so its k loop walks memory with unit stride and
//! every sliver is zero-padded to a full MR or NR.

use crate::mat::MatRef;

/// Pack A[i0..i0+mc, p0..p0+kc] into ceil(mc/mr) slivers, each (kc, mr):
/// out[(s*kc + p)*mr + r] = A[i0 + s*mr + r, p0 + p], zero past row mc.
pub(crate) fn pack_a(
    a: &MatRef,
    i0: usize,
    mc: usize,
    p0: usize,
    kc: usize,
    mr: usize,
    out: &mut [f32],
) {
    let slivers = mc.div_ceil(mr);
    assert!(out.len() >= slivers * kc * mr, "pack_a: buffer too small");
    for s in 0..slivers {
        let dst = &mut out[s * kc * mr..(s + 1) * kc * mr];
        let rows = mr.min(mc - s * mr);
        let ib = i0 + s * mr;
        if a.rs == 1 && a.cs != 1 {
            // A stored transposed: the mr values of one k are contiguous.
            for (p, d) in dst.chunks_exact_mut(mr).enumerate() {
                let start = (p0 + p) * a.cs + ib;
                d[..rows].copy_from_slice(&a.data[start..start + rows]);
                d[rows..].fill(0.0);
            }
            continue;
        }
        for r in 0..mr {
            if r < rows {
                let i = ib + r;
                if a.cs == 1 {
                    // Row-major A: read the row once, contiguously.
                    let src = &a.data[i * a.rs + p0..i * a.rs + p0 + kc];
                    for (d, &v) in dst.chunks_exact_mut(mr).zip(src) {
                        d[r] = v;
                    }
                } else {
                    for (p, d) in dst.chunks_exact_mut(mr).enumerate() {
                        d[r] = a.at(i, p0 + p);
                    }
                }
            } else {
                for d in dst.chunks_exact_mut(mr) {
                    d[r] = 0.0;
                }
            }
        }
    }
}

/// Pack B[p0..p0+kc, j0..j0+nc] into ceil(nc/nr) slivers, each (kc, nr):
/// out[(s*kc + p)*nr + j] = B[p0 + p, j0 + s*nr + j], zero past column nc.
/// `slivers` selects which slivers to write (for parallel packing).
#[allow(clippy::too_many_arguments)]
pub(crate) fn pack_b(
    b: &MatRef,
    p0: usize,
    kc: usize,
    j0: usize,
    nc: usize,
    nr: usize,
    slivers: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let first = slivers.start;
    for s in slivers {
        let dst = &mut out[(s - first) * kc * nr..(s - first + 1) * kc * nr];
        let cols = nr.min(nc - s * nr);
        let jb = j0 + s * nr;
        if b.rs == 1 && b.cs != 1 {
            // B = W^T with W rows contiguous (PyTorch weights): read each W row
            // once, contiguously, and scatter into the L1-resident sliver.
            for j in 0..cols {
                let start = (jb + j) * b.cs + p0;
                for (d, &v) in dst.chunks_exact_mut(nr).zip(&b.data[start..start + kc]) {
                    d[j] = v;
                }
            }
            for p in 0..kc {
                dst[p * nr + cols..(p + 1) * nr].fill(0.0);
            }
            continue;
        }
        for p in 0..kc {
            let d = &mut dst[p * nr..(p + 1) * nr];
            if b.cs == 1 {
                let start = (p0 + p) * b.rs + jb;
                d[..cols].copy_from_slice(&b.data[start..start + cols]);
            } else {
                for (j, v) in d[..cols].iter_mut().enumerate() {
                    *v = b.at(p0 + p, jb + j);
                }
            }
            d[cols..].fill(0.0);
        }
    }
}

/// One sliver of B = Wᵀ from NR rows of W (row stride `ld`):
/// dst[p·nr + c] = w[c·ld + p0 + p] for p < kc, c < nr. This transpose is
/// what packing a weight matrix costs; it runs in 8×8 tiles in AVX
/// registers where the CPU has them (and nr is a multiple of 8), in
/// [`transpose_sliver_scalar`] otherwise.
///
/// # Panics
/// If `w` lacks a value the sliver reads, p0 + kc > ld, or `dst` is
/// shorter than kc·nr. An empty sliver (nr or kc 0) writes nothing.
pub fn transpose_sliver(w: &[f32], ld: usize, p0: usize, kc: usize, nr: usize, dst: &mut [f32]) {
    check_sliver(w.len(), ld, p0, kc, nr, dst.len());
    if nr == 0 || kc == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if nr.is_multiple_of(8) && kc > 0 && is_x86_feature_detected!("avx") {
        // SAFETY: AVX is present; every index the tiles touch was checked
        // above (rows < nr, columns < p0 + kc, dst < kc·nr).
        unsafe { x86::transpose_sliver_avx(w, ld, p0, kc, nr, dst) };
        return;
    }
    transpose_checked(w, ld, p0, kc, nr, dst);
}

/// The reference for [`transpose_sliver`]: one value at a time.
pub fn transpose_sliver_scalar(
    w: &[f32],
    ld: usize,
    p0: usize,
    kc: usize,
    nr: usize,
    dst: &mut [f32],
) {
    check_sliver(w.len(), ld, p0, kc, nr, dst.len());
    if nr == 0 || kc == 0 {
        return;
    }
    transpose_checked(w, ld, p0, kc, nr, dst);
}

/// The scalar loop, once the sizes are checked and the sliver is not empty.
fn transpose_checked(w: &[f32], ld: usize, p0: usize, kc: usize, nr: usize, dst: &mut [f32]) {
    for (p, d) in dst[..kc * nr].chunks_exact_mut(nr).enumerate() {
        for (c, v) in d.iter_mut().enumerate() {
            *v = w[c * ld + p0 + p];
        }
    }
}

fn check_sliver(w: usize, ld: usize, p0: usize, kc: usize, nr: usize, dst: usize) {
    let last = nr
        .checked_sub(1)
        .and_then(|r| r.checked_mul(ld))
        .and_then(|o| o.checked_add(p0)?.checked_add(kc));
    assert!(
        nr == 0 || kc == 0 || last.is_some_and(|end| end <= w) && p0 + kc <= ld,
        "transpose_sliver: {nr} rows of stride {ld} from column {p0}, {kc} wide, need more than the {w} values given"
    );
    assert!(
        kc.checked_mul(nr).is_some_and(|n| n <= dst),
        "transpose_sliver: dst holds {dst} values, kc·nr = {kc}·{nr} needed"
    );
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// 8×8 tiles: eight rows of W loaded, transposed with unpack/shuffle/
    /// permute, stored as eight k-steps of the sliver; the last kc % 8
    /// columns one value at a time.
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn transpose_sliver_avx(
        w: &[f32],
        ld: usize,
        p0: usize,
        kc: usize,
        nr: usize,
        dst: &mut [f32],
    ) {
        let (src, out) = (w.as_ptr(), dst.as_mut_ptr());
        let full = kc - kc % 8;
        for c0 in (0..nr).step_by(8) {
            for p in (0..full).step_by(8) {
                // SAFETY: (the whole block) row c0 + i < nr and columns
                // p0 + p .. p0 + p + 8 ≤ p0 + kc lie inside `w`; stores go
                // to (p + j)·nr + c0 .. + 8 ≤ kc·nr, inside `dst` (checked
                // by the caller).
                unsafe {
                    let r = |i: usize| _mm256_loadu_ps(src.add((c0 + i) * ld + p0 + p));
                    let (r0, r1, r2, r3) = (r(0), r(1), r(2), r(3));
                    let (r4, r5, r6, r7) = (r(4), r(5), r(6), r(7));
                    let t0 = _mm256_unpacklo_ps(r0, r1);
                    let t1 = _mm256_unpackhi_ps(r0, r1);
                    let t2 = _mm256_unpacklo_ps(r2, r3);
                    let t3 = _mm256_unpackhi_ps(r2, r3);
                    let t4 = _mm256_unpacklo_ps(r4, r5);
                    let t5 = _mm256_unpackhi_ps(r4, r5);
                    let t6 = _mm256_unpacklo_ps(r6, r7);
                    let t7 = _mm256_unpackhi_ps(r6, r7);
                    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
                    let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
                    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
                    let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
                    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
                    let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
                    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
                    let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
                    let st = |j: usize, v: __m256| _mm256_storeu_ps(out.add((p + j) * nr + c0), v);
                    st(0, _mm256_permute2f128_ps::<0x20>(s0, s4));
                    st(1, _mm256_permute2f128_ps::<0x20>(s1, s5));
                    st(2, _mm256_permute2f128_ps::<0x20>(s2, s6));
                    st(3, _mm256_permute2f128_ps::<0x20>(s3, s7));
                    st(4, _mm256_permute2f128_ps::<0x31>(s0, s4));
                    st(5, _mm256_permute2f128_ps::<0x31>(s1, s5));
                    st(6, _mm256_permute2f128_ps::<0x31>(s2, s6));
                    st(7, _mm256_permute2f128_ps::<0x31>(s3, s7));
                }
            }
            for p in full..kc {
                for c in c0..c0 + 8 {
                    dst[p * nr + c] = w[c * ld + p0 + p];
                }
            }
        }
    }
}
