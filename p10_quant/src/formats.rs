//! GGUF's block formats as types, byte for byte as ggml lays them out: 32
//! weights per block, an f16 scale (and for Q4_1 an f16 minimum), then the
//! quantised values.
//!
//! | type | bytes | layout | value of element j |
//! |---|---|---|---|
//! | Q8_0 | 34 | f16 d, i8 qs[32] | d · qs[j] |
//! | Q4_0 | 18 | f16 d, u8 qs[16] | d · (nib_j − 8) |
//! | Q4_1 | 20 | f16 d, f16 m, u8 qs[16] | d · nib_j + m |
//! | Q8_1 | 36 | f16 d, f16 s, i8 qs[32] | d · qs[j]; s = d · Σ qs (activations only) |
//!
//! In the 4-bit types, byte j holds element j in its low nibble and element
//! j + 16 in its high one. The quantisers follow ggml's reference ones
//! (`quantize_row_*_ref`), which gguf-py mirrors; `tests/formats.rs` checks
//! both directions against gguf-py's output byte for byte.

use half::f16;

/// Weights per block.
pub const QK: usize = 32;

fn h(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

/// An f16 stored as its bits, as f32.
#[inline]
pub fn f(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// One block format: its bytes, and the reference quantiser and dequantiser.
pub trait Block: Copy + Default + Send + Sync + std::fmt::Debug + 'static {
    /// ggml's name and type id.
    const NAME: &'static str;
    const BYTES: usize;
    /// Read one block from exactly `BYTES` bytes.
    fn read(b: &[u8]) -> Self;
    fn write(&self, out: &mut Vec<u8>);
    fn quantize(x: &[f32; QK]) -> Self;
    fn dequantize(&self, out: &mut [f32; QK]);
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockQ8_0 {
    pub d: u16,
    pub qs: [i8; QK],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockQ4_0 {
    pub d: u16,
    pub qs: [u8; QK / 2],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockQ4_1 {
    pub d: u16,
    pub m: u16,
    pub qs: [u8; QK / 2],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockQ8_1 {
    pub d: u16,
    /// d · Σ qs: lets a Q4_1 dot product add the weights' minimum once per block.
    pub s: u16,
    pub qs: [i8; QK],
}

// The sizes ggml asserts (static_assert in ggml-common.h).
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);
const _: () = assert!(std::mem::size_of::<BlockQ8_1>() == 36);

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

/// (max |x|, the x where it is reached) of a block.
fn abs_max(x: &[f32; QK]) -> (f32, f32) {
    x.iter().fold((0.0f32, 0.0f32), |(a, v), &e| {
        if e.abs() > a {
            (e.abs(), e)
        } else {
            (a, v)
        }
    })
}

/// Symmetric 8-bit: d = max|x| / 127, q = round(x / d) (C's `roundf`,
/// halves away from zero).
fn q8(x: &[f32; QK]) -> (f32, [i8; QK]) {
    let (amax, _) = abs_max(x);
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; QK];
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
    (d, qs)
}

impl Block for BlockQ8_0 {
    const NAME: &'static str = "Q8_0";
    const BYTES: usize = 34;

    fn read(b: &[u8]) -> Self {
        let mut qs = [0i8; QK];
        for (q, &v) in qs.iter_mut().zip(&b[2..34]) {
            *q = v as i8;
        }
        BlockQ8_0 {
            d: u16_at(b, 0),
            qs,
        }
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend(self.qs.iter().map(|&q| q as u8));
    }

    fn quantize(x: &[f32; QK]) -> Self {
        let (d, qs) = q8(x);
        BlockQ8_0 { d: h(d), qs }
    }

    fn dequantize(&self, out: &mut [f32; QK]) {
        let d = f(self.d);
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = d * q as f32;
        }
    }
}

impl Block for BlockQ8_1 {
    const NAME: &'static str = "Q8_1";
    const BYTES: usize = 36;

    fn read(b: &[u8]) -> Self {
        let mut qs = [0i8; QK];
        for (q, &v) in qs.iter_mut().zip(&b[4..36]) {
            *q = v as i8;
        }
        BlockQ8_1 {
            d: u16_at(b, 0),
            s: u16_at(b, 2),
            qs,
        }
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend_from_slice(&self.s.to_le_bytes());
        out.extend(self.qs.iter().map(|&q| q as u8));
    }

    fn quantize(x: &[f32; QK]) -> Self {
        let (d, qs) = q8(x);
        let sum: i32 = qs.iter().map(|&q| q as i32).sum();
        BlockQ8_1 {
            d: h(d),
            s: h(sum as f32 * d),
            qs,
        }
    }

    fn dequantize(&self, out: &mut [f32; QK]) {
        let d = f(self.d);
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = d * q as f32;
        }
    }
}

impl Block for BlockQ4_0 {
    const NAME: &'static str = "Q4_0";
    const BYTES: usize = 18;

    fn read(b: &[u8]) -> Self {
        let mut qs = [0u8; QK / 2];
        qs.copy_from_slice(&b[2..18]);
        BlockQ4_0 {
            d: u16_at(b, 0),
            qs,
        }
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend_from_slice(&self.qs);
    }

    /// d = (the x of largest magnitude) / −8, so that x maps to −8 exactly
    /// and the other end of the range gets 7 steps.
    fn quantize(x: &[f32; QK]) -> Self {
        let (_, max) = abs_max(x);
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        // ggml's reference compiles to a fused multiply-add here (one
        // rounding); gguf-py reproduces that, and so must we.
        let nib = |v: f32| (v.mul_add(id, 8.5) as i32).clamp(0, 15) as u8;
        let mut qs = [0u8; QK / 2];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = nib(x[j]) | (nib(x[j + QK / 2]) << 4);
        }
        BlockQ4_0 { d: h(d), qs }
    }

    fn dequantize(&self, out: &mut [f32; QK]) {
        let d = f(self.d);
        for (j, &q) in self.qs.iter().enumerate() {
            out[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
            out[j + QK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}

impl Block for BlockQ4_1 {
    const NAME: &'static str = "Q4_1";
    const BYTES: usize = 20;

    fn read(b: &[u8]) -> Self {
        let mut qs = [0u8; QK / 2];
        qs.copy_from_slice(&b[4..20]);
        BlockQ4_1 {
            d: u16_at(b, 0),
            m: u16_at(b, 2),
            qs,
        }
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend_from_slice(&self.m.to_le_bytes());
        out.extend_from_slice(&self.qs);
    }

    /// d = (max − min) / 15, m = min, nib = round-half-up((x − min) / d).
    fn quantize(x: &[f32; QK]) -> Self {
        let min = x.iter().copied().fold(f32::INFINITY, f32::min);
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let nib = |v: f32| (((v - min) * id + 0.5) as i32).min(15) as u8;
        let mut qs = [0u8; QK / 2];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = nib(x[j]) | (nib(x[j + QK / 2]) << 4);
        }
        BlockQ4_1 {
            d: h(d),
            m: h(min),
            qs,
        }
    }

    fn dequantize(&self, out: &mut [f32; QK]) {
        let (d, m) = (f(self.d), f(self.m));
        for (j, &q) in self.qs.iter().enumerate() {
            out[j] = (q & 0x0f) as f32 * d + m;
            out[j + QK / 2] = (q >> 4) as f32 * d + m;
        }
    }
}

/// Why a row cannot be (de)quantised.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    #[error("a row of {len} values is not a whole number of {QK}-value blocks")]
    Ragged { len: usize },
    #[error("{format}: {len} bytes is not a whole number of {block}-byte blocks")]
    Bytes {
        format: &'static str,
        len: usize,
        block: usize,
    },
    #[error("{blocks} blocks hold {} values, the output has {out}", blocks * QK)]
    Output { blocks: usize, out: usize },
}

/// Quantise `x` (a whole number of blocks) into `out` (cleared first).
pub fn quantize_row_into<B: Block>(x: &[f32], out: &mut Vec<B>) -> Result<(), FormatError> {
    if !x.len().is_multiple_of(QK) {
        return Err(FormatError::Ragged { len: x.len() });
    }
    out.clear();
    out.extend(x.chunks_exact(QK).map(|c| {
        let mut a = [0.0f32; QK];
        a.copy_from_slice(c);
        B::quantize(&a)
    }));
    Ok(())
}

pub fn quantize_row<B: Block>(x: &[f32]) -> Result<Vec<B>, FormatError> {
    let mut out = Vec::with_capacity(x.len() / QK);
    quantize_row_into(x, &mut out)?;
    Ok(out)
}

pub fn dequantize_row<B: Block>(blocks: &[B], out: &mut [f32]) -> Result<(), FormatError> {
    if out.len() != blocks.len() * QK {
        return Err(FormatError::Output {
            blocks: blocks.len(),
            out: out.len(),
        });
    }
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let mut a = [0.0f32; QK];
        b.dequantize(&mut a);
        o.copy_from_slice(&a);
    }
    Ok(())
}

/// Blocks from bytes laid out as in a GGUF file.
pub fn read_blocks<B: Block>(bytes: &[u8]) -> Result<Vec<B>, FormatError> {
    if !bytes.len().is_multiple_of(B::BYTES) {
        return Err(FormatError::Bytes {
            format: B::NAME,
            len: bytes.len(),
            block: B::BYTES,
        });
    }
    Ok(bytes.chunks_exact(B::BYTES).map(B::read).collect())
}

/// The bytes of `blocks` as a GGUF file lays them out.
pub fn write_blocks<B: Block>(blocks: &[B]) -> Vec<u8> {
    let mut out = Vec::with_capacity(blocks.len() * B::BYTES);
    for b in blocks {
        b.write(&mut out);
    }
    out
}
