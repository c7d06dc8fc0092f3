//! Memory bandwidth: STREAM's four kernels (read, write, copy, triad) over
//! array sizes from well inside L2 to far outside it, and host<->device
//! transfers over sizes, pinned and pageable.
//!
//! A small array is over in a microsecond, less than a launch costs, so each
//! launch walks its arrays `passes` times (outer loop) to move at least
//! [`BYTES_PER_LAUNCH`]: a small array then stays in L2 between passes, and
//! the bandwidth seen falls when the arrays stop fitting (the L2 knee).

use std::collections::HashMap;

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use p03_gpu_kernel::kernels::BLOCK_1D;
use p03_gpu_kernel::timing::{time_auto, time_host};
use p03_gpu_kernel::{Gpu, GpuError};
use serde::Serialize;

/// Each launch moves at least this much, whatever the array size.
pub const BYTES_PER_LAUNCH: usize = 256 << 20;

/// The four kernels, float4 and grid-stride. The pass loop is outside the
/// element loop, so no load or store can be hoisted out of it (a thread
/// would need every element in registers); `tests/nvrtc.rs` checks the PTX.
pub const SOURCE: &str = include_str!("stream.cu");

/// The kernels' names in [`SOURCE`].
pub const NAMES: [&str; 4] = ["hbm_read", "hbm_write", "hbm_copy", "hbm_triad"];

/// One of STREAM's kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub enum Kernel {
    Read,
    Write,
    Copy,
    Triad,
}

impl Kernel {
    pub const ALL: [Kernel; 4] = [Kernel::Read, Kernel::Write, Kernel::Copy, Kernel::Triad];

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Read => "hbm_read",
            Kernel::Write => "hbm_write",
            Kernel::Copy => "hbm_copy",
            Kernel::Triad => "hbm_triad",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Kernel::Read => "read",
            Kernel::Write => "write",
            Kernel::Copy => "copy",
            Kernel::Triad => "triad",
        }
    }

    /// Arrays touched per element (bytes moved = arrays x array bytes).
    pub fn arrays(self) -> usize {
        match self {
            Kernel::Read | Kernel::Write => 1,
            Kernel::Copy => 2,
            Kernel::Triad => 3,
        }
    }
}

/// Passes over arrays of `array_bytes` so one launch moves at least
/// [`BYTES_PER_LAUNCH`] (1 for arrays that big), at most 1 << 16.
pub fn passes_for(kernel: Kernel, array_bytes: usize) -> i32 {
    let per_pass = (kernel.arrays() * array_bytes).max(1);
    BYTES_PER_LAUNCH.div_ceil(per_pass).clamp(1, 1 << 16) as i32
}

/// Array sizes in bytes: powers of two from 256 KiB to `max_bytes`.
pub fn sizes(max_bytes: usize) -> Vec<usize> {
    (18..=40)
        .map(|p| 1usize << p)
        .take_while(|&b| b <= max_bytes)
        .collect()
}

/// One measured point.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct BandwidthPoint {
    pub kernel: Kernel,
    pub array_bytes: usize,
    pub passes: i32,
    /// Bytes moved per second at the median and at the p95 time.
    pub median_bps: f64,
    pub p95_bps: f64,
}

/// STREAM's kernels loaded on a device, with their buffers.
#[derive(Debug)]
pub struct Stream<'g> {
    gpu: &'g Gpu,
    funcs: HashMap<&'static str, CudaFunction>,
}

impl<'g> Stream<'g> {
    pub fn load(gpu: &'g Gpu) -> Result<Self, GpuError> {
        Ok(Self {
            gpu,
            funcs: gpu.load_kernels("p11_stream.cu", SOURCE, &NAMES)?,
        })
    }

    fn cfg(&self, n4: usize) -> LaunchConfig {
        p03_gpu_kernel::kernels::grid_stride(n4, 1, self.gpu.max_blocks())
    }

    /// Threads of the grid `hbm_read` uses for `n4` vectors: the length its
    /// `partial` buffer needs.
    pub fn read_threads(&self, n4: usize) -> usize {
        let c = self.cfg(n4);
        c.grid_dim.0 as usize * BLOCK_1D as usize
    }

    /// Launch `kernel` once over the arrays (`a` always; `b`, `c` as the
    /// kernel needs; `partial` for read). Lengths in floats, multiples of 4.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &self,
        kernel: Kernel,
        a: &mut CudaSlice<f32>,
        b: &mut CudaSlice<f32>,
        c: &CudaSlice<f32>,
        partial: &mut CudaSlice<f32>,
        passes: i32,
    ) -> Result<(), GpuError> {
        let n = a.len();
        if !n.is_multiple_of(4) || b.len() < n || c.len() < n {
            return Err(GpuError::Shape(format!(
                "stream arrays: {n} floats (a multiple of 4 needed), b {}, c {}",
                b.len(),
                c.len()
            )));
        }
        let n4 = (n / 4) as u64;
        let cfg = self.cfg(n / 4);
        if kernel == Kernel::Read && partial.len() < self.read_threads(n / 4) {
            return Err(GpuError::Shape(
                "read: partial sums buffer too short".into(),
            ));
        }
        let mut l = self.gpu.stream().launch_builder(&self.funcs[kernel.name()]);
        let (v, s) = (1.0f32, 3.0f32);
        match kernel {
            Kernel::Read => l.arg(&*a).arg(partial).arg(&n4).arg(&passes),
            Kernel::Write => l.arg(a).arg(&n4).arg(&passes).arg(&v),
            Kernel::Copy => l.arg(&*a).arg(b).arg(&n4).arg(&passes),
            Kernel::Triad => l.arg(a).arg(&*b).arg(c).arg(&n4).arg(&passes).arg(&s),
        };
        // SAFETY: every array holds n floats = n4 float4s (checked above;
        // cuMemAlloc aligns to 256 bytes, so float4 loads are aligned), the
        // grid-stride loops stop at n4, and `partial` holds one float per
        // thread of the grid (checked for read).
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// Every kernel at every size: bytes moved / event time, about
    /// `budget_ms` of device time each. Fresh arrays per size (allocation
    /// is outside the timing).
    pub fn sweep(&self, sizes: &[usize], budget_ms: f64) -> Result<Vec<BandwidthPoint>, GpuError> {
        let mut out = Vec::new();
        for &bytes in sizes {
            let n = bytes / 4;
            let mut a = self.gpu.zeros(n)?;
            let mut b = self.gpu.zeros(n)?;
            let c = self.gpu.zeros(n)?;
            let mut partial = self.gpu.zeros(self.read_threads(n / 4))?;
            for kernel in Kernel::ALL {
                let passes = passes_for(kernel, bytes);
                let ms = time_auto(self.gpu, budget_ms, || {
                    self.launch(kernel, &mut a, &mut b, &c, &mut partial, passes)
                })?;
                let moved = (kernel.arrays() * bytes) as f64 * f64::from(passes);
                let s = common::stats::summarize(&ms);
                out.push(BandwidthPoint {
                    kernel,
                    array_bytes: bytes,
                    passes,
                    median_bps: moved / (s.median / 1e3),
                    p95_bps: moved / (s.p95 / 1e3),
                });
            }
        }
        Ok(out)
    }
}

/// Host<->device copy direction and host memory kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub enum Transfer {
    HostToDevicePinned,
    HostToDevicePageable,
    DeviceToHostPinned,
    DeviceToHostPageable,
}

impl Transfer {
    pub const ALL: [Transfer; 4] = [
        Transfer::HostToDevicePinned,
        Transfer::HostToDevicePageable,
        Transfer::DeviceToHostPinned,
        Transfer::DeviceToHostPageable,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Transfer::HostToDevicePinned => "H2D pinned",
            Transfer::HostToDevicePageable => "H2D pageable",
            Transfer::DeviceToHostPinned => "D2H pinned",
            Transfer::DeviceToHostPageable => "D2H pageable",
        }
    }
}

/// One transfer measurement.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct TransferPoint {
    pub kind: Transfer,
    pub bytes: usize,
    pub median_bps: f64,
    pub p95_bps: f64,
    /// Median time in seconds (small copies are latency, not bandwidth).
    pub median_s: f64,
}

/// Transfer sizes: 4 KiB to `max_bytes`, x4 apart.
pub fn transfer_sizes(max_bytes: usize) -> Vec<usize> {
    (0..)
        .map(|i| 4096usize << (2 * i))
        .take_while(|&b| b <= max_bytes)
        .collect()
}

/// Every transfer kind at every size, timed on the host around copy +
/// synchronise (what a caller waits for). Pinned buffers are allocated per
/// size (page-locking is outside the timing).
pub fn transfers(gpu: &Gpu, sizes: &[usize], reps: usize) -> Result<Vec<TransferPoint>, GpuError> {
    let max = sizes.iter().copied().max().unwrap_or(0) / 4;
    let mut pageable = vec![1.0f32; max];
    let mut dev = gpu.zeros(max.max(1))?;
    let s = gpu.stream().clone();
    let mut out = Vec::new();
    for &bytes in sizes {
        let n = bytes / 4;
        // SAFETY: filled right below, before any read; flags 0 = plain
        // page-locked memory (not write-combined: the host reads it back).
        let mut pinned = unsafe { gpu.context().alloc_pinned_with_flags::<f32>(n, 0) }?;
        pinned.as_mut_slice()?.fill(1.0);
        let page = &mut pageable[..n];
        for kind in Transfer::ALL {
            let ms = match kind {
                Transfer::HostToDevicePinned => {
                    time_host(gpu, 2, reps, || Ok(s.memcpy_htod(&pinned, &mut dev)?))?
                }
                Transfer::HostToDevicePageable => {
                    time_host(gpu, 2, reps, || Ok(s.memcpy_htod(&*page, &mut dev)?))?
                }
                Transfer::DeviceToHostPinned => time_host(gpu, 2, reps, || {
                    Ok(s.memcpy_dtoh(&dev.slice(0..n), &mut pinned)?)
                })?,
                Transfer::DeviceToHostPageable => time_host(gpu, 2, reps, || {
                    Ok(s.memcpy_dtoh(&dev.slice(0..n), &mut *page)?)
                })?,
            };
            let sm = common::stats::summarize(&ms);
            out.push(TransferPoint {
                kind,
                bytes,
                median_bps: bytes as f64 / (sm.median / 1e3),
                p95_bps: bytes as f64 / (sm.p95 / 1e3),
                median_s: sm.median / 1e3,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_launch_moves_at_least_the_floor_and_big_arrays_pass_once() {
        for bytes in sizes(2 << 30) {
            for k in Kernel::ALL {
                let p = passes_for(k, bytes) as usize;
                assert!(p * k.arrays() * bytes >= BYTES_PER_LAUNCH, "{k:?} {bytes}");
                // Not more than one pass beyond the floor.
                assert!(
                    (p - 1) * k.arrays() * bytes < BYTES_PER_LAUNCH,
                    "{k:?} {bytes}"
                );
            }
        }
        assert_eq!(passes_for(Kernel::Triad, 1 << 30), 1);
        assert_eq!(passes_for(Kernel::Read, 1 << 18), 1024);
    }

    #[test]
    fn the_size_ladders_span_l2_to_hbm() {
        let s = sizes(2 << 30);
        assert_eq!(s.first(), Some(&(256 << 10)));
        assert_eq!(s.last(), Some(&(2 << 30)));
        assert_eq!(s.len(), 14);
        let t = transfer_sizes(1 << 30);
        assert_eq!(t.first(), Some(&4096));
        assert_eq!(t.last(), Some(&(1 << 30)));
        assert!(t.windows(2).all(|w| w[1] == 4 * w[0]));
    }

    #[test]
    fn the_source_defines_each_kernel_once() {
        for n in NAMES {
            assert_eq!(
                SOURCE.matches(&format!("__global__ void {n}(")).count(),
                1,
                "{n}"
            );
        }
        assert_eq!(Kernel::ALL.map(Kernel::name), NAMES);
    }
}
