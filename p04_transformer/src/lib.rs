//! Project 04: a transformer engine (in progress).
//!
//! Done so far: the GGUF reader ([`gguf`], hostile-file hardened) and the
//! dequantisers of its tensor types ([`dequant`]), wrapped by [`model_file`]
//! (memory-mapped file, f32 tensors); the Llama forward pass ([`llama`]) from
//! GGUF or a Hugging Face directory ([`weights`]). Still to come (issue 4):
//! GPT-2, the BPE tokenizer, generate/trace. [`prompt`]: the one input path
//! (the model's chat template, its BOS policy, tokenisation) every front uses.

#[cfg(feature = "bench")]
pub mod bench;
pub mod bpe;
pub mod dequant;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod gpt2;
pub mod inspect;
pub mod llama;
pub mod model;
pub mod model_file;
pub mod proj;
pub mod prompt;
pub mod segments;
pub mod split;
#[cfg(feature = "bench")]
pub mod tokenize_bench;
pub mod tokenizer;
pub mod trace;
pub mod weights;

pub use dequant::{dequantize, GgmlType};
pub use error::ModelError;
pub use gguf::{GgufError, GgufHeader, TensorInfo, TensorProblem, Value};
pub use gpt2::{Gpt2, Gpt2Config};
pub use llama::{Llama, LlamaConfig};
pub use model_file::GgufFile;
pub use proj::{LinearWeights, Proj, ProjLoader};
pub use prompt::{PromptBuilder, PromptError};
pub use split::{HeadSplit, Keep, Role, Split, SplitError};
pub use tokenizer::Tokenizer;

/// The committed fixtures directory of this crate.
pub fn fixtures_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}
