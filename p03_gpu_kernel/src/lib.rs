//! Project 03: your first GPU kernels.
//!
//! The CUDA C in [`kernels`] is compiled at run time by NVRTC for the device
//! in hand ([`gpu::compile`]), loaded through the driver API ([`Gpu`]) and
//! launched with operands checked on the host first. Each kernel has a CPU
//! reference from an earlier project ([`reference`]) and a tolerance; each
//! is timed with CUDA events after warm-up ([`timing`]) against ceilings the
//! bench measures on the same device: copy bandwidth, launch latency, and
//! cuBLAS ([`blas`]) for the matmuls.
//!
//! Everything goes through cudarc with `dynamic-loading`: the crate builds,
//! and its CPU tests run, on machines with no CUDA at all ([`probe`]).

#[cfg(feature = "bench")]
pub mod bench;
pub mod blas;
pub mod emulate;
pub mod error;
pub mod gpu;
pub mod kernels;
pub mod probe;
pub mod reference;
pub mod timing;

pub use error::GpuError;
pub use gpu::{DeviceInfo, Gpu};
pub use kernels::Matmul;
