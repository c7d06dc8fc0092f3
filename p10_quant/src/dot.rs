//! Dot products of a quantised weight row with a quantised activation row:
//! integer multiply-adds inside each 32-value block, one float
//! multiply-add per block. A scalar reference (ggml's generic code,
//! transcribed), an AVX2 path (`avx2.rs`) and two AVX-512 paths
//! (`avx512.rs`, with and without VNNI), chosen at run time. The AVX-512
//! paths quantise activations with the AVX2 code, and expand weights for
//! prefill with their own.
//!
//! The kernels read activations as a [`QRow`] (the Q8 blocks' codes back
//! to back, their scales already in f32); the block-slice methods
//! (`q4_1_q8_1`, ...) convert and call them, for tests and one-off use.
//!
//! | weights | activations | per block |
//! |---|---|---|
//! | Q4_1 | Q8_1 | d_w·d_x·Σ nib·q + m_w·s_x (the minimum meets Σ q once) |
//! | Q4_0 | Q8_0 | d_w·d_x·Σ (nib − 8)·q |
//! | Q8_0 | Q8_0 | d_w·d_x·Σ q_w·q_x |

use crate::act::{ActFormat, QRow, QRowRef};
use crate::formats::{f, BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1, FormatError, QK};
use crate::isa::Isa;
use crate::panel::Panels;
use crate::tile::OutRows;
use std::ops::Range;

/// Why a kernel path cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the {0} kernels need CPU features this machine lacks")]
pub struct Unavailable(pub Isa);

/// The dot products of one instruction set. Only constructible for a path
/// the CPU has, so its safe methods can call the `unsafe` SIMD code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dot {
    isa: Isa,
}

/// One tile product on `dot`'s path (`tile.rs`): each module has a
/// function of the scalar reference's name and signature.
macro_rules! dispatch_tiles {
    ($dot:expr, $f:ident($($a:expr),*)) => {
        match $dot.isa {
            Isa::Scalar => crate::tile::reference($($a),*),
            // SAFETY: a `Dot` exists only for a path whose CPU features
            // this machine has (see `Dot::new`, `Isa::available`).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { crate::avx2_tile::$f($($a),*) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { crate::avx512_tile::plain::$f($($a),*) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => unsafe { crate::avx512_tile::vnni::$f($($a),*) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => crate::tile::reference($($a),*),
        }
    };
}

impl Dot {
    pub fn new(isa: Isa) -> Result<Dot, Unavailable> {
        if isa.is_available() {
            Ok(Dot { isa })
        } else {
            Err(Unavailable(isa))
        }
    }

    /// The widest path (see [`Isa::detect`]).
    pub fn detect() -> Dot {
        Dot { isa: Isa::detect() }
    }

    pub fn isa(self) -> Isa {
        self.isa
    }

    /// y[i, r] = dot(W[r], X[i]) for the weight rows of `groups` of `p`
    /// (16 a group; out's column 0 is row 16·groups.start) and the
    /// m = out.m() activation rows of `x` (p.per() blocks each): the
    /// integer kernel family (`tile.rs`), every output summed in one fixed
    /// order on every path, whatever m is. A shape that does not fit
    /// writes nothing.
    pub fn tiles(self, p: &Panels, groups: Range<usize>, x: QRowRef<'_>, out: OutRows) {
        dispatch_tiles!(self, tiles(p, groups, x, out))
    }

    /// One weight row against one activation row (Σ over the blocks of
    /// the shorter row): the tile family at m = n = 1, the row repacked
    /// first. For tests and one-off use; products go through
    /// [`crate::QuantMatrix`], which packs once.
    pub fn q4_1(self, w: &[BlockQ4_1], x: QRowRef<'_>) -> f32 {
        let per = w.len().min(x.len());
        self.one(&Panels::from_q4_1(&w[..per], 1, per), x)
    }

    pub fn q4_0(self, w: &[BlockQ4_0], x: QRowRef<'_>) -> f32 {
        let per = w.len().min(x.len());
        self.one(&Panels::from_q4_0(&w[..per], 1, per), x)
    }

    pub fn q8_0(self, w: &[BlockQ8_0], x: QRowRef<'_>) -> f32 {
        let per = w.len().min(x.len());
        self.one(&Panels::from_q8_0(&w[..per], 1, per), x)
    }

    /// The value of a one-row panel against x's first blocks.
    fn one(self, p: &Panels, x: QRowRef<'_>) -> f32 {
        let mut y = [0.0f32];
        if let Some(o) = OutRows::new(&mut y, 1, 1, 1) {
            self.tiles(p, 0..1, x.slice(0..p.per()), o);
        }
        y[0]
    }

    /// [`Dot::q4_1`] with the activations as GGUF blocks.
    pub fn q4_1_q8_1(self, w: &[BlockQ4_1], x: &[BlockQ8_1]) -> f32 {
        self.q4_1(w, QRow::from_q8_1(x).all())
    }

    pub fn q4_0_q8_0(self, w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f32 {
        self.q4_0(w, QRow::from_q8_0(x).all())
    }

    pub fn q8_0_q8_0(self, w: &[BlockQ8_0], x: &[BlockQ8_0]) -> f32 {
        self.q8_0(w, QRow::from_q8_0(x).all())
    }
}

impl Dot {
    /// Blocks to f32 (32 values per block into `out`), for the f32 GEMM of
    /// prefill. The SIMD paths round once per value (a fused multiply-add;
    /// AVX2 and AVX-512 give the same values), the scalar reference twice:
    /// they agree within an ulp.
    pub fn expand(self, blocks: &crate::matrix::BlocksRef<'_>, out: &mut [f32]) {
        use crate::formats::dequantize_row;
        use crate::matrix::BlocksRef;
        let n = out.len() / crate::formats::QK;
        match (self.isa, blocks) {
            // SAFETY: `Dot` exists for these paths only when the CPU has
            // their features (AVX-512 F/BW/VL with AVX2, FMA and F16C).
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512 | Isa::Avx512Vnni, BlocksRef::Q4_1(b)) => unsafe {
                crate::avx512::expand_q4_1(&b[..n.min(b.len())], out)
            },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512 | Isa::Avx512Vnni, BlocksRef::Q8_0(b)) => unsafe {
                crate::avx512::expand_q8_0(&b[..n.min(b.len())], out)
            },
            // SAFETY: as above (AVX2, FMA and F16C).
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, BlocksRef::Q4_1(b)) => unsafe {
                crate::avx2::expand_q4_1(&b[..n.min(b.len())], out)
            },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, BlocksRef::Q8_0(b)) => unsafe {
                crate::avx2::expand_q8_0(&b[..n.min(b.len())], out)
            },
            (_, BlocksRef::Q4_1(b)) => drop(dequantize_row(&b[..n.min(b.len())], out)),
            (_, BlocksRef::Q4_0(b)) => drop(dequantize_row(&b[..n.min(b.len())], out)),
            (_, BlocksRef::Q8_0(b)) => drop(dequantize_row(&b[..n.min(b.len())], out)),
        }
    }
}

impl Dot {
    /// Whether [`Dot::expand_sliver_q4_1`] has a fast path here (AVX-512:
    /// expansion and transpose in registers), so prefill should hand p02
    /// packed slivers rather than rows.
    pub fn expands_slivers(self) -> bool {
        matches!(self.isa, Isa::Avx512 | Isa::Avx512Vnni)
    }

    /// Rows j0..j0 + count of a Q4_1 matrix with `per` blocks a row, blocks
    /// b0..b0 + nb of each, into Project 02's packed sliver of width nr
    /// (`p02_matmul_bench::weight_rows::ProduceSliver`): dst[p·nr + c] =
    /// W[j0 + c, 32·b0 + p], 0 for count ≤ c < nr. Each value is d·q + m
    /// rounded once (fused), on every path, so the paths agree bit for bit.
    /// Panics if a range is outside `w` or `dst`.
    #[allow(clippy::too_many_arguments)]
    pub fn expand_sliver_q4_1(
        self,
        w: &[BlockQ4_1],
        per: usize,
        j0: usize,
        count: usize,
        b0: usize,
        nb: usize,
        nr: usize,
        dst: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if self.expands_slivers() && nr.is_multiple_of(16) {
            // SAFETY: a `Dot` exists only for a path this CPU has; the
            // kernel checks its ranges.
            unsafe { crate::avx512::expand_sliver_q4_1(w, per, j0, count, b0, nb, nr, dst) };
            return;
        }
        assert!(count <= nr && b0 + nb <= per && (j0 + count) * per <= w.len());
        let dst = &mut dst[..QK * nb * nr];
        for (p, d) in dst.chunks_exact_mut(nr).enumerate() {
            for (c, v) in d.iter_mut().enumerate() {
                *v = if c < count {
                    let blk = &w[(j0 + c) * per + b0 + p / QK];
                    let j = p % QK;
                    let q = if j < QK / 2 {
                        blk.qs[j] & 0x0f
                    } else {
                        blk.qs[j - QK / 2] >> 4
                    };
                    (q as f32).mul_add(f(blk.d), f(blk.m))
                } else {
                    0.0
                };
            }
        }
    }
}

impl Dot {
    /// Quantise activations (a whole number of 32-value blocks; several
    /// rows back to back give each row's blocks in turn) into `out` with
    /// this path. The SIMD quantiser (`avx2::quantize`, also used by the
    /// AVX-512 paths) gives the scalar reference's values bit for bit:
    /// the same maximum, divide and products, and `roundf`'s rounding.
    pub fn quantize(self, x: &[f32], format: ActFormat, out: &mut QRow) -> Result<(), FormatError> {
        if !x.len().is_multiple_of(QK) {
            return Err(FormatError::Ragged { len: x.len() });
        }
        let (codes, scales) = out.zeroed(x.len() / QK);
        match self.isa {
            // SAFETY: `Dot` exists for these paths only when the CPU has
            // AVX2, FMA and F16C; `zeroed` gave x.len() / 32 blocks.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 | Isa::Avx512Vnni => unsafe {
                crate::avx2::quantize(x, format, codes, scales)
            },
            _ => {
                for ((c, s), xb) in codes
                    .iter_mut()
                    .zip(scales.iter_mut())
                    .zip(x.chunks_exact(QK))
                {
                    let Ok(xb) = <&[f32; QK]>::try_from(xb) else {
                        continue;
                    };
                    use crate::formats::Block;
                    (*c, *s) = match format {
                        ActFormat::Q8_1 => crate::act::q8_1_parts(&BlockQ8_1::quantize(xb)),
                        ActFormat::Q8_0 => crate::act::q8_0_parts(&BlockQ8_0::quantize(xb)),
                    };
                }
            }
        }
        out.fill_sums();
        Ok(())
    }
}

/// The references: ggml's `ggml_vec_dot_*_generic`, one block at a time.
pub mod scalar {
    use super::*;

    pub fn q4_1_q8_1(w: &[BlockQ4_1], x: &[BlockQ8_1]) -> f32 {
        let mut sum = 0.0f32;
        for (w, x) in w.iter().zip(x) {
            let mut sumi = 0i32;
            for j in 0..16 {
                sumi += (w.qs[j] & 0x0f) as i32 * x.qs[j] as i32;
                sumi += (w.qs[j] >> 4) as i32 * x.qs[j + 16] as i32;
            }
            sum += f(w.d) * f(x.d) * sumi as f32 + f(w.m) * f(x.s);
        }
        sum
    }

    pub fn q4_0_q8_0(w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f32 {
        let mut sum = 0.0f32;
        for (w, x) in w.iter().zip(x) {
            let mut sumi = 0i32;
            for j in 0..16 {
                sumi += ((w.qs[j] & 0x0f) as i32 - 8) * x.qs[j] as i32;
                sumi += ((w.qs[j] >> 4) as i32 - 8) * x.qs[j + 16] as i32;
            }
            sum += sumi as f32 * (f(w.d) * f(x.d));
        }
        sum
    }

    pub fn q8_0_q8_0(w: &[BlockQ8_0], x: &[BlockQ8_0]) -> f32 {
        let mut sum = 0.0f32;
        for (w, x) in w.iter().zip(x) {
            let sumi: i32 =
                w.qs.iter()
                    .zip(&x.qs)
                    .map(|(&a, &b)| a as i32 * b as i32)
                    .sum();
            sum += sumi as f32 * (f(w.d) * f(x.d));
        }
        sum
    }

    /// The same sums over a [`QRow`]: each block's f32 scales are its f16
    /// ones exactly, so these equal the block versions bit for bit.
    pub mod row {
        use super::*;

        pub fn q4_1(w: &[BlockQ4_1], x: QRowRef<'_>) -> f32 {
            let mut sum = 0.0f32;
            for ((w, q), [d, s]) in w.iter().zip(x.codes()).zip(x.scales()) {
                let mut sumi = 0i32;
                for j in 0..16 {
                    sumi += (w.qs[j] & 0x0f) as i32 * q[j] as i32;
                    sumi += (w.qs[j] >> 4) as i32 * q[j + 16] as i32;
                }
                sum += f(w.d) * d * sumi as f32 + f(w.m) * s;
            }
            sum
        }

        pub fn q4_0(w: &[BlockQ4_0], x: QRowRef<'_>) -> f32 {
            let mut sum = 0.0f32;
            for ((w, q), [d, _]) in w.iter().zip(x.codes()).zip(x.scales()) {
                let mut sumi = 0i32;
                for j in 0..16 {
                    sumi += ((w.qs[j] & 0x0f) as i32 - 8) * q[j] as i32;
                    sumi += ((w.qs[j] >> 4) as i32 - 8) * q[j + 16] as i32;
                }
                sum += sumi as f32 * (f(w.d) * d);
            }
            sum
        }

        pub fn q4_1_into(w: &[BlockQ4_1], per: usize, x: QRowRef<'_>, out: &mut [f32]) {
            rows_into(w, per, out, |r| q4_1(r, x))
        }

        pub fn q4_0_into(w: &[BlockQ4_0], per: usize, x: QRowRef<'_>, out: &mut [f32]) {
            rows_into(w, per, out, |r| q4_0(r, x))
        }

        pub fn q8_0_into(w: &[BlockQ8_0], per: usize, x: QRowRef<'_>, out: &mut [f32]) {
            rows_into(w, per, out, |r| q8_0(r, x))
        }

        fn rows_into<B>(w: &[B], per: usize, out: &mut [f32], dot: impl Fn(&[B]) -> f32) {
            if per == 0 {
                out.fill(0.0);
                return;
            }
            for (row, o) in w.chunks_exact(per).zip(out) {
                *o = dot(row);
            }
        }

        pub fn q8_0(w: &[BlockQ8_0], x: QRowRef<'_>) -> f32 {
            let mut sum = 0.0f32;
            for ((w, q), [d, _]) in w.iter().zip(x.codes()).zip(x.scales()) {
                let sumi: i32 = w.qs.iter().zip(q).map(|(&a, &b)| a as i32 * b as i32).sum();
                sum += sumi as f32 * (f(w.d) * d);
            }
            sum
        }
    }
}
