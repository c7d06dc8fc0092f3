//! cuBLAS, the matmul peer: the same row-major products through the vendor's
//! library.
//!
//! cuBLAS is column-major. A row-major M x N matrix is the column-major
//! N x M matrix of its transpose, so row-major C = A·B is column-major
//! C^T = B^T·A^T: call GEMM with the operands swapped and m, n exchanged.
//! No data moves.
//!
//! SGEMM here is full FP32: cuBLAS's default math mode does not use TF32
//! tensor cores unless asked (or NVIDIA_TF32_OVERRIDE=1 is set, which the
//! bench refuses).

use cudarc::cublas::sys::cublasOperation_t as Op;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, DeviceRepr};

use crate::error::GpuError;
use crate::gpu::{check_matmul, to_i32, Gpu};
use crate::probe;

/// A cuBLAS handle on the GPU's stream.
#[derive(Debug)]
pub struct Blas {
    blas: CudaBlas,
}

impl Blas {
    pub fn new(gpu: &Gpu) -> Result<Self, GpuError> {
        probe::cublas()?;
        if std::env::var("NVIDIA_TF32_OVERRIDE").is_ok_and(|v| v != "0") {
            return Err(GpuError::Shape(
                "NVIDIA_TF32_OVERRIDE is set: SGEMM would not be FP32".into(),
            ));
        }
        Ok(Self {
            blas: CudaBlas::new(gpu.stream().clone())?,
        })
    }

    /// Row-major C[M,N] = A[M,K]·B[K,N] in `T` (f32, f16 or bf16; the half
    /// types accumulate in f32 on tensor cores).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm<T>(
        &self,
        a: &CudaSlice<T>,
        b: &CudaSlice<T>,
        c: &mut CudaSlice<T>,
        m: usize,
        n: usize,
        k: usize,
        one: T,
        zero: T,
    ) -> Result<(), GpuError>
    where
        T: DeviceRepr,
        CudaBlas: Gemm<T>,
    {
        check_matmul(a.len(), b.len(), c.len(), m, n, k)?;
        let (mi, ni, ki) = (to_i32(m)?, to_i32(n)?, to_i32(k)?);
        let cfg = GemmConfig {
            transa: Op::CUBLAS_OP_N,
            transb: Op::CUBLAS_OP_N,
            m: ni,
            n: mi,
            k: ki,
            alpha: one,
            lda: ni.max(1),
            ldb: ki.max(1),
            beta: zero,
            ldc: ni.max(1),
        };
        // SAFETY: column-major B^T (n x k, ld n), A^T (k x m, ld k) and
        // C^T (n x m, ld n) are exactly the row-major buffers checked above.
        unsafe { self.blas.gemm(cfg, b, a, c) }?;
        Ok(())
    }

    /// FP32 SGEMM, row-major.
    pub fn sgemm(
        &self,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        c: &mut CudaSlice<f32>,
        (m, n, k): (usize, usize, usize),
    ) -> Result<(), GpuError> {
        self.gemm(a, b, c, m, n, k, 1.0f32, 0.0f32)
    }
}
