//! The AVX2 tile kernels (see `tile.rs`, `panel.rs`): a group of 16 weight
//! rows as two halves of 8 lanes, up to 4 activation rows per tile. Per
//! block and half-group, as on AVX-512: each 32-byte half-line of codes
//! (4 codes of each of 8 rows) is unpacked once per tile and meets each
//! activation row's 4 codes broadcast; `maddubs` sums u8 × i8 in pairs to
//! i16 (4-bit codes: summed over the block in i16, at most 30,480),
//! `madd` with ones to i32; then d_w·d_x, a convert and a fused
//! multiply-add per 8 outputs. Q8_0's codes (stored plus 128) are turned
//! back into signed values and multiplied as |w| · (x with w's sign),
//! summed to i32 per line.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::act::QRowRef;
use crate::panel::{Panels, GROUP};
use crate::tile::{bcast4, by_rows, check, Kind, OutRows};

/// Activation rows per tile (16 registers: 4 float and 4 integer
/// accumulators, the half-line in flight, scales and broadcasts).
const MR: usize = 4;

/// Lanes of a 256-bit register of i32: half a group.
const HALF: usize = GROUP / 2;

/// How far ahead the code lines are prefetched (as on AVX-512).
const PREFETCH_LINES: usize = 64;

/// One tile: activation rows i0..i0 + MRT against half h of group g, into
/// out's columns c0..c0 + live.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `check` passed and the tile lies inside
/// the product.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const MRT: usize>(
    p: &Panels,
    g: usize,
    h: usize,
    x: QRowRef<'_>,
    i0: usize,
    out: &OutRows,
    c0: usize,
    live: usize,
) {
    let per = p.per();
    let kind = p.kind();
    let low = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); MRT];
    for b in 0..per {
        let lines = p.codes(g, b);
        let sc = p.scales(g, b);
        if h == 0 {
            for k in 0..lines.len() {
                _mm_prefetch::<_MM_HINT_T0>(lines.as_ptr().wrapping_add(k + PREFETCH_LINES).cast());
            }
        }
        // SAFETY: a scale set is 16 f16; this reads 8 at 8h.
        let dw = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(sc[0].as_ptr().add(HALF * h).cast()) });
        let mw = match kind {
            Kind::Q4_1 => {
                // SAFETY: as above.
                _mm256_cvtph_ps(unsafe { _mm_loadu_si128(sc[1].as_ptr().add(HALF * h).cast()) })
            }
            _ => _mm256_setzero_ps(),
        };
        let xb: [usize; MRT] = std::array::from_fn(|i| (i0 + i) * per + b);
        let mut pi = [_mm256_setzero_si256(); MRT];
        for (c, line) in lines.iter().enumerate() {
            // SAFETY: a line is 64 aligned bytes; this reads 32 at 32h.
            let raw = unsafe { _mm256_load_si256(line.0.as_ptr().add(32 * h).cast()) };
            match kind {
                Kind::Q4_1 | Kind::Q4_0 => {
                    let lo = _mm256_and_si256(raw, low);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low);
                    for i in 0..MRT {
                        let q = &x.codes()[xb[i]];
                        let bl = _mm256_set1_epi32(bcast4(q, c));
                        let bh = _mm256_set1_epi32(bcast4(q, c + 4));
                        let s = _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo, bl),
                            _mm256_maddubs_epi16(hi, bh),
                        );
                        pi[i] = _mm256_add_epi16(pi[i], s);
                    }
                }
                Kind::Q8_0 => {
                    let ws = _mm256_xor_si256(raw, _mm256_set1_epi8(-128));
                    let abs = _mm256_sign_epi8(ws, ws);
                    for i in 0..MRT {
                        let bx = _mm256_set1_epi32(bcast4(&x.codes()[xb[i]], c));
                        let pairs = _mm256_maddubs_epi16(abs, _mm256_sign_epi8(bx, ws));
                        pi[i] = _mm256_add_epi32(pi[i], _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
        }
        for i in 0..MRT {
            let p32 = match kind {
                Kind::Q4_1 => _mm256_madd_epi16(pi[i], ones),
                Kind::Q4_0 => {
                    let off = _mm256_set1_epi32(8 * x.sums()[xb[i]]);
                    _mm256_sub_epi32(_mm256_madd_epi16(pi[i], ones), off)
                }
                Kind::Q8_0 => pi[i],
            };
            let [dx, sx] = x.scales()[xb[i]];
            let s = _mm256_mul_ps(dw, _mm256_set1_ps(dx));
            acc[i] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(p32), acc[i]);
            if kind == Kind::Q4_1 {
                acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx), acc[i]);
            }
        }
    }
    let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(live as i32), lane);
    for (i, a) in acc.iter().enumerate() {
        let at = out.row_at(i0 + i, c0, live);
        // SAFETY: `row_at` checked that live values from `at` are inside
        // the output; masked-off lanes are not written.
        unsafe { _mm256_maskstore_ps(at, mask, *a) };
    }
}

/// y[i, r] for the rows of `groups` (see `tile.rs`; a shape that does not
/// fit writes nothing).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tiles(p: &Panels, groups: Range<usize>, x: QRowRef<'_>, out: OutRows) {
    let Some(n) = check(p, &groups, x, &out) else {
        return;
    };
    for g in groups.clone() {
        for h in 0..2 {
            let c0 = (g - groups.start) * GROUP + HALF * h;
            if c0 >= n {
                break;
            }
            let live = HALF.min(n - c0);
            for i0 in (0..out.m()).step_by(MR) {
                // SAFETY: the features are this function's; `check`
                // passed, and the tile is inside the product.
                unsafe { by_rows!(MR.min(out.m() - i0), tile(p, g, h, x, i0, &out, c0, live)) }
            }
        }
    }
}
