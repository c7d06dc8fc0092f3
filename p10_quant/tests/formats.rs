//! The block formats against gguf-py (fixtures by
//! `scripts/export_p10_quants.py`): our quantisers write the same bytes,
//! our dequantisers read the same values, bit for bit.

use p10_quant::formats::{
    dequantize_row, quantize_row, read_blocks, write_blocks, Block, BlockQ4_0, BlockQ4_1,
    BlockQ8_0, BlockQ8_1, FormatError, QK,
};
use safetensors::SafeTensors;

fn fixtures() -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/quants.safetensors");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn f32s(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap();
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn check<B: Block>(st: &SafeTensors<'_>, case: &str) -> usize {
    let x = f32s(st, &format!("{case}/input"));
    let want_bytes = st
        .tensor(&format!("{case}/{}/bytes", B::NAME))
        .unwrap()
        .data()
        .to_vec();
    let want = f32s(st, &format!("{case}/{}/dequant", B::NAME));
    let ours: Vec<B> = quantize_row(&x).unwrap();
    let bytes = write_blocks(&ours);
    assert_eq!(bytes.len(), want_bytes.len(), "{case} {}", B::NAME);
    if let Some(i) = (0..bytes.len()).find(|&i| bytes[i] != want_bytes[i]) {
        panic!(
            "{case} {}: byte {i} (block {}) differs: ours {:?}, gguf-py {:?}",
            B::NAME,
            i / B::BYTES,
            ours[i / B::BYTES],
            read_blocks::<B>(&want_bytes[i / B::BYTES * B::BYTES..][..B::BYTES]).unwrap()[0]
        );
    }
    let mut back = vec![0.0f32; x.len()];
    dequantize_row(&read_blocks::<B>(&want_bytes).unwrap(), &mut back).unwrap();
    for (i, (a, b)) in back.iter().zip(&want).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "{case} {}: value {i}: {a} vs {b}",
            B::NAME
        );
    }
    x.len()
}

#[test]
fn quantisers_and_dequantisers_match_gguf_py_bit_for_bit() {
    let bytes = fixtures();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut n = 0;
    for case in [
        "normal",
        "uniform_wide",
        "tiny",
        "positive",
        "negative",
        "hard",
    ] {
        n += check::<BlockQ8_0>(&st, case);
        n += check::<BlockQ4_0>(&st, case);
        n += check::<BlockQ4_1>(&st, case);
    }
    assert_eq!(n, 3 * 20 * 256);
}

#[test]
fn q8_1_is_q8_0_plus_the_scaled_sum() {
    let bytes = fixtures();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let x = f32s(&st, "normal/input");
    let a: Vec<BlockQ8_0> = quantize_row(&x).unwrap();
    let b: Vec<BlockQ8_1> = quantize_row(&x).unwrap();
    for (a, b) in a.iter().zip(&b) {
        assert_eq!((a.d, a.qs), (b.d, b.qs));
        let sum: i32 = b.qs.iter().map(|&q| q as i32).sum();
        let d = half::f16::from_bits(b.d).to_f32();
        // s is d · Σq computed with the unrounded d, then rounded to f16.
        let s = half::f16::from_bits(b.s).to_f32();
        assert!((s - d * sum as f32).abs() <= (d * sum as f32).abs() * 2e-3 + 1e-6);
    }
    // Bytes round-trip.
    let back: Vec<BlockQ8_1> = read_blocks(&write_blocks(&b)).unwrap();
    assert_eq!(back, b);
}

#[test]
fn bad_lengths_are_errors_not_panics() {
    assert_eq!(
        quantize_row::<BlockQ4_1>(&[0.0; 33]).unwrap_err(),
        FormatError::Ragged { len: 33 }
    );
    assert!(matches!(
        read_blocks::<BlockQ4_1>(&[0u8; 21]),
        Err(FormatError::Bytes { len: 21, .. })
    ));
    let blocks = vec![BlockQ8_0::default(); 2];
    assert!(dequantize_row(&blocks, &mut [0.0; 3 * QK]).is_err());
}
