//! AVX-512 weight expansion for the f32 prefill path (the dot products
//! are the tile kernels of `avx512_tile.rs`): Q4_1 and Q8_0 blocks to f32,
//! 16 values per instruction, and Q4_1 straight into Project 02's packed
//! sliver with a 16 × 16 transpose in registers.

use std::arch::x86_64::*;

use crate::formats::{BlockQ4_1, BlockQ8_0};

/// Two blocks' f16 words (`hi:lo` pairs) as [a.lo, a.hi, b.lo, b.hi] in f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn f16x4(a: u32, b: u32) -> __m128 {
    _mm_cvtph_ps(_mm_set_epi32(0, 0, b as i32, a as i32))
}

#[inline(always)]
fn word(lo: u16, hi: u16) -> u32 {
    lo as u32 | (hi as u32) << 16
}

/// Expand Q4_1 blocks to f32 (`out`: 32 per block), 16 values per
/// instruction where the AVX2 version does 8: per block, the low and high
/// nibbles widened to 16 i32 each, converted, and d·q + m fused (so equal
/// to the AVX2 expansion, within an ulp of the scalar reference).
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL, AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub unsafe fn expand_q4_1(b: &[BlockQ4_1], out: &mut [f32]) {
    let low = _mm_set1_epi8(0x0f);
    for (blk, o) in b.iter().zip(out.chunks_exact_mut(32)) {
        let dm = f16x4(word(blk.d, blk.m), 0);
        let (d, m) = (
            _mm512_broadcastss_ps(dm),
            _mm512_broadcastss_ps(_mm_movehdup_ps(dm)),
        );
        // SAFETY: `qs` is 16 readable bytes; the load is unaligned.
        let q = unsafe { _mm_loadu_si128(blk.qs.as_ptr().cast()) };
        let halves = [
            _mm_and_si128(q, low),
            _mm_and_si128(_mm_srli_epi16::<4>(q), low),
        ];
        for (h, nib) in halves.into_iter().enumerate() {
            let v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nib)), d, m);
            // SAFETY: `o` has 32 floats; this writes 16 at 16·h, h < 2.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(16 * h), v) };
        }
    }
}

/// Expand Q8_0 blocks to f32 (as [`expand_q4_1`]; d·q is one rounding, as
/// the AVX2 version's fused d·q + 0).
///
/// # Safety
/// As [`expand_q4_1`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub unsafe fn expand_q8_0(b: &[BlockQ8_0], out: &mut [f32]) {
    for (blk, o) in b.iter().zip(out.chunks_exact_mut(32)) {
        let d = _mm512_broadcastss_ps(f16x4(blk.d as u32, 0));
        for h in 0..2 {
            // SAFETY: `qs` is 32 readable bytes; this loads 16 at 16·h.
            let q = unsafe { _mm_loadu_si128(blk.qs.as_ptr().add(16 * h).cast()) };
            let v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
            // SAFETY: `o` has 32 floats; this writes 16 at 16·h, h < 2.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(16 * h), v) };
        }
    }
}

/// A 16 × 16 block of f32 transposed in registers: v[r] lane c becomes
/// v[c] lane r. Four stages of 16 shuffles: floats of row pairs, 64-bit
/// pairs of row quads, then 128-bit lanes across the quads.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn transpose16(v: &mut [__m512; 16]) {
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    let pd = _mm512_castps_pd;
    let ps = _mm512_castpd_ps;
    // u[4g + j], lane l: column 4l + j of rows 4g..4g + 4.
    let mut u = [_mm512_setzero_ps(); 16];
    for g in 0..4 {
        let (a0, a1, a2, a3) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
        u[4 * g] = ps(_mm512_unpacklo_pd(pd(a0), pd(a2)));
        u[4 * g + 1] = ps(_mm512_unpackhi_pd(pd(a0), pd(a2)));
        u[4 * g + 2] = ps(_mm512_unpacklo_pd(pd(a1), pd(a3)));
        u[4 * g + 3] = ps(_mm512_unpackhi_pd(pd(a1), pd(a3)));
    }
    // Row 4l + j of the result: lane l of u[j], u[4 + j], u[8 + j], u[12 + j].
    for j in 0..4 {
        let (a, b, c, d) = (u[j], u[4 + j], u[8 + j], u[12 + j]);
        let ab_lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b);
        let ab_hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b);
        let cd_lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(c, d);
        let cd_hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(c, d);
        v[j] = _mm512_shuffle_f32x4::<0b10_00_10_00>(ab_lo, cd_lo);
        v[4 + j] = _mm512_shuffle_f32x4::<0b11_01_11_01>(ab_lo, cd_lo);
        v[8 + j] = _mm512_shuffle_f32x4::<0b10_00_10_00>(ab_hi, cd_hi);
        v[12 + j] = _mm512_shuffle_f32x4::<0b11_01_11_01>(ab_hi, cd_hi);
    }
}

/// Rows j0..j0 + count of a Q4_1 matrix (`per` blocks a row), blocks
/// b0..b0 + nb of each, expanded straight into Project 02's packed sliver
/// of width nr: dst[p·nr + c] = W[j0 + c, 32·b0 + p], and 0 for
/// count ≤ c < nr. Per block column and 16 rows: each row's 16 low (then
/// high) nibbles expanded to one register (d·q + m fused, as
/// [`expand_q4_1`]), the 16 registers transposed, 16 stores. No row-major
/// scratch, no second pass.
///
/// # Safety
/// As [`expand_q4_1`]. (Ranges are checked: a bad one panics.)
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn expand_sliver_q4_1(
    w: &[BlockQ4_1],
    per: usize,
    j0: usize,
    count: usize,
    b0: usize,
    nb: usize,
    nr: usize,
    dst: &mut [f32],
) {
    assert!(nr.is_multiple_of(16) && count <= nr && b0 + nb <= per);
    assert!((j0 + count) * per <= w.len() && dst.len() >= 32 * nb * nr);
    let low = _mm_set1_epi8(0x0f);
    for g in (0..nr).step_by(16) {
        let live = count.saturating_sub(g).min(16);
        for bc in 0..nb {
            for half in 0..2 {
                let mut v = [_mm512_setzero_ps(); 16];
                for (r, v) in v.iter_mut().enumerate().take(live) {
                    let blk = &w[(j0 + g + r) * per + b0 + bc];
                    let dm = f16x4(word(blk.d, blk.m), 0);
                    let (d, m) = (
                        _mm512_broadcastss_ps(dm),
                        _mm512_broadcastss_ps(_mm_movehdup_ps(dm)),
                    );
                    // SAFETY: `qs` is 16 readable bytes; the load is unaligned.
                    let q = unsafe { _mm_loadu_si128(blk.qs.as_ptr().cast()) };
                    let nib = if half == 0 { q } else { _mm_srli_epi16::<4>(q) };
                    let nib = _mm_and_si128(nib, low);
                    *v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nib)), d, m);
                }
                transpose16(&mut v);
                for (kk, v) in v.into_iter().enumerate() {
                    let at = (32 * bc + 16 * half + kk) * nr + g;
                    // SAFETY: at + 16 ≤ (32·nb)·nr ≤ dst.len() (checked
                    // above; g + 16 ≤ nr).
                    unsafe { _mm512_storeu_ps(dst.as_mut_ptr().add(at), v) };
                }
            }
        }
    }
}
