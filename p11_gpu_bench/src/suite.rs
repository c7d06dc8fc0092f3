//! `p11_gpu_bench run`: everything, in one command, into rows, JSON and
//! plots. The order: launch latency, HBM sweep, transfers, GEMMs, Project
//! 03's kernels (for the roofline), the spread runs; then the roofline from
//! the ceilings this run measured.

use std::path::PathBuf;

use common::testdata::uniform;
use p03_gpu_kernel::bench::{launch_latency, warm_up};
use p03_gpu_kernel::blas::Blas;
use p03_gpu_kernel::timing::{time_auto, time_host};
use p03_gpu_kernel::{Gpu, Matmul};

use crate::gemm::{self, Precision, Shape};
use crate::memory::{self, Kernel, Stream};
use crate::report::{write_outputs, Report};
use crate::roofline::{Point, Roofline};
use crate::spread::Spread;

/// What to run and where its output goes.
#[derive(Clone, Debug)]
pub struct SuiteArgs {
    /// Smaller sizes and fewer repetitions: a smoke run.
    pub quick: bool,
    /// Directory for suite.json and plots/.
    pub out: PathBuf,
    /// Append rows here (numbers.md or a file the device returns).
    pub rows: Option<PathBuf>,
    pub commit: Option<String>,
    /// Independent runs for the spread.
    pub runs: usize,
    pub command: String,
}

fn median_s(ms: &[f64]) -> f64 {
    common::stats::summarize(ms).median / 1e3
}

/// Project 03's kernels at one size each, as roofline points (FLOPs and the
/// minimum bytes: what each must read and write once).
fn p03_points(gpu: &Gpu, budget_ms: f64) -> anyhow::Result<Vec<Point>> {
    let mut pts = Vec::new();
    let n = 1usize << 26;
    let (a, b) = (gpu.upload(&uniform(n, 1))?, gpu.upload(&uniform(n, 2))?);
    let mut c = gpu.zeros(n)?;
    let t = median_s(&time_auto(gpu, budget_ms, || {
        gpu.vector_add(&a, &b, &mut c, true)
    })?);
    pts.push(Point {
        name: "p03 vector add (float4)".into(),
        intensity: 1.0 / 12.0,
        flops: n as f64 / t,
    });
    let (rows, width) = (4096usize, 4096usize);
    let x = gpu.upload(&uniform(rows * width, 3))?;
    let w = gpu.upload(&uniform(width, 4))?;
    let mut y = gpu.zeros(rows * width)?;
    let elems = (rows * width) as f64;
    let t = median_s(&time_auto(gpu, budget_ms, || {
        gpu.softmax_rows(&x, &mut y, rows, width)
    })?);
    // max, subtract, exp, add, multiply: 5 per element over 8 bytes.
    pts.push(Point {
        name: "p03 softmax rows".into(),
        intensity: 5.0 / 8.0,
        flops: 5.0 * elems / t,
    });
    let t = median_s(&time_auto(gpu, budget_ms, || {
        gpu.rmsnorm_rows(&x, &w, &mut y, rows, width, 1e-5)
    })?);
    // square-and-add, two multiplies: 4 per element over 8 bytes.
    pts.push(Point {
        name: "p03 RMSNorm rows".into(),
        intensity: 4.0 / 8.0,
        flops: 4.0 * elems / t,
    });
    let s = 4096usize;
    let sh = Shape { m: s, n: s, k: s };
    let (a, b) = (
        gpu.upload(&uniform(s * s, 5))?,
        gpu.upload(&uniform(s * s, 6))?,
    );
    let mut c = gpu.zeros(s * s)?;
    for kind in Matmul::ALL {
        let ms = time_auto(gpu, budget_ms, || gpu.matmul(kind, &a, &b, &mut c, s, s, s))?;
        pts.push(Point {
            name: format!("p03 matmul {} 4096", kind.label()),
            intensity: sh.intensity(Precision::F32),
            flops: sh.flops() / median_s(&ms),
        });
    }
    Ok(pts)
}

/// The spread runs: each measurement `runs` times, its own warm-up each.
fn spreads(gpu: &Gpu, stream: &Stream, runs: usize, quick: bool) -> anyhow::Result<Vec<Spread>> {
    let bytes = if quick { 64usize << 20 } else { 1 << 30 };
    let n = bytes / 4;
    let (mut a, mut b, c) = (gpu.zeros(n)?, gpu.zeros(n)?, gpu.zeros(n)?);
    let mut partial = gpu.zeros(stream.read_threads(n / 4))?;
    let passes = memory::passes_for(Kernel::Copy, bytes);
    let (mut copy, mut sgemm, mut bf, mut launch, mut h2d) =
        (vec![], vec![], vec![], vec![], vec![]);
    let sq = if quick { 1024 } else { 4096 };
    let shape = [Shape {
        m: sq,
        n: sq,
        k: sq,
    }];
    let pinned_n = if quick { 4 << 20 } else { 64 << 20 };
    let mut dev = gpu.zeros(pinned_n)?;
    // SAFETY: filled before use; plain page-locked memory.
    let mut pinned = unsafe { gpu.context().alloc_pinned_with_flags::<f32>(pinned_n, 0) }?;
    pinned.as_mut_slice()?.fill(1.0);
    for _ in 0..runs {
        let ms = time_auto(gpu, 50.0, || {
            stream.launch(Kernel::Copy, &mut a, &mut b, &c, &mut partial, passes)
        })?;
        copy.push(2.0 * bytes as f64 * f64::from(passes) / median_s(&ms));
        let g = gemm::sweep(gpu, &shape, &[Precision::F32, Precision::Bf16], 100.0)?;
        sgemm.push(g[0].median_flops);
        bf.push(g[1].median_flops);
        let (_, synced) = launch_latency(gpu, 100, 5)?;
        launch.push(synced.median);
        let s = gpu.stream().clone();
        let ms = time_host(gpu, 2, 10, || Ok(s.memcpy_htod(&pinned, &mut dev)?))?;
        h2d.push(4.0 * pinned_n as f64 / median_s(&ms));
    }
    Ok(vec![
        Spread::of(format!("HBM copy {} MiB, B/s", bytes >> 20), copy),
        Spread::of(format!("cuBLAS SGEMM {sq}^3, FLOP/s"), sgemm),
        Spread::of(format!("cuBLAS BF16 GEMM {sq}^3, FLOP/s"), bf),
        Spread::of("empty kernel launch + synchronise, s", launch),
        Spread::of(format!("H2D pinned {} MiB, B/s", pinned_n >> 18), h2d),
    ])
}

/// Run the suite.
pub fn run(args: &SuiteArgs) -> anyhow::Result<Report> {
    let gpu = Gpu::new(0)?;
    let info = gpu.info().clone();
    println!("device: {}", info.describe());
    let q = args.quick;
    // Device time per measured point (time_auto batches short work).
    let budget_ms = if q { 30.0 } else { 150.0 };
    // Clocks up first (an idle GPU sits far below its top clock).
    warm_up(&gpu, &Blas::new(&gpu)?, if q { 0.2 } else { 0.5 })?;

    let (b2b, synced) = launch_latency(&gpu, 1000, if q { 3 } else { 10 })?;
    println!(
        "launch: {:.2} us back to back, {:.2} us synced",
        b2b.median * 1e6,
        synced.median * 1e6
    );

    let stream = Stream::load(&gpu)?;
    let hbm = stream.sweep(
        &memory::sizes(if q { 256 << 20 } else { 2 << 30 }),
        budget_ms,
    )?;
    for p in hbm.iter().filter(|p| p.kernel == Kernel::Copy) {
        println!(
            "copy {:>10} B/array: {:>7.0} GB/s",
            p.array_bytes,
            p.median_bps / 1e9
        );
    }
    let transfers = memory::transfers(
        &gpu,
        &memory::transfer_sizes(if q { 64 << 20 } else { 1 << 30 }),
        if q { 3 } else { 10 },
    )?;

    let squares: &[usize] = if q {
        &[1024, 2048]
    } else {
        &[1024, 2048, 4096, 8192]
    };
    let (sq, sk) = gemm::shapes(squares, 4096, 4096);
    let all: Vec<Shape> = sq.iter().chain(&sk).copied().collect();
    let gemm = gemm::sweep(&gpu, &all, &Precision::ALL, budget_ms)?;
    for g in &gemm {
        println!(
            "{} {}x{}x{}: {:.1} TFLOP/s, {:.0} GB/s",
            g.precision.label(),
            g.shape.m,
            g.shape.n,
            g.shape.k,
            g.median_flops / 1e12,
            g.median_bps / 1e9
        );
    }
    let kernels = p03_points(&gpu, budget_ms)?;
    let spread = spreads(&gpu, &stream, args.runs, q)?;

    // ---- the roofline from this run's ceilings -----------------------------
    let largest = hbm.iter().map(|p| p.array_bytes).max().unwrap_or(0);
    let memory_bps = hbm
        .iter()
        .filter(|p| p.kernel == Kernel::Copy && p.array_bytes == largest)
        .map(|p| p.median_bps)
        .fold(0.0, f64::max);
    let best = |p: Precision| {
        gemm.iter()
            .filter(|g| g.precision == p)
            .map(|g| g.median_flops)
            .fold(0.0, f64::max)
    };
    let roofline = Roofline {
        memory_bps,
        compute: vec![
            ("fp32 (best cuBLAS SGEMM)".into(), best(Precision::F32)),
            ("bf16 (best cuBLAS GEMM)".into(), best(Precision::Bf16)),
        ],
    };
    let mut points = kernels.clone();
    for g in gemm.iter().filter(|g| g.precision != Precision::F16) {
        let sh = g.shape;
        if sh.m == sh.n || sh.m == 1 || sh.m == 64 {
            points.push(Point {
                name: format!("cuBLAS {} {}x{}x{}", g.precision.label(), sh.m, sh.n, sh.k),
                intensity: sh.intensity(g.precision),
                flops: g.median_flops,
            });
        }
    }

    let report = Report {
        device: info.describe(),
        l2_bytes: info.l2_bytes,
        launch_back_to_back_s: b2b.median,
        launch_synced_s: synced.median,
        hbm,
        transfers,
        gemm,
        kernels,
        roofline,
        spread,
    };
    write_outputs(args, &report, &points)?;
    Ok(report)
}
