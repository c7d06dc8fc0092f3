//! Project 10: quantised weights, natively.
//!
//! - [`formats`]: GGUF's block formats as types (Q8_0, Q4_0, Q4_1, and
//!   Q8_1 for activations), with ggml's reference quantisers;
//! - [`dot`]: block dot products, a scalar reference and SIMD paths
//!   ([`isa`] picks one at run time), over activations quantised into an
//!   [`act::QRow`];
//! - [`matrix`]: a weight matrix kept in blocks, behind Project 04's
//!   weight-format seam (`LinearWeights`), on a spinning thread pool
//!   ([`pool`]);
//! - [`int8_mlp`]: int8 per output channel for Project 01's MNIST MLP;
//! - [`loader`]: Project 04's GGUF loader keeping the file's blocks, or
//!   dequantising them ([`Weights`]); [`serve`]: the flags every server
//!   loads with, and the README's server;
//! - [`perplexity`]: PPL, KL divergence and top-1 agreement over a text,
//!   counted as llama.cpp's `llama-perplexity` counts them; [`study`]
//!   runs the accuracy studies with it.

pub mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_tile;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_tile;
#[cfg(feature = "bench")]
pub mod batch_bench;
#[cfg(feature = "bench")]
pub mod bench;
pub mod dot;
pub mod formats;
pub mod int8_gpt2;
pub mod int8_mlp;
pub mod int_path;
pub mod isa;
pub mod loader;
pub mod matrix;
pub mod panel;
#[cfg(feature = "bench")]
pub mod peak;
pub mod perplexity;
pub mod pool;
#[cfg(feature = "bench")]
pub mod seam_bench;
mod select;
pub mod serve;
#[cfg(feature = "bench")]
pub mod study;
pub mod tile;

pub use dot::Dot;
pub use isa::Isa;
pub use loader::{NativeWeights, Weights};
pub use matrix::{Blocks, Format, QuantMatrix};
pub use pool::Pool;
