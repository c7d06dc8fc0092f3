//! The AVX-512 tile kernels (see `tile.rs`, `panel.rs`): one group of 16
//! weight rows in the 16 lanes, up to 8 activation rows per tile. Per
//! block of the group:
//!
//! ```text
//!   d_w, m_w = the 16 rows' f16 scales, one load and convert each
//!   for each 64-byte line c of codes (4 for 4-bit codes, 8 for Q8_0):
//!     w = the line (4 codes of each row), unpacked once per tile
//!     for each activation row i:
//!       p_i += Σ in fours of w · broadcast(x_i's 4 codes of line c)    16 lanes
//!   for each activation row i:
//!     acc_i = fma(d_w · d_x, f32(p_i), acc_i)   (then fma(m_w, s_x, acc_i): Q4_1)
//! ```
//!
//! Two variants from one body, by how four u8 × i8 products are summed
//! into an i32 lane: `vnni` (`vpdpbusd`, one instruction; Q8_0's codes are
//! stored plus 128 as u8, and 128·Σx is taken off after) and `plain`
//! (`vpmaddubsw` to i16 pairs, summed over the block in i16, which 4-bit
//! codes cannot overflow, then `vpmaddwd` to i32; Q8_0 as |w| · (x with
//! w's sign), since 255 · 127 · 2 would saturate i16).

use std::arch::x86_64::*;
use std::ops::Range;

use crate::act::QRowRef;
use crate::panel::{Panels, GROUP};
use crate::tile::{bcast4, by_rows, check, Kind, OutRows};

/// Activation rows per tile: 8 float and 8 integer accumulators, the line
/// in flight and the scales fit the 32 registers.
const MR: usize = 8;

/// How far ahead the code lines are prefetched (64 lines: 4 KB, as the
/// row kernels' 256 blocks of 20 bytes were 5 KB).
const PREFETCH_LINES: usize = 64;

macro_rules! family {
    ($features:literal) => {
        use super::*;

        /// One tile: activation rows i0..i0 + MRT against group g, into
        /// out's columns c0..c0 + live.
        ///
        /// # Safety
        /// The CPU has this module's features; `check` passed and the tile
        /// lies inside the product.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn tile<const MRT: usize>(
            p: &Panels,
            g: usize,
            x: QRowRef<'_>,
            i0: usize,
            out: &OutRows,
            c0: usize,
            live: usize,
        ) {
            let per = p.per();
            let kind = p.kind();
            let low = _mm512_set1_epi8(0x0f);
            let mut acc = [_mm512_setzero_ps(); MRT];
            for b in 0..per {
                let lines = p.codes(g, b);
                let sc = p.scales(g, b);
                for k in 0..lines.len() {
                    let ahead = lines.as_ptr().wrapping_add(k + PREFETCH_LINES);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                }
                // SAFETY: a scale set is 16 f16 (32 bytes).
                let dw = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(sc[0].as_ptr().cast()) });
                let mw = match kind {
                    Kind::Q4_1 => {
                        // SAFETY: as above.
                        _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(sc[1].as_ptr().cast()) })
                    }
                    _ => _mm512_setzero_ps(),
                };
                let xb: [usize; MRT] = std::array::from_fn(|i| (i0 + i) * per + b);
                let mut pi = [_mm512_setzero_si512(); MRT];
                match kind {
                    Kind::Q4_1 | Kind::Q4_0 => {
                        let mut half = [_mm512_setzero_si512(); MRT];
                        for (c, line) in lines.iter().enumerate() {
                            // SAFETY: a line is 64 aligned bytes.
                            let raw = unsafe { _mm512_load_si512(line.0.as_ptr().cast()) };
                            let lo = _mm512_and_si512(raw, low);
                            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low);
                            for i in 0..MRT {
                                let q = &x.codes()[xb[i]];
                                let bl = _mm512_set1_epi32(bcast4(q, c));
                                let bh = _mm512_set1_epi32(bcast4(q, c + 4));
                                (pi[i], half[i]) = nibble_step(pi[i], half[i], lo, hi, bl, bh);
                            }
                        }
                        for i in 0..MRT {
                            pi[i] = nibble_sum(pi[i], half[i]);
                            if kind == Kind::Q4_0 {
                                let off = _mm512_set1_epi32(8 * x.sums()[xb[i]]);
                                pi[i] = _mm512_sub_epi32(pi[i], off);
                            }
                        }
                    }
                    Kind::Q8_0 => {
                        for (c, line) in lines.iter().enumerate() {
                            // SAFETY: a line is 64 aligned bytes.
                            let w = unsafe { _mm512_load_si512(line.0.as_ptr().cast()) };
                            for i in 0..MRT {
                                let bx = _mm512_set1_epi32(bcast4(&x.codes()[xb[i]], c));
                                pi[i] = q8_step(pi[i], w, bx);
                            }
                        }
                        for i in 0..MRT {
                            pi[i] = q8_sum(pi[i], x.sums()[xb[i]]);
                        }
                    }
                }
                for i in 0..MRT {
                    let [dx, sx] = x.scales()[xb[i]];
                    let s = _mm512_mul_ps(dw, _mm512_set1_ps(dx));
                    acc[i] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(pi[i]), acc[i]);
                    if kind == Kind::Q4_1 {
                        acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx), acc[i]);
                    }
                }
            }
            let mask = ((1u32 << live) - 1) as __mmask16;
            for (i, a) in acc.iter().enumerate() {
                let at = out.row_at(i0 + i, c0, live);
                // SAFETY: `row_at` checked that live values from `at` are
                // inside the output; masked-off lanes are not written.
                unsafe { _mm512_mask_storeu_ps(at, mask, *a) };
            }
        }

        /// y[i, r] for the rows of `groups` (see `tile.rs`; a shape that
        /// does not fit writes nothing).
        ///
        /// # Safety
        /// The CPU must have this module's features.
        #[target_feature(enable = $features)]
        pub unsafe fn tiles(p: &Panels, groups: Range<usize>, x: QRowRef<'_>, out: OutRows) {
            let Some(n) = check(p, &groups, x, &out) else {
                return;
            };
            for g in groups.clone() {
                let c0 = (g - groups.start) * GROUP;
                let live = GROUP.min(n - c0);
                for i0 in (0..out.m()).step_by(MR) {
                    // SAFETY: the features are this function's; `check`
                    // passed, and the tile is inside the product.
                    unsafe { by_rows!(MR.min(out.m() - i0), tile(p, g, x, i0, &out, c0, live)) }
                }
            }
        }
    };
}

/// AVX-512 F/BW/VL.
pub mod plain {
    family!("avx2,fma,f16c,avx512f,avx512bw,avx512vl");

    /// One line's low and high nibbles against their activation codes:
    /// i16 pair sums accumulated in `half` (16 products per i16 lane over
    /// a block, each ≤ 15·127: at most 30,480, no overflow).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    fn nibble_step(
        p: __m512i,
        half: __m512i,
        lo: __m512i,
        hi: __m512i,
        bl: __m512i,
        bh: __m512i,
    ) -> (__m512i, __m512i) {
        let h = _mm512_add_epi16(half, _mm512_maddubs_epi16(lo, bl));
        (p, _mm512_add_epi16(h, _mm512_maddubs_epi16(hi, bh)))
    }

    /// The block's i16 pair sums to one i32 per lane.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    fn nibble_sum(_p: __m512i, half: __m512i) -> __m512i {
        _mm512_madd_epi16(half, _mm512_set1_epi16(1))
    }

    /// One line of Q8_0 codes (stored plus 128) against 4 activation codes:
    /// |w| · (x with w's sign), summed to i32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    fn q8_step(p: __m512i, w: __m512i, bx: __m512i) -> __m512i {
        let ws = _mm512_xor_si512(w, _mm512_set1_epi8(-128));
        let neg = _mm512_movepi8_mask(ws);
        let xs = _mm512_mask_sub_epi8(bx, neg, _mm512_setzero_si512(), bx);
        let pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(ws), xs);
        _mm512_add_epi32(p, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))
    }

    /// The block's Σ w·x (already exact: no offset to take off).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    fn q8_sum(p: __m512i, _sum: i32) -> __m512i {
        p
    }
}

/// AVX-512 VNNI.
pub mod vnni {
    family!("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni");

    /// Low nibbles into `p`, high into `half` (two chains, half the latency).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    fn nibble_step(
        p: __m512i,
        half: __m512i,
        lo: __m512i,
        hi: __m512i,
        bl: __m512i,
        bh: __m512i,
    ) -> (__m512i, __m512i) {
        (
            _mm512_dpbusd_epi32(p, lo, bl),
            _mm512_dpbusd_epi32(half, hi, bh),
        )
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    fn nibble_sum(p: __m512i, half: __m512i) -> __m512i {
        _mm512_add_epi32(p, half)
    }

    /// One line of Q8_0 codes (w + 128 as u8) against 4 activation codes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    fn q8_step(p: __m512i, w: __m512i, bx: __m512i) -> __m512i {
        _mm512_dpbusd_epi32(p, w, bx)
    }

    /// Σ (w + 128)·x − 128·Σx = Σ w·x.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    fn q8_sum(p: __m512i, sum: i32) -> __m512i {
        _mm512_sub_epi32(p, _mm512_set1_epi32(128 * sum))
    }
}
