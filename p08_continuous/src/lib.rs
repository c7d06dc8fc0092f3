//! Project 08: continuous batching. An iteration-level scheduler
//! ([`scheduler`]) decides every step which sequences run and how many
//! tokens each brings (decode tokens first, then prefill chunks within a
//! token budget, then admissions); the engine core ([`core`]) turns that
//! into a [`StepPlan`] that a model runner ([`runner`]) executes as one
//! batched, ragged step of Project 07, and samples; the serving engine
//! ([`engine`]) puts it behind p06's HTTP layer. The plan has a binary
//! encoding ([`plan_codec`]) for runners in other processes, and a running
//! sequence can move to another engine ([`handoff`], [`kv_transfer`]), its
//! K/V landing straight in blocks reserved for it ([`reserved`]).
//!
//!   cargo run --release -p p08_continuous -- --model smollm2 --port 8000

#[cfg(feature = "bench")]
pub mod bench_cmd;
pub mod cli;
pub mod contiguous;
pub mod core;
pub mod engine;
pub mod handoff;
pub mod kv_backend;
pub mod kv_transfer;
pub mod output;
pub mod plan_codec;
pub mod reserved;
pub mod runner;
pub mod scheduler;
#[cfg(feature = "bench")]
pub mod serve_bench;
pub mod stats;

pub use crate::core::{ContinuousConfig, EngineCore, LocalCore, NewRequest};
pub use crate::engine::ContinuousEngine;
pub use crate::handoff::{HandoffError, SeqExport};
pub use crate::runner::{LocalRunner, ModelRunner, StepPlan};
pub use crate::scheduler::{Scheduler, SchedulerConfig};
