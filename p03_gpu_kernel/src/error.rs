//! Everything that can go wrong between "is there a GPU?" and "the kernel's
//! answer is on the host", as one typed error.

use thiserror::Error;

/// Why a GPU operation did not happen.
#[derive(Debug, Error)]
pub enum GpuError {
    /// No loadable CUDA driver library (`libcuda.so.1`): a machine without
    /// an NVIDIA driver. Checked before any cudarc call, which would panic.
    #[error("no CUDA {library} library could be loaded (tried: {tried}); {hint}")]
    NoLibrary {
        library: &'static str,
        tried: String,
        hint: &'static str,
    },
    /// The driver loaded but reports no device at the requested ordinal.
    #[error("CUDA device {ordinal} not present ({count} device(s) visible)")]
    NoDevice { ordinal: usize, count: i32 },
    /// A driver API call failed (out of memory, illegal address, ...).
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// NVRTC refused the kernel source; `log` is the compiler's output.
    #[error("NVRTC could not compile {name}: {log}")]
    Compile { name: &'static str, log: String },
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    /// Operand sizes that do not describe the operation asked for.
    #[error("shape: {0}")]
    Shape(String),
}
