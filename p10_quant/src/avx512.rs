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
//!   x   = [x0 codes       | x1 codes     ]  one 64-byte load      (i8)
//!   p   = dot4(w, x): 16 i32 lanes, lanes 0..8 block 0, 8..16 block 1
//!   acc += [d_w0·d_x0 ×8 | d_w1·d_x1 ×8] · f32(p)
//! ```
//!
//! The weight blocks sit in the mapped file as GGUF lays them out (scales
//! beside their codes), so two blocks' nibbles take two 128-bit loads and
//! their four f16 scales one `vcvtph2ps`. The activations are a `QRow`:
//! two blocks' codes are one 64-byte load and their scales, f32 already,
//! one 16-byte load.

use std::arch::x86_64::*;

use crate::act::QRowRef;
use crate::formats::{BlockQ4_0, BlockQ4_1, BlockQ8_0};

/// How many blocks ahead the weight loops prefetch: 256 Q4_1 blocks are
/// 5 KB. The AVX2 path's 64 was chosen on an AMD EPYC; on the Xeon this
/// path was written on (300 MB L3, so the 96 MB of weights come from L3),
/// interleaved decode runs in one process gave, medians of 10 rounds of 3
/// × 128 tokens: 64 / 256 / 512 / 1,024 blocks → 117 / 132 / 131 / 125
/// tok/s (and 16 → 110 against 64 → 136 in a shorter run). The spread
/// between rounds was 105–177 tok/s: the choice is 256, not a precise peak.
const PREFETCH: usize = 256;

/// Two blocks' f16 words (`hi:lo` pairs) as [a.lo, a.hi, b.lo, b.hi] in f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn f16x4(a: u32, b: u32) -> __m128 {
    _mm_cvtph_ps(_mm_set_epi32(0, 0, b as i32, a as i32))
}

/// Two activation blocks' [d, s] as [d0, s0, d1, s1].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn scales2(s: &[[f32; 2]; 2]) -> __m128 {
    // SAFETY: two blocks' scales are 16 readable bytes; the load is unaligned.
    unsafe { _mm_loadu_ps(s.as_ptr().cast()) }
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

/// Two blocks' 32 codes each: 64 contiguous bytes of a `QRow`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn codes2(q: &[[i8; 32]; 2]) -> __m512i {
    // SAFETY: two blocks' codes are 64 readable bytes; the load is unaligned.
    unsafe { _mm512_loadu_si512(q.as_ptr().cast()) }
}

/// Two Q8_0 weight blocks' codes (34-byte blocks: two loads).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn weights8(a: &[i8; 32], b: &[i8; 32]) -> __m512i {
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

/// The whole pairs of blocks of a weight row and an activation row (the
/// shorter's length; an odd last block is left out), with each pair's index.
#[inline(always)]
#[allow(clippy::type_complexity)]
fn pairs<'a, B>(
    w: &'a [B],
    x: QRowRef<'a>,
) -> impl Iterator<Item = (usize, &'a [B; 2], &'a [[i8; 32]; 2], &'a [[f32; 2]; 2])> {
    let n = w.len().min(x.len()) & !1;
    let (w, q, s) = (&w[..n], &x.codes()[..n], &x.scales()[..n]);
    let (w, q, s) = (
        w.as_chunks::<2>().0,
        q.as_chunks::<2>().0,
        s.as_chunks::<2>().0,
    );
    w.iter()
        .zip(q)
        .zip(s)
        .enumerate()
        .map(|(i, ((w, q), s))| (i, w, q, s))
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

/// The three products over pairs of blocks, for the module's `dot4` (Σ of
/// u8 × i8 in groups of four → 16 lanes, as f32), with an odd last block
/// left to AVX2.
macro_rules! kernels {
    ($features:literal) => {
        use super::*;

        /// # Safety
        /// The CPU must have the features this module is compiled for.
        #[inline]
        #[target_feature(enable = $features)]
        pub unsafe fn q4_1(w: &[BlockQ4_1], x: QRowRef<'_>) -> f32 {
            let n = w.len().min(x.len());
            let mut acc = _mm512_setzero_ps();
            // Lanes 1 and 3 collect m_w · s_x.
            let mut mins = _mm_setzero_ps();
            let ahead = w.as_ptr();
            for (i, w, q, s) in pairs(&w[..n], x) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(2 * i + PREFETCH).cast());
                // [d_w0·d_x0, m_w0·s_x0, d_w1·d_x1, m_w1·s_x1]
                let s = _mm_mul_ps(
                    f16x4(word(w[0].d, w[0].m), word(w[1].d, w[1].m)),
                    scales2(s),
                );
                mins = _mm_add_ps(mins, s);
                let p = dot4(nibbles2(&w[0].qs, &w[1].qs), codes2(q));
                acc = _mm512_fmadd_ps(per_block(s), p, acc);
            }
            let mins = _mm_add_ss(
                _mm_movehdup_ps(mins),
                _mm_movehl_ps(mins, _mm_movehdup_ps(mins)),
            );
            let mut sum = hsum(acc) + _mm_cvtss_f32(mins);
            if n % 2 == 1 {
                // SAFETY: the CPU has AVX2, FMA and F16C (this function's features).
                sum += unsafe { crate::avx2::q4_1(&w[n - 1..n], x.slice(n - 1..n)) };
            }
            sum
        }

        /// # Safety
        /// As [`q4_1`].
        #[inline]
        #[target_feature(enable = $features)]
        pub unsafe fn q4_0(w: &[BlockQ4_0], x: QRowRef<'_>) -> f32 {
            let n = w.len().min(x.len());
            let mut acc = _mm512_setzero_ps();
            let eight = _mm512_set1_epi8(8);
            let ahead = w.as_ptr();
            for (i, w, q, s) in pairs(&w[..n], x) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(2 * i + PREFETCH).cast());
                let s = _mm_mul_ps(f16x4(w[0].d as u32, w[1].d as u32), scales2(s));
                // Σ (nib − 8)·x = Σ nib·x − Σ 8·x: both u8 × i8.
                let c = codes2(q);
                let p = _mm512_sub_ps(dot4(nibbles2(&w[0].qs, &w[1].qs), c), dot4(eight, c));
                acc = _mm512_fmadd_ps(per_block(s), p, acc);
            }
            let mut sum = hsum(acc);
            if n % 2 == 1 {
                // SAFETY: as in q4_1.
                sum += unsafe { crate::avx2::q4_0(&w[n - 1..n], x.slice(n - 1..n)) };
            }
            sum
        }

        /// # Safety
        /// As [`q4_1`].
        #[inline]
        #[target_feature(enable = $features)]
        pub unsafe fn q8_0(w: &[BlockQ8_0], x: QRowRef<'_>) -> f32 {
            let n = w.len().min(x.len());
            let mut acc = _mm512_setzero_ps();
            let ahead = w.as_ptr();
            for (i, w, q, s) in pairs(&w[..n], x) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(2 * i + PREFETCH).cast());
                let s = _mm_mul_ps(f16x4(w[0].d as u32, w[1].d as u32), scales2(s));
                let (u, c) = signed_pair(weights8(&w[0].qs, &w[1].qs), codes2(q));
                acc = _mm512_fmadd_ps(per_block(s), dot4(u, c), acc);
            }
            let mut sum = hsum(acc);
            if n % 2 == 1 {
                // SAFETY: as in q4_1.
                sum += unsafe { crate::avx2::q8_0(&w[n - 1..n], x.slice(n - 1..n)) };
            }
            sum
        }

        crate::avx2::into!($features, q4_1_into, q4_1, BlockQ4_1);
        crate::avx2::into!($features, q4_0_into, q4_0, BlockQ4_0);
        crate::avx2::into!($features, q8_0_into, q8_0, BlockQ8_0);
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
