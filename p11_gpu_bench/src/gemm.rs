//! GEMM through cuBLAS in FP32, FP16 and BF16 (FP32 accumulation), at
//! square sizes (compute-bound: the peak) and at decode-like skinny shapes
//! (M = 1..64 rows of activations against a K x N weight: bound by reading
//! the weight, so the figure that matters is bytes per second).

use cudarc::cublas::{CudaBlas, Gemm};
use cudarc::driver::DeviceRepr;
use half::{bf16, f16};
use p03_gpu_kernel::blas::Blas;
use p03_gpu_kernel::timing::time_auto;
use p03_gpu_kernel::{Gpu, GpuError};
use serde::Serialize;

/// Element type of a GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub enum Precision {
    F32,
    F16,
    Bf16,
}

impl Precision {
    pub const ALL: [Precision; 3] = [Precision::F32, Precision::F16, Precision::Bf16];

    pub fn bytes(self) -> usize {
        match self {
            Precision::F32 => 4,
            Precision::F16 | Precision::Bf16 => 2,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Precision::F32 => "fp32",
            Precision::F16 => "fp16",
            Precision::Bf16 => "bf16",
        }
    }
}

/// One GEMM shape: C[M,N] = A[M,K] · B[K,N].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Shape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

impl Shape {
    pub fn flops(self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }

    /// Bytes if each operand crosses HBM once (A and B read, C written).
    pub fn min_bytes(self, p: Precision) -> f64 {
        ((self.m * self.k + self.k * self.n + self.m * self.n) * p.bytes()) as f64
    }

    /// FLOPs per byte at the minimum traffic: where on the roofline it sits.
    pub fn intensity(self, p: Precision) -> f64 {
        self.flops() / self.min_bytes(p)
    }
}

/// One measured GEMM.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct GemmPoint {
    pub precision: Precision,
    pub shape: Shape,
    pub median_s: f64,
    pub p95_s: f64,
    pub median_flops: f64,
    /// min_bytes / median time: for skinny shapes, the weight-read bandwidth.
    pub median_bps: f64,
}

/// The shapes: squares, then M = 1..64 against a `skinny_k` x `skinny_n` weight.
pub fn shapes(squares: &[usize], skinny_k: usize, skinny_n: usize) -> (Vec<Shape>, Vec<Shape>) {
    let sq = squares
        .iter()
        .map(|&s| Shape { m: s, n: s, k: s })
        .collect();
    let sk = [1usize, 2, 4, 8, 16, 32, 64]
        .into_iter()
        .map(|m| Shape {
            m,
            n: skinny_n,
            k: skinny_k,
        })
        .collect();
    (sq, sk)
}

fn time_gemm<T>(
    gpu: &Gpu,
    blas: &Blas,
    s: Shape,
    from_f32: impl Fn(f32) -> T,
    budget_ms: f64,
) -> Result<Vec<f64>, GpuError>
where
    T: DeviceRepr + Copy + Default + cudarc::driver::ValidAsZeroBits,
    CudaBlas: Gemm<T>,
{
    let st = gpu.stream();
    let fill = |n: usize, seed: u32| -> Vec<T> {
        // A cheap deterministic pattern in [-1, 1): values do not change the
        // speed of a dense GEMM, only their count does.
        (0..n)
            .map(|i| {
                from_f32(
                    ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32
                        / 8_388_608.0
                        - 1.0,
                )
            })
            .collect()
    };
    let a = st.clone_htod(&fill(s.m * s.k, 1))?;
    let b = st.clone_htod(&fill(s.k * s.n, 2))?;
    let mut c = st.alloc_zeros::<T>(s.m * s.n)?;
    let (one, zero) = (from_f32(1.0), from_f32(0.0));
    time_auto(gpu, budget_ms, || {
        blas.gemm(&a, &b, &mut c, s.m, s.n, s.k, one, zero)
    })
}

/// Every precision of `precisions` at every shape, about `budget_ms` of
/// device time each.
pub fn sweep(
    gpu: &Gpu,
    shapes: &[Shape],
    precisions: &[Precision],
    budget_ms: f64,
) -> Result<Vec<GemmPoint>, GpuError> {
    let blas = Blas::new(gpu)?;
    let mut out = Vec::new();
    for &s in shapes {
        for &p in precisions {
            let ms = match p {
                Precision::F32 => time_gemm(gpu, &blas, s, |v| v, budget_ms)?,
                Precision::F16 => time_gemm(gpu, &blas, s, f16::from_f32, budget_ms)?,
                Precision::Bf16 => time_gemm(gpu, &blas, s, bf16::from_f32, budget_ms)?,
            };
            let sm = common::stats::summarize(&ms);
            let (med, p95) = (sm.median / 1e3, sm.p95 / 1e3);
            out.push(GemmPoint {
                precision: p,
                shape: s,
                median_s: med,
                p95_s: p95,
                median_flops: s.flops() / med,
                median_bps: s.min_bytes(p) / med,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intensity_grows_with_the_square_and_stays_near_m_for_skinny() {
        let s = Shape {
            m: 4096,
            n: 4096,
            k: 4096,
        };
        // 2n^3 / (3 n^2 * 4 bytes) = n / 6 in fp32.
        assert!((s.intensity(Precision::F32) - 4096.0 / 6.0).abs() < 1e-6);
        assert!((s.intensity(Precision::Bf16) - 4096.0 / 3.0).abs() < 1e-6);
        // M = 1: ~1 FLOP per weight byte in bf16 (2 FLOPs per 2-byte weight).
        let d = Shape {
            m: 1,
            n: 4096,
            k: 4096,
        };
        assert!((d.intensity(Precision::Bf16) - 1.0).abs() < 0.01);
        let (sq, sk) = shapes(&[1024, 2048], 4096, 4096);
        assert_eq!(sq.len(), 2);
        assert_eq!(
            sk.iter().map(|s| s.m).collect::<Vec<_>>(),
            [1, 2, 4, 8, 16, 32, 64]
        );
    }
}
