//! Project 07: batch requests to amortise weight reads.
//!
//! - The batched, ragged step itself lives where the engines are: the seam
//!   in `common::batch` (`Batch`, `KvStore`, `BatchModel`) and its Llama and
//!   GPT-2 implementations in p05.
//! - [`batcher`]: a dynamic (request-level) batcher behind the `Engine`
//!   trait: `max_batch`, `max_wait`, a batch prefills together and decodes
//!   in lock-step until its last member finishes.
//! - [`stats`]: the batcher's own metrics (batch sizes, queue time, empty slots).
//! - [`bench`]: aggregate decode tok/s vs batch size beside single-sequence steps;
//!   [`serve_bench`]: the batcher behind HTTP vs p06's serial server; [`bench_cmd`]: the
//!   two bench commands (tables, numbers.md rows, plots).

pub mod batcher;
pub mod bench;
#[cfg(feature = "bench")]
pub mod bench_cmd;
#[cfg(feature = "bench")]
pub mod serve_bench;
pub mod stats;

pub use batcher::{BatchConfig, BatchingEngine};
