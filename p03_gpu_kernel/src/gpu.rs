//! One device, one stream, the kernels compiled for it, and the operations
//! as methods that check their operands before anything is launched.
//!
//! Launches are asynchronous: a method returns as soon as the kernel is
//! queued. `download` (or [`Gpu::sync`]) waits for it. That is why every
//! timing in this crate is taken either with CUDA events recorded on the
//! stream or on the host after a synchronise (see `timing`).

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use crate::error::GpuError;
use crate::kernels::{self, Matmul};
use crate::probe;

/// What the bench rows and the README quote about the device.
#[derive(Clone, Debug, Default)]
pub struct DeviceInfo {
    pub name: String,
    pub compute_capability: (i32, i32),
    pub sm_count: i32,
    pub total_mem_bytes: usize,
    /// The driver's CUDA version as `major * 1000 + minor * 10` (13000 = 13.0).
    pub driver_version: i32,
    pub l2_bytes: i32,
    /// Core clock in kHz (0 when the driver no longer reports it).
    pub clock_khz: i32,
    pub max_shared_per_block: i32,
}

impl DeviceInfo {
    /// FP32 FMA peak from the clock: SMs x 128 FP32 lanes x 2 FLOPs x clock
    /// (Hopper and Ampere-class data-centre SMs have 128 FP32 lanes). None
    /// without a clock.
    pub fn fp32_peak_flops(&self) -> Option<f64> {
        (self.clock_khz > 0)
            .then(|| f64::from(self.sm_count) * 128.0 * 2.0 * f64::from(self.clock_khz) * 1e3)
    }

    /// "NVIDIA H200, sm_90, 132 SMs, CUDA driver 13.0" for the machine column.
    pub fn describe(&self) -> String {
        format!(
            "{}, sm_{}{}, {} SMs, CUDA driver {}.{}",
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.sm_count,
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10
        )
    }
}

/// Compile [`kernels::SOURCE`] to PTX for `arch` (e.g. `compute_90`), with
/// IEEE division and square root (no fast math): the results are compared
/// with CPU references. Needs only NVRTC, not a GPU.
pub fn compile(arch: Option<&'static str>) -> Result<Ptx, GpuError> {
    compile_source("p03_kernels.cu", kernels::SOURCE, arch)
}

/// Compile any CUDA C translation unit `name` to PTX for `arch` (later
/// projects bring their own kernels through here).
pub fn compile_source(
    name: &'static str,
    source: &str,
    arch: Option<&'static str>,
) -> Result<Ptx, GpuError> {
    probe::nvrtc()?;
    let opts = CompileOptions {
        arch,
        prec_div: Some(true),
        prec_sqrt: Some(true),
        name: Some(name.into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| GpuError::Compile {
        name,
        log: match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        },
    })
}

/// A device with Project 03's kernels loaded.
#[derive(Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    info: DeviceInfo,
}

impl Gpu {
    /// Open device `ordinal`, compile the kernels for it and load them.
    /// On a machine without a driver this is [`GpuError::NoLibrary`], never
    /// a panic.
    pub fn new(ordinal: usize) -> Result<Self, GpuError> {
        probe::driver()?;
        cudarc::driver::result::init()?;
        let count = CudaContext::device_count()?;
        if i32::try_from(ordinal).map_or(true, |o| o >= count) {
            return Err(GpuError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        // One stream does all the work, so cudarc's per-buffer event
        // tracking (for ordering across streams) only adds to each launch.
        // SAFETY: no second stream is ever created on this context by this
        // type, so no cross-stream ordering is needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let info = device_info(&ctx)?;
        let (major, minor) = info.compute_capability;
        let module = ctx.load_module(compile(kernels::virtual_arch(major, minor))?)?;
        let mut funcs = HashMap::new();
        for name in kernels::NAMES {
            funcs.insert(name, module.load_function(name)?);
        }
        Ok(Self {
            ctx,
            stream,
            funcs,
            info,
        })
    }

    /// Compile `source` for this device and load the functions `names`
    /// from it (for kernels beyond Project 03's own).
    pub fn load_kernels(
        &self,
        name: &'static str,
        source: &str,
        names: &[&'static str],
    ) -> Result<HashMap<&'static str, CudaFunction>, GpuError> {
        let (major, minor) = self.info.compute_capability;
        let module = self.ctx.load_module(compile_source(
            name,
            source,
            kernels::virtual_arch(major, minor),
        )?)?;
        names
            .iter()
            .map(|&n| Ok((n, module.load_function(n)?)))
            .collect()
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Wait for everything queued so far.
    pub fn sync(&self) -> Result<(), GpuError> {
        Ok(self.stream.synchronize()?)
    }

    pub fn upload(&self, host: &[f32]) -> Result<CudaSlice<f32>, GpuError> {
        Ok(self.stream.clone_htod(host)?)
    }

    /// Copy back (waits for the kernels that write `dev`).
    pub fn download(&self, dev: &CudaSlice<f32>) -> Result<Vec<f32>, GpuError> {
        Ok(self.stream.clone_dtoh(dev)?)
    }

    pub fn zeros(&self, n: usize) -> Result<CudaSlice<f32>, GpuError> {
        Ok(self.stream.alloc_zeros::<f32>(n)?)
    }

    fn func(&self, name: &'static str) -> &CudaFunction {
        // Every name in kernels::NAMES was loaded in `new`.
        &self.funcs[name]
    }

    /// A few blocks per SM for grid-stride kernels (8 per SM: enough warps
    /// in flight to cover memory latency, no more to schedule).
    pub fn max_blocks(&self) -> u32 {
        u32::try_from(self.info.sm_count.max(1)).unwrap_or(1) * 8
    }

    /// The empty kernel, one block of one thread: launch cost only.
    pub fn launch_empty(&self) -> Result<(), GpuError> {
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(self.func("empty"));
        // SAFETY: `empty` takes no arguments and touches no memory.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// c = a + b, elementwise. `vectorized` picks the float4 kernel.
    pub fn vector_add(
        &self,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        c: &mut CudaSlice<f32>,
        vectorized: bool,
    ) -> Result<(), GpuError> {
        let n = a.len();
        if b.len() != n || c.len() != n {
            return Err(GpuError::Shape(format!(
                "vector_add: lengths {}, {}, {} differ",
                n,
                b.len(),
                c.len()
            )));
        }
        // float4 accesses need 16-byte-aligned buffers (allocations are;
        // a view into one need not be).
        let vectorized = vectorized
            && [
                a.device_ptr(&self.stream).0,
                b.device_ptr(&self.stream).0,
                c.device_ptr(&self.stream).0,
            ]
            .iter()
            .all(|p| p % 16 == 0);
        let (name, per_thread) = if vectorized {
            ("vector_add4", 4)
        } else {
            ("vector_add", 1)
        };
        let cfg = kernels::grid_stride(n, per_thread, self.max_blocks());
        let n64 = n as u64;
        let mut l = self.stream.launch_builder(self.func(name));
        l.arg(a).arg(b).arg(c).arg(&n64);
        // SAFETY: the kernel reads a[0..n], b[0..n] and writes c[0..n] (all
        // three checked to hold n floats above); its grid-stride loop and the
        // float4 tail both stop at n.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// C[M,N] = A[M,K] · B[K,N], row-major, with the chosen kernel.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        kind: Matmul,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        c: &mut CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), GpuError> {
        check_matmul(a.len(), b.len(), c.len(), m, n, k)?;
        let cfg = kind.launch(m, n).map_err(GpuError::Shape)?;
        let (mi, ni, ki) = (to_i32(m)?, to_i32(n)?, to_i32(k)?);
        let mut l = self.stream.launch_builder(self.func(kind.kernel()));
        l.arg(a).arg(b).arg(c).arg(&mi).arg(&ni).arg(&ki);
        // SAFETY: A holds m*k, B k*n and C m*n floats (checked); every kernel
        // guards its loads and stores by m, n and k.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// y = softmax(x) over each row of width `width`.
    pub fn softmax_rows(
        &self,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        rows: usize,
        width: usize,
    ) -> Result<(), GpuError> {
        check_rows(x.len(), y.len(), rows, width)?;
        let cfg = kernels::per_row(rows).map_err(GpuError::Shape)?;
        let (r, w) = (to_i32(rows)?, to_i32(width)?);
        let mut l = self.stream.launch_builder(self.func("softmax_rows"));
        l.arg(x).arg(y).arg(&r).arg(&w);
        // SAFETY: x and y hold rows*width floats (checked); block r touches
        // row r only.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    /// y = w * x / sqrt(mean(x^2) + eps) over each row.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_rows(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
        rows: usize,
        width: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        check_rows(x.len(), y.len(), rows, width)?;
        if w.len() != width {
            return Err(GpuError::Shape(format!(
                "rmsnorm: weight has {} entries for rows of {width}",
                w.len()
            )));
        }
        let cfg = kernels::per_row(rows).map_err(GpuError::Shape)?;
        let (r, wd) = (to_i32(rows)?, to_i32(width)?);
        let mut l = self.stream.launch_builder(self.func("rmsnorm_rows"));
        l.arg(x).arg(w).arg(y).arg(&r).arg(&wd).arg(&eps);
        // SAFETY: x and y hold rows*width floats and w width (checked).
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
}

fn device_info(ctx: &Arc<CudaContext>) -> Result<DeviceInfo, GpuError> {
    let attr = |a| ctx.attribute(a).unwrap_or(0);
    let mut driver_version = 0;
    // SAFETY: cuDriverGetVersion writes one int; the driver library is loaded
    // (CudaContext::new succeeded).
    unsafe {
        let _ = cudarc::driver::sys::cuDriverGetVersion(&mut driver_version);
    }
    Ok(DeviceInfo {
        name: ctx.name()?,
        compute_capability: ctx.compute_capability()?,
        sm_count: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        total_mem_bytes: ctx.total_mem()?,
        driver_version,
        l2_bytes: attr(Attr::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
        clock_khz: attr(Attr::CU_DEVICE_ATTRIBUTE_CLOCK_RATE),
        max_shared_per_block: attr(Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK),
    })
}

/// A size as the kernels' `int`, or a shape error.
pub fn to_i32(v: usize) -> Result<i32, GpuError> {
    i32::try_from(v).map_err(|_| GpuError::Shape(format!("{v} does not fit the kernels' int")))
}

/// The lengths a matmul needs, with checked products.
pub fn check_matmul(
    a: usize,
    b: usize,
    c: usize,
    m: usize,
    n: usize,
    k: usize,
) -> Result<(), GpuError> {
    let need = |x: usize, y: usize, what: &str, have: usize| -> Result<(), GpuError> {
        let want = x
            .checked_mul(y)
            .ok_or_else(|| GpuError::Shape(format!("{what}: {x} x {y} overflows")))?;
        if want != have {
            return Err(GpuError::Shape(format!(
                "{what}: {x} x {y} = {want} floats expected, buffer has {have}"
            )));
        }
        Ok(())
    };
    need(m, k, "A", a)?;
    need(k, n, "B", b)?;
    need(m, n, "C", c)
}

fn check_rows(x: usize, y: usize, rows: usize, width: usize) -> Result<(), GpuError> {
    let want = rows
        .checked_mul(width)
        .ok_or_else(|| GpuError::Shape(format!("{rows} x {width} overflows")))?;
    if x != want || y != want {
        return Err(GpuError::Shape(format!(
            "rows: {rows} x {width} = {want} floats expected, input has {x}, output {y}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_operands_are_checked_before_launch() {
        assert!(check_matmul(6, 12, 8, 2, 4, 3).is_ok());
        let e = check_matmul(6, 12, 9, 2, 4, 3).unwrap_err().to_string();
        assert!(
            e.contains("C: 2 x 4 = 8 floats expected, buffer has 9"),
            "{e}"
        );
        assert!(check_matmul(0, 0, 0, usize::MAX, 2, 2).is_err());
        assert!(check_rows(10, 10, 2, 5).is_ok());
        assert!(check_rows(10, 9, 2, 5).is_err());
        assert!(to_i32(1 << 31).is_err());
    }

    #[test]
    fn the_peak_follows_the_clock() {
        let info = DeviceInfo {
            sm_count: 132,
            clock_khz: 1_980_000,
            ..Default::default()
        };
        // 132 SMs x 128 lanes x 2 x 1.98 GHz = 66.9 TFLOP/s (H100/H200 SXM).
        let p = info.fp32_peak_flops().unwrap();
        assert!((p / 1e12 - 66.9).abs() < 0.1, "{p}");
        assert_eq!(DeviceInfo::default().fp32_peak_flops(), None);
    }

    #[test]
    fn without_a_driver_opening_a_device_is_an_error_not_a_panic() {
        // CI machines have no NVIDIA driver: `new` must answer NoLibrary. On
        // the GPU machine the same call opens the device.
        match probe::driver() {
            Err(_) => {
                let e = Gpu::new(0).unwrap_err();
                assert!(
                    matches!(
                        e,
                        GpuError::NoLibrary {
                            library: "driver",
                            ..
                        }
                    ),
                    "{e}"
                );
            }
            Ok(lib) => {
                let gpu = Gpu::new(0).unwrap_or_else(|e| panic!("driver {lib} loaded but: {e}"));
                assert!(gpu.info().sm_count > 0);
            }
        }
    }
}
