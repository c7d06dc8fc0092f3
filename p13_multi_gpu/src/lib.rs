//! Project 13: one model split across ranks.
//!
//! - [`comm`]: the `Communicator` trait (all-reduce, all-gather,
//!   broadcast, barrier, send/recv), its one summation order and errors;
//! - [`frame`]: the frame header and the hello each new link starts with;
//! - [`mesh`]: the collectives, written once over a transport (direct and
//!   ring all-reduce);
//! - [`threads`]: ranks as threads (the reference); [`tcp`]: ranks as
//!   processes or hosts; [`shm`]: ranks on one host over shared memory;
//! - [`nccl`]: NCCL behind the same trait (GPUs; loaded at run time);
//! - [`hosts`]: several hosts on one machine (network namespaces) and
//!   [`wire`], the link between them with a delay and a bandwidth cap;
//! - [`tp`]: a Llama split by tensor parallelism: each rank's slice of
//!   the weights and K/V heads, its row-parallel projections completed by
//!   an all-reduce; [`pp`]: pipeline stages and micro-batches;
//! - [`runner`]: rank 0 broadcasts each step's plan, the others follow;
//!   [`report`]: every rank's own times for rank 0's `/metrics`;
//!   [`serve`]: the server and the ranks' processes; `bench`: all-reduce.

#[cfg(feature = "bench")]
pub mod bench;
#[cfg(feature = "bench")]
pub mod bench_decode;
#[cfg(feature = "bench")]
pub mod bench_links;
pub mod comm;
pub mod frame;
pub mod hosts;
pub mod mesh;
pub mod nccl;
pub mod pp;
pub mod report;
pub mod runner;
pub mod serve;
pub mod shm;
pub mod swap;
pub mod tcp;
pub mod threads;
pub mod tp;
pub mod wire;

pub use comm::{CommError, CommStats, Communicator};
pub use mesh::{Algorithm, Mesh};
