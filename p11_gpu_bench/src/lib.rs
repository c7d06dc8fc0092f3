//! Project 11: characterise the GPU you serve on.
//!
//! Before tuning a kernel, measure what the hardware gives: HBM bandwidth
//! against array size (and where L2 stops helping), what a host<->device
//! copy costs pinned and pageable, what a launch costs, and what cuBLAS
//! reaches at compute-bound and at decode-like shapes. [`suite`] runs it
//! all in one command and draws the roofline from the ceilings it measured,
//! with Project 03's kernels placed on it.

pub mod gemm;
pub mod memory;
#[cfg(feature = "bench")]
pub mod report;
pub mod roofline;
pub mod spread;
#[cfg(feature = "bench")]
pub mod suite;
