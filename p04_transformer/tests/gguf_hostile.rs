//! Hostile GGUF files: truncation at every byte, bit flips, huge counts,
//! overlapping tensors, bad alignment, bad types and dims. Each must give a
//! typed error, never a panic, and no allocation anywhere near a claimed size.

use std::path::Path;

use common::alloc_count::{max_request, reset_max};
use p04_transformer::gguf::{parse, GgufError};

#[global_allocator]
static GLOBAL: common::alloc_count::Counting = common::alloc_count::Counting;

/// Parse, and check no single allocation exceeded a bound proportional to the input.
fn parse_bounded(bytes: &[u8]) -> Result<(), GgufError> {
    reset_max();
    let r = parse(bytes, Path::new("mutant.gguf")).map(|_| ());
    let max = max_request();
    let bound = 64 * bytes.len() + (1 << 16);
    assert!(
        max <= bound,
        "parsing {} bytes allocated {max} bytes at once",
        bytes.len()
    );
    r
}

/// A small GGUF builder, so tests can write exactly the malformation they want.
#[derive(Clone)]
struct Builder {
    version: u32,
    tensor_count: Option<u64>,
    kv_count: Option<u64>,
    kvs: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_tensors: u64,
    data: Vec<u8>,
    alignment: usize,
}

impl Builder {
    fn new() -> Self {
        Builder {
            version: 3,
            tensor_count: None,
            kv_count: None,
            kvs: vec![],
            n_kv: 0,
            infos: vec![],
            n_tensors: 0,
            data: vec![],
            alignment: 32,
        }
    }
    fn str(buf: &mut Vec<u8>, s: &str) {
        buf.extend((s.len() as u64).to_le_bytes());
        buf.extend(s.as_bytes());
    }
    fn kv_u32(mut self, k: &str, v: u32) -> Self {
        Self::str(&mut self.kvs, k);
        self.kvs.extend(4u32.to_le_bytes());
        self.kvs.extend(v.to_le_bytes());
        self.n_kv += 1;
        self
    }
    fn kv_raw(mut self, k: &str, ty: u32, payload: &[u8]) -> Self {
        Self::str(&mut self.kvs, k);
        self.kvs.extend(ty.to_le_bytes());
        self.kvs.extend(payload);
        self.n_kv += 1;
        self
    }
    fn tensor(mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Self {
        Self::str(&mut self.infos, name);
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(ty.to_le_bytes());
        self.infos.extend(offset.to_le_bytes());
        self.n_tensors += 1;
        self
    }
    fn data(mut self, n: usize) -> Self {
        self.data = (0..n).map(|i| (i * 7) as u8).collect();
        self
    }
    fn build(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(self.version.to_le_bytes());
        b.extend(self.tensor_count.unwrap_or(self.n_tensors).to_le_bytes());
        b.extend(self.kv_count.unwrap_or(self.n_kv).to_le_bytes());
        b.extend(&self.kvs);
        b.extend(&self.infos);
        while !b.len().is_multiple_of(self.alignment) {
            b.push(0);
        }
        b.extend(&self.data);
        b
    }
}

/// Two F32 tensors (4 floats each) and a Q8_0 one, valid.
fn valid() -> Builder {
    Builder::new()
        .kv_u32("general.alignment", 32)
        .tensor("a", &[4], 0, 0)
        .tensor("b", &[2, 2], 0, 32)
        .tensor("q", &[32], 8, 64)
        .data(64 + 34)
}

fn err_of(b: &Builder) -> String {
    match parse_bounded(&b.build()) {
        Ok(()) => panic!("a malformed file parsed"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_builder_makes_valid_files() {
    let bytes = valid().build();
    let h = parse(&bytes, Path::new("valid.gguf")).unwrap();
    assert_eq!(h.tensors.len(), 3);
    assert_eq!(h.tensors[2].n_bytes, 34);
}

#[test]
fn truncation_at_every_byte_is_an_error() {
    for file in [
        valid().build(),
        std::fs::read(p04_transformer::fixtures_dir().join("tiny_quant.gguf")).unwrap(),
    ] {
        // Writers may pad the file after the last tensor; cutting that padding
        // loses nothing. Any cut before the end of the last tensor's data must fail.
        let h = parse(&file, Path::new("whole.gguf")).unwrap();
        let end = h.tensors.iter().map(|t| t.start + t.n_bytes).max().unwrap();
        assert!(
            end > file.len() - 64,
            "the last tensor should end near the end of the file"
        );
        for cut in 0..end {
            let r = parse_bounded(&file[..cut]);
            assert!(r.is_err(), "truncated at {cut} of {} parsed", file.len());
        }
        for cut in end..=file.len() {
            parse_bounded(&file[..cut]).unwrap();
        }
    }
}

#[test]
fn bit_flips_never_panic() {
    let file = std::fs::read(p04_transformer::fixtures_dir().join("tiny_quant.gguf")).unwrap();
    let mut rng = common::rng::Rng::new(0x9E37_79B9_7F4A_7C15);
    let mut rejected = 0;
    for _ in 0..3000 {
        let s = rng.next_u64();
        let mut m = file.clone();
        let at = (s >> 8) as usize % m.len();
        m[at] ^= 1 << (s % 8);
        if parse_bounded(&m).is_err() {
            rejected += 1;
        }
    }
    assert!(rejected > 100, "only {rejected} of 3000 flips rejected");
}

#[test]
fn huge_counts_are_rejected_before_allocating() {
    let mut b = valid();
    b.tensor_count = Some(u64::MAX);
    assert!(err_of(&b).contains("tensor count is 18446744073709551615"));
    let mut b = valid();
    b.kv_count = Some(1 << 40);
    assert!(err_of(&b).contains("key-value count"));
    let mut b = valid();
    b.tensor_count = Some(60_000); // under the cap, but the infos are not there
    let e = err_of(&b);
    // The fourth info is read from padding and data bytes, and rejected.
    assert!(e.contains("n_dims is 0"), "{e}");
    // A string claiming 2^40 bytes.
    let b = Builder::new().kv_raw("k", 8, &(1u64 << 40).to_le_bytes());
    assert!(err_of(&b).contains("length is 1099511627776"));
    // An array claiming 10^7 u64 elements in a tiny file.
    let mut payload = 10u32.to_le_bytes().to_vec();
    payload.extend(10_000_000u64.to_le_bytes());
    let b = Builder::new().kv_raw("arr", 9, &payload);
    assert!(err_of(&b).contains("10000000 elements"));
    // An array of arrays.
    let mut payload = 9u32.to_le_bytes().to_vec();
    payload.extend(1u64.to_le_bytes());
    assert!(err_of(&Builder::new().kv_raw("nest", 9, &payload)).contains("nested arrays"));
}

#[test]
fn tensor_table_errors() {
    let e = err_of(
        &Builder::new()
            .tensor("x", &[4], 0, 0)
            .tensor("y", &[4], 0, 0)
            .data(16),
    );
    assert!(e.contains("overlap"), "{e}");
    let e = err_of(
        &Builder::new()
            .tensor("x", &[16], 0, 0)
            .tensor("y", &[4], 0, 32)
            .data(64),
    );
    assert!(e.contains("`x` and `y` overlap"), "{e}");
    let e = err_of(
        &Builder::new()
            .kv_u32("general.alignment", 0)
            .tensor("x", &[4], 0, 0)
            .data(16),
    );
    assert!(e.contains("general.alignment is 0"), "{e}");
    let e = err_of(
        &Builder::new()
            .kv_u32("general.alignment", 24)
            .tensor("x", &[4], 0, 0)
            .data(16),
    );
    assert!(e.contains("power of two"), "{e}");
    let e = err_of(&Builder::new().tensor("x", &[4], 0, 4).data(64));
    assert!(e.contains("not a multiple of the alignment"), "{e}");
    let e = err_of(&Builder::new().tensor("x", &[4], 0, 32).data(16));
    assert!(e.contains("outside the file"), "{e}");
    let e = err_of(&Builder::new().tensor("x", &[4], 99, 0).data(16));
    assert!(e.contains("type 99") && e.contains("Q4_1"), "{e}");
    let e = err_of(&Builder::new().tensor("x", &[1, 1, 1, 1, 1], 0, 0).data(16));
    assert!(e.contains("n_dims is 5"), "{e}");
    let e = err_of(&Builder::new().tensor("x", &[u64::MAX, 4], 0, 0).data(16));
    assert!(e.contains("overflow"), "{e}");
    let e = err_of(&Builder::new().tensor("x", &[0], 0, 0).data(16));
    assert!(e.contains("dim 0 is 0"), "{e}");
    let e = err_of(&Builder::new().tensor("x", &[31], 8, 0).data(64));
    assert!(e.contains("block size 32"), "{e}");
    let e = err_of(
        &Builder::new()
            .tensor("x", &[4], 0, 0)
            .tensor("x", &[4], 0, 32)
            .data(64),
    );
    assert!(e.contains("duplicate tensor `x`"), "{e}");
    let e = err_of(&Builder::new().kv_u32("k", 1).kv_u32("k", 2));
    assert!(e.contains("duplicate metadata key `k`"), "{e}");
    let mut b = Builder::new();
    b.version = 1;
    assert!(err_of(&b).contains("version 1"));
    let mut bad = valid().build();
    bad[0] = b'X';
    assert!(parse_bounded(&bad)
        .unwrap_err()
        .to_string()
        .contains("not a GGUF file"));
    let e = err_of(&Builder::new().kv_raw("k", 8, &[2, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xfe]));
    assert!(e.contains("not valid UTF-8"), "{e}");
    let e = err_of(&Builder::new().kv_raw("k", 13, &[]));
    assert!(e.contains("value type 13"), "{e}");
}

#[test]
fn unpermute_qk_refuses_a_matrix_of_the_wrong_size() {
    use p04_transformer::llama::unpermute_qk;
    // 2 heads of 4 rows by 3 columns is 24 values, not 23 or 25.
    assert!(unpermute_qk(&[0.0; 24], 2, 4, 3).is_some());
    assert!(unpermute_qk(&[0.0; 23], 2, 4, 3).is_none());
    assert!(unpermute_qk(&[0.0; 25], 2, 4, 3).is_none());
    assert!(
        unpermute_qk(&[], usize::MAX, 2, 2).is_none(),
        "overflow is None"
    );
}

#[test]
#[should_panic(expected = "attend:")]
fn attend_refuses_a_short_output_row_instead_of_truncating() {
    let (q, k, v) = ([1.0f32; 4], [1.0f32; 8], [1.0f32; 8]);
    let (mut scores, mut out) = ([0.0f32; 2], [0.0f32; 3]);
    p04_transformer::llama::attend(&q, &k, &v, 4, 2, 1.0, &mut scores, &mut out);
}
