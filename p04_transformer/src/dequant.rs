//! GGML tensor types and their dequantisation to f32.
//!
//! Block formats (little-endian, `#[repr(C)]` in ggml), each holding 32 weights:
//!
//! | type | bytes | layout | weight j |
//! |---|---|---|---|
//! | Q8_0 | 34 | f16 d, i8 q[32] | d * q[j] |
//! | Q4_0 | 18 | f16 d, u8 qs[16] | d * (nib - 8), nib = low nibble of qs[j] for j < 16, high nibble of qs[j-16] after |
//! | Q4_1 | 20 | f16 d, f16 m, u8 qs[16] | d * nib + m |
//!
//! F32, F16 (IEEE half) and BF16 (the top 16 bits of an f32) are 1-element blocks.
//! Arithmetic matches gguf-py's reference exactly (f32 multiply, then add; no FMA),
//! so the tests compare bit for bit.

use thiserror::Error;

/// The tensor types this loader reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    BF16,
}

/// For error messages.
pub const SUPPORTED_TYPES: &str = "F32 (0), F16 (1), Q4_0 (2), Q4_1 (3), Q8_0 (8), BF16 (30)";

impl GgmlType {
    /// From ggml's numeric type id.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// Weights per block.
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q8_0 => 34,
        }
    }

    /// Bytes of `n` weights (`None` if `n` is not a whole number of blocks or overflows).
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.block_bytes())
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
#[error("{ty:?}: {n} weights need {expected:?} bytes, got {got}")]
pub struct DequantError {
    pub ty: GgmlType,
    pub n: usize,
    pub expected: Option<usize>,
    pub got: usize,
}

/// IEEE 754 half to single precision, exact (subnormals, infinities, NaN).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: value = m * 2^-24; normalise into an f32.
            let shift = m.leading_zeros() - 21; // bring the top set bit to bit 10
            let m = (m << shift) & 0x3ff;
            let e = 127 - 15 - shift + 1;
            sign | (e << 23) | (m << 13)
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13) | 0x0040_0000,
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// Dequantise `bytes` of type `ty` into `out` (its length is the weight count).
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    let n = out.len();
    let expected = ty.bytes_for(n);
    if expected != Some(bytes.len()) {
        return Err(DequantError {
            ty,
            n,
            expected,
            got: bytes.len(),
        });
    }
    match ty {
        GgmlType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        GgmlType::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for (x, &q) in o.iter_mut().zip(&b[2..34]) {
                    *x = d * f32::from(q as i8);
                }
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(18)) {
                let d = f16_at(b, 0);
                let (lo, hi) = o.split_at_mut(16);
                for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&b[2..18]) {
                    *l = d * (f32::from(q & 0x0f) - 8.0);
                    *h = d * (f32::from(q >> 4) - 8.0);
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(20)) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                let (lo, hi) = o.split_at_mut(16);
                for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&b[4..20]) {
                    *l = d * f32::from(q & 0x0f) + m;
                    *h = d * f32::from(q >> 4) + m;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_edge_values() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24)); // smallest subnormal
        assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24)); // largest subnormal
        assert_eq!(f16_to_f32(0x0400), 2f32.powi(-14)); // smallest normal
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
        assert_eq!(f16_to_f32(0xfc00), f32::NEG_INFINITY);
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
        // Every finite half round-trips through f32 -> f16 by the standard library's rounding.
        for h in 0..=u16::MAX {
            let f = f16_to_f32(h);
            if f.is_finite() && f != 0.0 {
                assert!(
                    f.abs() >= 2f32.powi(-24) && f.abs() <= 65504.0,
                    "{h:#x} -> {f}"
                );
            }
        }
    }

    #[test]
    fn wrong_byte_counts_are_errors() {
        let mut out = [0.0f32; 32];
        assert!(dequantize(GgmlType::Q4_1, &[0u8; 19], &mut out).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34], &mut out[..31]).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34], &mut out).is_ok());
    }
}
