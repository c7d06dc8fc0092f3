//! The GGUF reader against the reference `gguf` package: a file written by
//! gguf-py's GGUFWriter (every metadata type, every tensor type we read), and
//! the real SmolLM2-135M-Instruct file. Dequantisation must match gguf-py bit
//! for bit.

use common::st;
use p04_transformer::{GgmlType, GgufFile, Value};

#[test]
fn tiny_file_written_by_gguf_py_reads_back_exactly() {
    let dir = p04_transformer::fixtures_dir();
    let f = GgufFile::open(dir.join("tiny_quant.gguf")).unwrap();
    let h = &f.header;
    assert_eq!(h.version, 3);
    assert_eq!(h.alignment, 32);
    let m = &h.metadata;
    assert_eq!(m["general.architecture"], Value::String("tinytest".into()));
    assert_eq!(m["test.u8"], Value::U8(200));
    assert_eq!(m["test.i8"], Value::I8(-100));
    assert_eq!(m["test.u16"], Value::U16(60000));
    assert_eq!(m["test.i16"], Value::I16(-30000));
    assert_eq!(m["test.u32"], Value::U32(4_000_000_000));
    assert_eq!(m["test.i32"], Value::I32(-2_000_000_000));
    assert_eq!(m["test.f32"], Value::F32(1.5));
    assert_eq!(m["test.bool"], Value::Bool(true));
    assert_eq!(m["test.string"], Value::String("héllo ✓".into()));
    assert_eq!(m["test.u64"], Value::U64((1 << 63) + 5));
    assert_eq!(m["test.i64"], Value::I64(-(1 << 62)));
    assert_eq!(m["test.f64"], Value::F64(-0.25));
    let strs = ["a", "bb", "Ġ t", ""]
        .map(|s| Value::String(s.into()))
        .to_vec();
    assert_eq!(m["test.array_str"], Value::Array(strs));
    assert_eq!(
        m["test.array_i32"],
        Value::Array(vec![Value::I32(1), Value::I32(-2), Value::I32(3)])
    );

    let expected = st::load(&dir.join("tiny_quant_expected.safetensors")).unwrap();
    let mut types = Vec::new();
    for (name, want) in &expected.tensors {
        let got = f.tensor_f32(name).unwrap();
        assert_eq!(got.shape(), want.shape(), "{name}");
        for (i, (g, w)) in got.data().iter().zip(want.data()).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{name}[{i}]: {g} vs gguf-py {w}");
        }
        types.push(h.tensor(name).unwrap().ty);
    }
    types.sort();
    use GgmlType::*;
    assert_eq!(types, vec![F32, F16, Q4_0, Q4_1, Q8_0, BF16]);
}

/// The real model, fetched through `scripts/fetch_assets.sh` (this test runs
/// the fetch, and fails with the command to run if it cannot).
#[test]
fn smollm2_gguf_metadata_and_dequantisation_match_gguf_py() {
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).unwrap_or_else(|e| panic!("{e}"));
    let f = GgufFile::open(&path).unwrap();
    let h = &f.header;
    assert_eq!(h.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(h.get_u64("llama.block_count").unwrap(), 30);
    assert_eq!(h.get_u64("llama.embedding_length").unwrap(), 576);
    assert_eq!(h.get_u64("llama.attention.head_count").unwrap(), 9);
    assert_eq!(h.get_u64("llama.attention.head_count_kv").unwrap(), 3);
    assert_eq!(h.get_u64("llama.feed_forward_length").unwrap(), 1536);
    assert_eq!(h.get_f64("llama.rope.freq_base").unwrap(), 100000.0);
    assert_eq!(h.tensors.len(), 272);
    match h.get("tokenizer.ggml.tokens").unwrap() {
        Value::Array(t) => assert_eq!(t.len(), 49152),
        other => panic!("tokens: {}", other.describe()),
    }
    assert!(
        h.get_u64("general.name").is_err(),
        "a string key read as an integer must be an error"
    );

    let expected =
        st::load(&p04_transformer::fixtures_dir().join("smollm2_dequant.safetensors")).unwrap();
    assert_eq!(expected.tensors.len(), 6);
    for (name, want) in &expected.tensors {
        let got = f.tensor_f32(name).unwrap();
        let rows = want.shape()[0];
        let cols = *got.shape().last().unwrap();
        assert_eq!(want.shape().last(), Some(&cols), "{name}");
        for (i, (g, w)) in got.data()[..rows * cols]
            .iter()
            .zip(want.data())
            .enumerate()
        {
            assert_eq!(g.to_bits(), w.to_bits(), "{name}[{i}]: {g} vs gguf-py {w}");
        }
    }
    assert_eq!(h.tensor("token_embd.weight").unwrap().ty, GgmlType::Q8_0);
    assert_eq!(
        h.tensor("token_embd.weight").unwrap().shape(),
        vec![49152, 576]
    );
}
