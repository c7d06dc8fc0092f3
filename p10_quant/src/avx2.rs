//! AVX2 helpers (x86-64 with AVX2, FMA and F16C) of the paths that are
//! not the tile kernels (`avx2_tile.rs`): activations quantised to 8 bits
//! (used by the AVX-512 paths too) and weights expanded to f32 for the f32
//! prefill path.

use std::arch::x86_64::*;

use crate::act::ActFormat;
use crate::formats::{BlockQ4_1, BlockQ8_0};

/// Two adjacent f16 (bits `lo`, `hi`) as lanes 0 and 1 of a vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16x2(lo: u16, hi: u16) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128((lo as u32 | (hi as u32) << 16) as i32))
}

/// 16 bytes of nibbles → 32 bytes: low nibbles (elements 0..16) in the low
/// lane, high nibbles (16..32) in the high lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibbles(qs: &[u8; 16]) -> __m256i {
    // SAFETY: `qs` is 16 readable bytes; the load is unaligned.
    let b = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    // [b >> 4 : b] in one register, then one 256-bit mask: 4 instructions, not 5.
    let both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load32(qs: &[i8; 32]) -> __m256i {
    // SAFETY: `qs` is 32 readable bytes; the load is unaligned.
    unsafe { _mm256_loadu_si256(qs.as_ptr().cast()) }
}

/// Four groups of 8 bytes of `q` (a 32-byte vector) as 8 floats each.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn store_expanded(q: __m256i, signed: bool, scale: __m256, offset: __m256, out: &mut [f32; 32]) {
    let lo = _mm256_castsi256_si128(q);
    let hi = _mm256_extracti128_si256(q, 1);
    for (i, part) in [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)]
        .into_iter()
        .enumerate()
    {
        let ints = if signed {
            _mm256_cvtepi8_epi32(part)
        } else {
            _mm256_cvtepu8_epi32(part)
        };
        let v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), scale, offset);
        // SAFETY: `out` has 32 floats; this writes 8 at 8·i, i < 4.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * i), v) };
    }
}

/// Expand Q4_1 blocks to f32 (`out`: 32 per block; fused multiply-add, so
/// within an ulp of the scalar reference).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn expand_q4_1(b: &[BlockQ4_1], out: &mut [f32]) {
    for (blk, o) in b.iter().zip(out.chunks_exact_mut(32)) {
        let dm = f16x2(blk.d, blk.m);
        let d = _mm256_broadcastss_ps(dm);
        let m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        if let Ok(o) = <&mut [f32; 32]>::try_from(o) {
            store_expanded(nibbles(&blk.qs), false, d, m, o);
        }
    }
}

/// Expand Q8_0 blocks to f32.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn expand_q8_0(b: &[BlockQ8_0], out: &mut [f32]) {
    for (blk, o) in b.iter().zip(out.chunks_exact_mut(32)) {
        let d = _mm256_broadcastss_ps(f16x2(blk.d, 0));
        if let Ok(o) = <&mut [f32; 32]>::try_from(o) {
            store_expanded(load32(&blk.qs), true, d, _mm256_setzero_ps(), o);
        }
    }
}

/// One block of activations quantised to 8 bits, as the scalar reference
/// does it (`formats::q8`), bit for bit: max |x| by `vmaxps` over the
/// absolute values (the same maximum as the scalar fold), the same f32
/// divide and reciprocal, the same products, and C's `roundf` (halves away
/// from zero) built from truncation: t = trunc(v), then t ± 1 where
/// |v − t| ≥ 0.5 (v − t is exact). Returns (d, the 32 values, Σ values).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q8_block(x: &[f32]) -> (f32, [i8; 32], i32) {
    debug_assert!(x.len() >= 32);
    // SAFETY: the caller passes at least 32 readable floats (one block);
    // the loads are unaligned.
    let v: [__m256; 4] = unsafe { std::array::from_fn(|i| _mm256_loadu_ps(x.as_ptr().add(8 * i))) };
    let sign = _mm256_set1_ps(-0.0);
    let abs = |a: __m256| _mm256_andnot_ps(sign, a);
    let m = _mm256_max_ps(
        _mm256_max_ps(abs(v[0]), abs(v[1])),
        _mm256_max_ps(abs(v[2]), abs(v[3])),
    );
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let idv = _mm256_set1_ps(id);
    let half = _mm256_set1_ps(0.5);
    let one = _mm256_set1_ps(1.0);
    let round = |a: __m256| {
        let p = _mm256_mul_ps(a, idv);
        let t = _mm256_round_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        let away = _mm256_cmp_ps(abs(_mm256_sub_ps(p, t)), half, _CMP_GE_OQ);
        // ±1 with p's sign where the fraction is at least a half.
        let step = _mm256_and_ps(away, _mm256_or_ps(one, _mm256_and_ps(p, sign)));
        _mm256_cvttps_epi32(_mm256_add_ps(t, step))
    };
    let q: [__m256i; 4] = std::array::from_fn(|i| round(v[i]));
    // i32 → i16 → i8 with saturation (|q| ≤ 127, so nothing saturates);
    // packs work per 128-bit lane, so the result is put back in order.
    let q16a = _mm256_packs_epi32(q[0], q[1]);
    let q16b = _mm256_packs_epi32(q[2], q[3]);
    let q8 = _mm256_packs_epi16(q16a, q16b);
    let q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    let mut qs = [0i8; 32];
    // SAFETY: `qs` is 32 writable bytes; the store is unaligned.
    unsafe { _mm256_storeu_si256(qs.as_mut_ptr().cast(), q8) };
    let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    (d, qs, _mm_cvtsi128_si32(s))
}

/// A row of activations quantised, block by block, into `codes` and
/// `scales` (one entry per block; `x` holds at least 32 per block). The
/// scales are stored as their f16 roundings (as the blocks would hold
/// them), in f32.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize(
    x: &[f32],
    format: ActFormat,
    codes: &mut [[i8; 32]],
    scales: &mut [[f32; 2]],
) {
    assert!(x.len() >= 32 * codes.len(), "quantize: short input row");
    let r = |v: f32| half::f16::from_f32(v).to_f32();
    for ((c, s), xb) in codes
        .iter_mut()
        .zip(scales.iter_mut())
        .zip(x.chunks_exact(32))
    {
        let (d, qs, sum) = q8_block(xb);
        *c = qs;
        *s = match format {
            ActFormat::Q8_1 => [r(d), r(sum as f32 * d)],
            ActFormat::Q8_0 => [r(d), 0.0],
        };
    }
}
