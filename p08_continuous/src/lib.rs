//! Project 08: continuous batching. An iteration-level scheduler
//! ([`scheduler`]) decides every step which sequences run and how many
//! tokens each brings (decode tokens first, then prefill chunks within a
//! token budget, then admissions); the engine core ([`core`]) runs the
//! plan as one batched, ragged step of Project 07 and samples; the serving
//! engine ([`engine`]) puts it behind p06's HTTP layer.
//!
//!   cargo run --release -p p08_continuous -- --model smollm2 --port 8000

#[cfg(feature = "bench")]
pub mod bench_cmd;
pub mod cli;
pub mod core;
pub mod engine;
pub mod kv_backend;
pub mod scheduler;
#[cfg(feature = "bench")]
pub mod serve_bench;
pub mod stats;

pub use crate::core::{ContinuousConfig, EngineCore};
pub use crate::engine::ContinuousEngine;
pub use crate::scheduler::{Scheduler, SchedulerConfig};
