//! Project 04: a transformer engine (in progress).
//!
//! Done so far: the GGUF reader ([`gguf`], hostile-file hardened) and the
//! dequantisers of its tensor types ([`dequant`]), wrapped by [`model_file`]
//! (memory-mapped file, f32 tensors). Still to come (issue 4): the HF
//! safetensors loader, GPT-2 and Llama forward passes, the BPE tokenizer.

pub mod dequant;
pub mod gguf;
pub mod inspect;
pub mod model_file;

pub use dequant::{dequantize, GgmlType};
pub use gguf::{GgufError, GgufHeader, TensorInfo, Value};
pub use model_file::GgufFile;

/// The committed fixtures directory of this crate.
pub fn fixtures_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}
