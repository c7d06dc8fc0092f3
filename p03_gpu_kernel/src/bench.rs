//! `p03_gpu_kernel bench`: every kernel against the ceilings measured on the
//! same device in the same run, as numbers.md rows (median and p95) and a
//! plot.
//!
//! Order of the run: the ceilings first (copy bandwidth, host<->device,
//! launch latency, cuBLAS), then each kernel as a fraction of its ceiling:
//! vector add, softmax and RMSNorm against device copy bandwidth, the
//! matmuls against cuBLAS SGEMM at each size.

use std::path::PathBuf;

use common::numbers::{Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use common::stats::{summarize, Summary};
use common::testdata::uniform;
use cudarc::driver::CudaSlice;

use crate::blas::Blas;
use crate::error::GpuError;
use crate::gpu::Gpu;
use crate::kernels::Matmul;
use crate::timing::{time_auto, time_events, time_host, warm_clocks};

/// What to run and where the rows go.
#[derive(Clone, Debug)]
pub struct BenchArgs {
    /// Square matmul sizes.
    pub sizes: Vec<usize>,
    /// Fewer repetitions (a smoke run; rows still recorded if `record`).
    pub quick: bool,
    /// Append rows to this file (numbers.md, or a file the device returns).
    pub rows: Option<PathBuf>,
    /// The commit the binary was built at (the device has no git).
    pub commit: Option<String>,
    /// Where to write the plot.
    pub plots: Option<PathBuf>,
    pub command: String,
}

/// Time per rep as a summary in seconds (rows take seconds; events give ms).
fn secs(ms: &[f64]) -> Summary {
    let s: Vec<f64> = ms.iter().map(|m| m / 1e3).collect();
    summarize(&s)
}

/// The measured ceilings the kernels are read against.
#[derive(Clone, Copy, Debug)]
pub struct Ceilings {
    /// Device-to-device copy, bytes read + written per second, at median time.
    pub copy_bps: f64,
}

/// Device-to-device copy of `bytes`: cuMemcpyDtoD timed with events. Counts
/// read + write (2 x bytes), as STREAM's copy does.
pub fn copy_bandwidth(gpu: &Gpu, bytes: usize, budget_ms: f64) -> Result<Summary, GpuError> {
    let n = bytes / 4;
    let src = gpu.zeros(n)?;
    let mut dst = gpu.zeros(n)?;
    let ms = time_auto(gpu, budget_ms, || {
        gpu.stream().memcpy_dtod(&src, &mut dst)?;
        Ok(())
    })?;
    Ok(secs(&ms))
}

/// Host-to-device and back, pinned and pageable, timed on the host around
/// copy + synchronise (what a caller waits for): rows in bytes per second.
fn transfers(gpu: &Gpu, bytes: usize, reps: usize) -> Result<Vec<Row>, GpuError> {
    let n = bytes / 4;
    let mut dev = gpu.zeros(n)?;
    let mut pageable = vec![1.0f32; n];
    // SAFETY: the pinned buffer is written (by the device-to-host copy or the
    // fill below) before any host read; flags 0 = plain page-locked memory.
    let mut pinned = unsafe { gpu.context().alloc_pinned_with_flags::<f32>(n, 0) }?;
    pinned.as_mut_slice()?.fill(1.0);
    let mb = bytes >> 20;
    let mut rows = Vec::new();
    let mut push = |what: &str, ms: Vec<f64>, pred: &str| {
        rows.extend(Row::rate_median_p95(
            format!("{what}, {mb} MiB"),
            bytes as f64,
            &secs(&ms),
            "B/s",
            pred,
        ));
    };
    let s = gpu.stream().clone();
    let ms = time_host(gpu, 2, reps, || Ok(s.memcpy_htod(&pinned, &mut dev)?))?;
    push(
        "host->device pinned",
        ms,
        "~50e9 (PCIe 5.0 x16: 64 GB/s raw)",
    );
    let ms = time_host(gpu, 2, reps, || Ok(s.memcpy_htod(&pageable, &mut dev)?))?;
    push(
        "host->device pageable",
        ms,
        "~half of pinned (staged through a pinned bounce buffer)",
    );
    let ms = time_host(gpu, 2, reps, || Ok(s.memcpy_dtoh(&dev, &mut pinned)?))?;
    push("device->host pinned", ms, "~50e9");
    let ms = time_host(gpu, 2, reps, || Ok(s.memcpy_dtoh(&dev, &mut pageable)?))?;
    push("device->host pageable", ms, "~half of pinned");
    Ok(rows)
}

/// Launch latency of the empty kernel: back to back (the stream's launch
/// throughput: events around a batch, divided) and one launch + synchronise
/// at a time (the round trip a caller who waits pays), in seconds.
pub fn launch_latency(
    gpu: &Gpu,
    batch: usize,
    reps: usize,
) -> Result<(Summary, Summary), GpuError> {
    let per_batch = time_events(gpu, 1, reps, || {
        for _ in 0..batch {
            gpu.launch_empty()?;
        }
        Ok(())
    })?;
    let each: Vec<f64> = per_batch.iter().map(|ms| ms / batch as f64).collect();
    let synced = time_host(gpu, 10, reps * 20, || gpu.launch_empty())?;
    Ok((secs(&each), secs(&synced)))
}

/// Bring the clocks up before anything is timed (an idle H200 sits at 345
/// MHz): SGEMM 4096 for `seconds`.
pub fn warm_up(gpu: &Gpu, blas: &Blas, seconds: f64) -> Result<(), GpuError> {
    let n = 4096;
    let a = gpu.zeros(n * n)?;
    let mut c = gpu.zeros(n * n)?;
    warm_clocks(gpu, seconds, || blas.sgemm(&a, &a, &mut c, (n, n, n)))
}

/// Run the whole bench.
pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let gpu = Gpu::new(0)?;
    let blas = Blas::new(&gpu)?;
    let info = gpu.info().clone();
    println!("device: {}", info.describe());
    if let Some(p) = info.fp32_peak_flops() {
        println!("  FP32 FMA peak from the clock: {:.1} TFLOP/s", p / 1e12);
    }
    let q = args.quick;
    // Device time per measured point (time_auto batches short work).
    let budget_ms = if q { 50.0 } else { 300.0 };
    let mut rows = Vec::new();
    warm_up(&gpu, &blas, if q { 0.2 } else { 0.5 })?;

    // ---- ceilings ---------------------------------------------------------
    let copy_bytes = 1usize << 30;
    let copy = copy_bandwidth(&gpu, copy_bytes, budget_ms)?;
    let ceil = Ceilings {
        copy_bps: 2.0 * copy_bytes as f64 / copy.median,
    };
    println!(
        "device copy 1 GiB: {:.0} GB/s (read + write)",
        ceil.copy_bps / 1e9
    );
    rows.extend(Row::rate_median_p95(
        "device copy (cuMemcpyDtoD) 1 GiB, bytes read + written",
        2.0 * copy_bytes as f64,
        &copy,
        "B/s",
        "~4.0e12 (83% of the H200's 4.8 TB/s HBM3e)",
    ));
    rows.extend(transfers(&gpu, 256 << 20, if q { 3 } else { 10 })?);
    let (b2b, synced) = launch_latency(&gpu, 1000, if q { 3 } else { 10 })?;
    println!(
        "launch: {:.2} us back to back, {:.2} us with a synchronise",
        b2b.median * 1e6,
        synced.median * 1e6
    );
    rows.extend(Row::median_p95(
        "empty kernel launch, back to back",
        b2b.median,
        b2b.p95,
        "s",
        "~2.5e-6",
    ));
    rows.extend(Row::median_p95(
        "empty kernel launch + synchronise",
        synced.median,
        synced.p95,
        "s",
        "~8e-6",
    ));

    // ---- vector add against copy bandwidth --------------------------------
    let n = 1usize << 28; // 1 GiB per array
    let (a, b) = (gpu.upload(&uniform(n, 1))?, gpu.upload(&uniform(n, 2))?);
    let mut c = gpu.zeros(n)?;
    for (vec4, name, pred) in [
        (false, "vector add (grid-stride)", "~0.85 of copy"),
        (true, "vector add float4 (grid-stride)", "~0.90 of copy"),
    ] {
        let s = secs(&time_auto(&gpu, budget_ms, || {
            gpu.vector_add(&a, &b, &mut c, vec4)
        })?);
        let bps = 12.0 * n as f64 / s.median;
        println!(
            "{name}: {:.0} GB/s = {:.3} of copy",
            bps / 1e9,
            bps / ceil.copy_bps
        );
        rows.extend(Row::rate_median_p95(
            format!("{name}, 2^28 floats, bytes moved"),
            12.0 * n as f64,
            &s,
            "B/s",
            "",
        ));
        rows.push(
            Row::new(
                format!("{name} / device copy bandwidth"),
                bps / ceil.copy_bps,
                "ratio",
            )
            .predicted(pred),
        );
    }
    drop((a, b, c));
    // End to end: copies in, kernel, copy out, as a caller of p01's add sees it.
    let n = 1usize << 24;
    let (ha, hb) = (uniform(n, 3), uniform(n, 4));
    let mut hc = vec![0.0f32; n];
    let e2e = secs(&time_host(&gpu, 1, if q { 3 } else { 10 }, || {
        let a = gpu.upload(&ha)?;
        let b = gpu.upload(&hb)?;
        let mut c = gpu.zeros(n)?;
        gpu.vector_add(&a, &b, &mut c, true)?;
        gpu.stream().memcpy_dtoh(&c, &mut hc)?;
        Ok(())
    })?);
    rows.extend(Row::median_p95(
        "vector add 2^24 floats end to end (pageable copies in and out)",
        e2e.median,
        e2e.p95,
        "s",
        "~10x the kernel: 192 MiB over PCIe vs 192 MiB over HBM",
    ));

    // ---- softmax and RMSNorm: memory-bound rows ---------------------------
    for (rows_n, width) in [(4096usize, 4096usize), (64, 49_152)] {
        let total = rows_n * width;
        let x = gpu.upload(&uniform(total, 5))?;
        let w = gpu.upload(&uniform(width, 6))?;
        let mut y = gpu.zeros(total)?;
        let bytes = 8.0 * total as f64; // read x once, write y once (the ideal)
        let s = secs(&time_auto(&gpu, budget_ms, || {
            gpu.softmax_rows(&x, &mut y, rows_n, width)
        })?);
        let r = secs(&time_auto(&gpu, budget_ms, || {
            gpu.rmsnorm_rows(&x, &w, &mut y, rows_n, width, 1e-5)
        })?);
        // 64 rows are 64 blocks on 132 SMs: half the machine idles.
        let (ps, pr) = if rows_n >= 1024 {
            (
                "~0.6 of copy: three passes over each row, two from cache",
                "~0.7 of copy: two passes, one from cache",
            )
        } else {
            (
                "~0.25 of copy: 64 blocks for 132 SMs",
                "~0.3 of copy: 64 blocks for 132 SMs",
            )
        };
        for (name, sum, pred) in [("softmax rows", s, ps), ("RMSNorm rows", r, pr)] {
            let bps = bytes / sum.median;
            println!(
                "{name} {rows_n}x{width}: {:.0} GB/s = {:.3} of copy",
                bps / 1e9,
                bps / ceil.copy_bps
            );
            rows.extend(Row::rate_median_p95(
                format!("{name} {rows_n}x{width}, ideal bytes (x in, y out)"),
                bytes,
                &sum,
                "B/s",
                "",
            ));
            rows.push(
                Row::new(
                    format!("{name} {rows_n}x{width} / device copy bandwidth"),
                    bps / ceil.copy_bps,
                    "ratio",
                )
                .predicted(pred),
            );
        }
    }

    // ---- matmuls against cuBLAS SGEMM -------------------------------------
    let mut curves: Vec<Series> = Matmul::ALL
        .iter()
        .map(|m| Series::new(m.label(), Vec::new()))
        .collect();
    let mut cublas_curve = Series::new("cuBLAS SGEMM (FP32)", Vec::new());
    for &size in &args.sizes {
        let (m, n, k) = (size, size, size);
        let flops = 2.0 * (m * n * k) as f64;
        let a = gpu.upload(&uniform(m * k, 7))?;
        let b = gpu.upload(&uniform(k * n, 8))?;
        let mut c = gpu.zeros(m * n)?;
        let peer = time_matmul(&gpu, q, |c| blas.sgemm(&a, &b, c, (m, n, k)), &mut c)?;
        let peer_fps = flops / peer.median;
        cublas_curve.points.push((size as f64, peer_fps / 1e9));
        rows.extend(Row::rate_median_p95(
            format!("cuBLAS SGEMM {size}^3"),
            flops,
            &peer,
            "FLOP/s",
            if size == 4096 {
                "~48e12 (0.72 of the 67 TFLOP/s FP32 peak)"
            } else {
                ""
            },
        ));
        println!("{size}: cuBLAS {:.1} TFLOP/s", peer_fps / 1e12);
        for (i, kind) in Matmul::ALL.into_iter().enumerate() {
            let s = time_matmul(&gpu, q, |c| gpu.matmul(kind, &a, &b, c, m, n, k), &mut c)?;
            let fps = flops / s.median;
            curves[i].points.push((size as f64, fps / 1e9));
            println!(
                "{size}: {:<30} {:>7.2} TFLOP/s = {:.3} of cuBLAS",
                kind.label(),
                fps / 1e12,
                fps / peer_fps
            );
            rows.extend(Row::rate_median_p95(
                format!("matmul {} {size}^3", kind.label()),
                flops,
                &s,
                "FLOP/s",
                "",
            ));
            let pred = match (kind, size) {
                (Matmul::Naive, 4096) => "~0.08",
                (Matmul::Tiled, 4096) => "~0.15",
                (Matmul::RegBlock, 4096) => "~0.5 (target >= 0.5, stretch 0.7)",
                _ => "",
            };
            rows.push(
                Row::new(
                    format!("matmul {} {size}^3 / cuBLAS SGEMM", kind.label()),
                    fps / peer_fps,
                    "ratio",
                )
                .predicted(pred),
            );
        }
    }
    // End to end at 4096: upload A and B, the best kernel, download C.
    if args.sizes.contains(&4096) {
        let s = 4096usize;
        let (ha, hb) = (uniform(s * s, 9), uniform(s * s, 10));
        let e2e = secs(&time_host(&gpu, 1, if q { 2 } else { 5 }, || {
            let a = gpu.upload(&ha)?;
            let b = gpu.upload(&hb)?;
            let mut c = gpu.zeros(s * s)?;
            gpu.matmul(Matmul::RegBlock, &a, &b, &mut c, s, s, s)?;
            let _ = gpu.download(&c)?;
            Ok(())
        })?);
        rows.extend(Row::median_p95(
            "matmul register-blocked 4096^3 end to end (pageable copies of A, B in and C out)",
            e2e.median,
            e2e.p95,
            "s",
            "kernel + 192 MiB over PCIe (~4-8 ms)",
        ));
    }

    if let Some(path) = &args.rows {
        let mut rec = Recorder::new(path.clone(), &args.command).machine_note(&info.describe());
        if let Some(c) = &args.commit {
            rec = rec.with_commit(c);
        }
        rec.append(&rows)?;
        println!("{} rows -> {}", rows.len(), path.display());
    }
    if let Some(dir) = &args.plots {
        curves.push(cublas_curve);
        let drawn = line_chart(
            &dir.join("matmul.png"),
            Labels {
                title: &format!("FP32 matmul on {} (kernel time, median)", info.name),
                x: "N (square N x N x N)",
                y: "GFLOP/s",
            },
            &curves,
            Scale::LogLog,
        );
        // The rows are already written: a machine without fonts loses the
        // picture, not the measurements.
        match drawn {
            Ok(()) => println!("plot: {}", dir.join("matmul.png").display()),
            Err(e) => eprintln!("warning: {e}"),
        }
    }
    Ok(())
}

/// Time one matmul within about 0.5 s of device time (0.1 s quick).
fn time_matmul(
    gpu: &Gpu,
    quick: bool,
    mut f: impl FnMut(&mut CudaSlice<f32>) -> Result<(), GpuError>,
    c: &mut CudaSlice<f32>,
) -> Result<Summary, GpuError> {
    Ok(secs(&time_auto(
        gpu,
        if quick { 100.0 } else { 500.0 },
        || f(c),
    )?))
}
