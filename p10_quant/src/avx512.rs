//! The AVX-512 dot products: two 32-value blocks per 512-bit register, so
//! half the instructions per weight of the AVX2 path (`avx2.rs`), whose
//! one-block kernels finish an odd block count. Two variants from one body:
//!
//! - `plain` (AVX-512 F/BW/VL): `vpmaddubsw` (u8 × i8 → i16 pairs) then
//!   `vpmaddwd` with ones (→ i32 quads);
//! - `vnni` (AVX-512 VNNI): the two in one `vpdpbusd` (u8 × i8 summed in
//!   fours straight into i32; no i16 step, so no saturation either).
//!
//! Per pair of blocks (k = 64):
//!
//! ```text
//!   w   = [w0 lo | w0 hi | w1 lo | w1 hi] nibbles, 4 × 16 bytes   (u8 0..15)
//!   x   = [x0.qs          | x1.qs        ]                        (i8)
//!   p   = dot4(w, x): 16 i32 lanes, lanes 0..8 block 0, 8..16 block 1
//!   acc += [d_w0·d_x0 ×8 | d_w1·d_x1 ×8] · f32(p)
//! ```
//!
//! The blocks sit in the mapped file as GGUF lays them out (scales beside
//! their codes), so the two blocks' codes are gathered by two 128/256-bit
//! loads, and their four f16 scales by one `vcvtph2ps`.

use std::arch::x86_64::*;

use crate::formats::{BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1};

/// How many blocks ahead the weight loops prefetch (as the AVX2 path).
const PREFETCH: usize = 64;

/// `hi:lo` f16 pairs of four words, as eight f32: words a, b, c, d give
/// [a.lo, a.hi, b.lo, b.hi, c.lo, c.hi, d.lo, d.hi].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn f16x8(a: u32, b: u32, c: u32, d: u32) -> __m256 {
    _mm256_cvtph_ps(_mm_set_epi32(d as i32, c as i32, b as i32, a as i32))
}

/// Lane 0 of `p` in f32 lanes 0..8 and lane 2 in 8..16: one scale per block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn per_block(p: __m128) -> __m512 {
    let idx = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(p))
}

/// Two blocks' 16 nibble bytes as [a lo | a hi | b lo | b hi] (u8 0..15),
/// to meet two Q8 blocks' 32 codes each (values 0..16 then 16..32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn nibbles2(a: &[u8; 16], b: &[u8; 16]) -> __m512i {
    // SAFETY: `a` and `b` are 16 readable bytes each; the loads are unaligned.
    let ab = unsafe {
        _mm256_set_m128i(
            _mm_loadu_si128(b.as_ptr().cast()),
            _mm_loadu_si128(a.as_ptr().cast()),
        )
    };
    let z = _mm512_castsi256_si512(ab);
    // 128-bit lanes [a, a, b, b]; then lanes 1 and 3 (64-bit elements
    // 2, 3, 6, 7) shifted right by 4 for the high nibbles.
    let z = _mm512_shuffle_i64x2::<0b01_01_00_00>(z, z);
    let z = _mm512_mask_srli_epi64::<4>(z, 0b1100_1100, z);
    _mm512_and_si512(z, _mm512_set1_epi8(0x0f))
}

/// Two blocks' 32 codes each, side by side.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn codes2(a: &[i8; 32], b: &[i8; 32]) -> __m512i {
    // SAFETY: `a` and `b` are 32 readable bytes each; the loads are unaligned.
    let (lo, hi) = unsafe {
        (
            _mm256_loadu_si256(a.as_ptr().cast()),
            _mm256_loadu_si256(b.as_ptr().cast()),
        )
    };
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// x with the sign of w applied, and |w|: i8 × i8 as u8 × i8 (|q| ≤ 127).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn signed_pair(w: __m512i, x: __m512i) -> (__m512i, __m512i) {
    let neg = _mm512_movepi8_mask(w);
    let x = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
    (_mm512_abs_epi8(w), x)
}

#[inline(always)]
fn word(lo: u16, hi: u16) -> u32 {
    lo as u32 | (hi as u32) << 16
}

/// Horizontal sum of 16 f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn hsum(v: __m512) -> f32 {
    _mm512_reduce_add_ps(v)
}

/// The three products over pairs of blocks, for the module's `dot4` (Σ of
/// u8 × i8 in groups of four → 16 lanes, as f32), with an odd last block
/// left to AVX2.
macro_rules! kernels {
    ($features:literal) => {
        use super::*;

        /// # Safety
        /// The CPU must have the features this module is compiled for.
        #[target_feature(enable = $features)]
        pub unsafe fn q4_1_q8_1(w: &[BlockQ4_1], x: &[BlockQ8_1]) -> f32 {
            let n = w.len().min(x.len());
            let (pairs, ahead) = (n / 2, w.as_ptr());
            let mut acc = _mm512_setzero_ps();
            // Lanes 1 and 3 collect m_w · s_x.
            let mut mins = _mm_setzero_ps();
            for i in 0..pairs {
                let (w0, w1, x0, x1) = (&w[2 * i], &w[2 * i + 1], &x[2 * i], &x[2 * i + 1]);
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(2 * i + PREFETCH).cast());
                // [d_w0, m_w0, d_w1, m_w1, d_x0, s_x0, d_x1, s_x1]
                let s = f16x8(
                    word(w0.d, w0.m),
                    word(w1.d, w1.m),
                    word(x0.d, x0.s),
                    word(x1.d, x1.s),
                );
                let s = _mm_mul_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
                mins = _mm_add_ps(mins, s);
                let p = dot4(nibbles2(&w0.qs, &w1.qs), codes2(&x0.qs, &x1.qs));
                acc = _mm512_fmadd_ps(per_block(s), p, acc);
            }
            let mins = _mm_add_ss(
                _mm_movehdup_ps(mins),
                _mm_movehl_ps(mins, _mm_movehdup_ps(mins)),
            );
            let mut sum = hsum(acc) + _mm_cvtss_f32(mins);
            if n % 2 == 1 {
                // SAFETY: the CPU has AVX2, FMA and F16C (this function's features).
                sum += unsafe { crate::avx2::q4_1_q8_1(&w[n - 1..n], &x[n - 1..n]) };
            }
            sum
        }

        /// # Safety
        /// As [`q4_1_q8_1`].
        #[target_feature(enable = $features)]
        pub unsafe fn q4_0_q8_0(w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f32 {
            let n = w.len().min(x.len());
            let (pairs, ahead) = (n / 2, w.as_ptr());
            let mut acc = _mm512_setzero_ps();
            let eight = _mm512_set1_epi8(8);
            for i in 0..pairs {
                let (w0, w1, x0, x1) = (&w[2 * i], &w[2 * i + 1], &x[2 * i], &x[2 * i + 1]);
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(2 * i + PREFETCH).cast());
                let s = f16x8(w0.d as u32, w1.d as u32, x0.d as u32, x1.d as u32);
                let s = _mm_mul_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
                // Σ (nib − 8)·x = Σ nib·x − Σ 8·x: both u8 × i8.
                let (u, c) = (nibbles2(&w0.qs, &w1.qs), codes2(&x0.qs, &x1.qs));
                let p = _mm512_sub_ps(dot4(u, c), dot4(eight, c));
                acc = _mm512_fmadd_ps(per_block(s), p, acc);
            }
            let mut sum = hsum(acc);
            if n % 2 == 1 {
                // SAFETY: as in q4_1_q8_1.
                sum += unsafe { crate::avx2::q4_0_q8_0(&w[n - 1..n], &x[n - 1..n]) };
            }
            sum
        }

        /// # Safety
        /// As [`q4_1_q8_1`].
        #[target_feature(enable = $features)]
        pub unsafe fn q8_0_q8_0(w: &[BlockQ8_0], x: &[BlockQ8_0]) -> f32 {
            let n = w.len().min(x.len());
            let (pairs, ahead) = (n / 2, w.as_ptr());
            let mut acc = _mm512_setzero_ps();
            for i in 0..pairs {
                let (w0, w1, x0, x1) = (&w[2 * i], &w[2 * i + 1], &x[2 * i], &x[2 * i + 1]);
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(2 * i + PREFETCH).cast());
                let s = f16x8(w0.d as u32, w1.d as u32, x0.d as u32, x1.d as u32);
                let s = _mm_mul_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
                let (u, c) = signed_pair(codes2(&w0.qs, &w1.qs), codes2(&x0.qs, &x1.qs));
                acc = _mm512_fmadd_ps(per_block(s), dot4(u, c), acc);
            }
            let mut sum = hsum(acc);
            if n % 2 == 1 {
                // SAFETY: as in q4_1_q8_1.
                sum += unsafe { crate::avx2::q8_0_q8_0(&w[n - 1..n], &x[n - 1..n]) };
            }
            sum
        }
    };
}

/// AVX-512 F/BW/VL: `vpmaddubsw` + `vpmaddwd`. The pairs' i16 sums cannot
/// saturate: |w| ≤ 127 (or ≤ 15) and |x| ≤ 127 give |pair| ≤ 32,258.
pub mod plain {
    kernels!("avx2,fma,f16c,avx512f,avx512bw,avx512vl");

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    fn dot4(u: __m512i, s: __m512i) -> __m512 {
        let quads = _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
        _mm512_cvtepi32_ps(quads)
    }
}

/// AVX-512 VNNI: `vpdpbusd`.
pub mod vnni {
    kernels!("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni");

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    fn dot4(u: __m512i, s: __m512i) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s))
    }
}
