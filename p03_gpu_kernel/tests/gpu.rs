//! Every kernel against its CPU reference, on the GPU. Run by
//! `scripts/gpu_check.sh` on the device machine (`--ignored`); on a machine
//! without CUDA they are ignored, never passed.
//!
//! Shapes include sizes that are not multiples of any tile or of 4, so the
//! guarded loads, the float4 fallbacks and the tails are all exercised.

use p02_matmul_bench::{MatMut, MatRef};
use p03_gpu_kernel::blas::Blas;
use p03_gpu_kernel::reference::{
    error_bound, first_outside, gemm_ref, rmsnorm_rows_ref, row_op_bound, softmax_rows_inplace,
};
use p03_gpu_kernel::timing::time_events;
use p03_gpu_kernel::{Gpu, GpuError, Matmul};

fn gpu() -> Gpu {
    Gpu::new(0).unwrap_or_else(|e| panic!("{e}"))
}

/// `n` values uniform in [-scale, scale), the same for the same `seed`.
fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    common::testdata::uniform(n, seed)
        .into_iter()
        .map(|v| v * scale)
        .collect()
}

/// The CPU product and its per-element error scale.
fn reference_matmul(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> (Vec<f32>, Vec<f64>) {
    let mut c = vec![0.0f32; m * n];
    let scale = gemm_ref(
        1.0,
        MatRef::row_major(a, m, k).unwrap(),
        MatRef::row_major(b, k, n).unwrap(),
        0.0,
        &mut MatMut::row_major(&mut c, m, n).unwrap(),
        None,
    );
    (c, scale)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn vector_add_matches_the_cpu_bit_for_bit() {
    let g = gpu();
    // n % 4 != 0 exercises the float4 kernel's tail; 1 and 3 the tail alone.
    for n in [1usize, 3, 1000, 1 << 20, (1 << 22) + 3] {
        let (ha, hb) = (random(n, 1, 10.0), random(n, 2, 10.0));
        let want: Vec<f32> = ha.iter().zip(&hb).map(|(a, b)| a + b).collect();
        let (a, b) = (g.upload(&ha).unwrap(), g.upload(&hb).unwrap());
        for vec4 in [false, true] {
            let mut c = g.zeros(n).unwrap();
            g.vector_add(&a, &b, &mut c, vec4).unwrap();
            assert_eq!(g.download(&c).unwrap(), want, "n={n} float4={vec4}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_matmul_is_within_the_error_bound_of_the_f64_reference() {
    let g = gpu();
    let blas = Blas::new(&g).unwrap();
    for (m, n, k) in [
        (1, 1, 1),
        (17, 33, 9),
        (128, 128, 128),
        (129, 257, 67),
        (200, 130, 515),
        (512, 512, 512),
        (1024, 1024, 1024),
    ] {
        let (ha, hb) = (random(m * k, 3, 1.0), random(k * n, 4, 1.0));
        let (want, scale) = reference_matmul(&ha, &hb, m, n, k);
        let (a, b) = (g.upload(&ha).unwrap(), g.upload(&hb).unwrap());
        for kind in Matmul::ALL {
            let mut c = g.zeros(m * n).unwrap();
            g.matmul(kind, &a, &b, &mut c, m, n, k).unwrap();
            let got = g.download(&c).unwrap();
            if let Some((i, gv, wv, bound)) =
                first_outside(&got, &want, |i| error_bound(k, scale[i]))
            {
                panic!(
                    "{kind:?} {m}x{n}x{k}: C[{}, {}] = {gv}, reference {wv}, bound {bound:e}",
                    i / n,
                    i % n
                );
            }
        }
        let mut c = g.zeros(m * n).unwrap();
        blas.sgemm(&a, &b, &mut c, (m, n, k)).unwrap();
        let got = g.download(&c).unwrap();
        assert!(
            first_outside(&got, &want, |i| error_bound(k, scale[i])).is_none(),
            "cuBLAS {m}x{n}x{k}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn softmax_rows_match_project_01() {
    let g = gpu();
    // Widths below, at and above the block of 256; a vocabulary-sized row;
    // large logits (exp would overflow without the max subtraction).
    for (rows, width, scale) in [
        (3, 1, 1.0),
        (5, 7, 1.0),
        (64, 256, 5.0),
        (33, 1000, 30.0),
        (4, 49_152, 100.0),
    ] {
        let hx = random(rows * width, 5, scale);
        let mut want = hx.clone();
        softmax_rows_inplace(&mut want, width);
        let x = g.upload(&hx).unwrap();
        let mut y = g.zeros(rows * width).unwrap();
        g.softmax_rows(&x, &mut y, rows, width).unwrap();
        let got = g.download(&y).unwrap();
        if let Some((i, gv, wv, b)) = first_outside(&got, &want, |i| row_op_bound(width, want[i])) {
            panic!("softmax {rows}x{width}: y[{i}] = {gv}, reference {wv}, bound {b:e}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rmsnorm_rows_match_project_04s_formula() {
    let g = gpu();
    for (rows, width) in [(1, 1), (3, 7), (64, 576), (17, 1537), (2, 49_152)] {
        let hx = random(rows * width, 6, 3.0);
        let hw = random(width, 7, 1.0);
        let want = rmsnorm_rows_ref(&hx, width, &hw, 1e-5);
        let (x, w) = (g.upload(&hx).unwrap(), g.upload(&hw).unwrap());
        let mut y = g.zeros(rows * width).unwrap();
        g.rmsnorm_rows(&x, &w, &mut y, rows, width, 1e-5).unwrap();
        let got = g.download(&y).unwrap();
        if let Some((i, gv, wv, b)) = first_outside(&got, &want, |i| row_op_bound(width, want[i])) {
            panic!("rmsnorm {rows}x{width}: y[{i}] = {gv}, reference {wv}, bound {b:e}");
        }
    }
}

/// cuBLAS in a 16-bit type `T` against the f64 reference of the inputs
/// rounded to `T`: f32 accumulation, then one rounding of the output to `T`
/// (`out_bits` of mantissa: 2^-out_bits relative).
fn check_half_gemm<T>(
    to: fn(f32) -> T,
    back: fn(T) -> f32,
    one: T,
    zero: T,
    out_bits: i32,
    name: &str,
) where
    T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + Default + Unpin,
    cudarc::cublas::CudaBlas: cudarc::cublas::Gemm<T>,
{
    let g = gpu();
    let blas = Blas::new(&g).unwrap();
    let (m, n, k) = (64, 96, 128);
    let (ha, hb) = (random(m * k, 8, 1.0), random(k * n, 9, 1.0));
    let rounded = |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| back(to(x))).collect() };
    let (want, scale) = reference_matmul(&rounded(&ha), &rounded(&hb), m, n, k);
    let up = |v: &[f32]| {
        g.stream()
            .clone_htod(&v.iter().map(|&x| to(x)).collect::<Vec<T>>())
            .unwrap()
    };
    let (a, b) = (up(&ha), up(&hb));
    let mut c = g.stream().alloc_zeros::<T>(m * n).unwrap();
    blas.gemm(&a, &b, &mut c, m, n, k, one, zero).unwrap();
    let got: Vec<f32> = g
        .stream()
        .clone_dtoh(&c)
        .unwrap()
        .into_iter()
        .map(back)
        .collect();
    let bound =
        |i: usize| error_bound(k, scale[i]) + f64::from(want[i].abs()) * 2f64.powi(-out_bits);
    if let Some((i, gv, wv, b)) = first_outside(&got, &want, bound) {
        panic!(
            "{name} GEMM: C[{}, {}] = {gv}, reference {wv}, bound {b:e}",
            i / n,
            i % n
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn half_precision_cublas_agrees_with_f32_within_half_rounding() {
    use half::{bf16, f16};
    check_half_gemm(f16::from_f32, f16::to_f32, f16::ONE, f16::ZERO, 11, "f16");
    check_half_gemm(
        bf16::from_f32,
        bf16::to_f32,
        bf16::ONE,
        bf16::ZERO,
        8,
        "bf16",
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn wrong_operand_sizes_are_refused_before_launch() {
    let g = gpu();
    let a = g.zeros(6).unwrap();
    let b = g.zeros(12).unwrap();
    let mut c = g.zeros(9).unwrap();
    let e = g
        .matmul(Matmul::Tiled, &a, &b, &mut c, 2, 4, 3)
        .unwrap_err();
    assert!(matches!(e, GpuError::Shape(_)), "{e}");
    let mut short = g.zeros(5).unwrap();
    assert!(g.vector_add(&a, &a, &mut short, true).is_err());
    assert!(g.softmax_rows(&a, &mut short, 2, 3).is_err());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn events_time_the_kernel_not_the_launch() {
    let g = gpu();
    let n = 4096;
    let a = g.upload(&random(n * n, 10, 1.0)).unwrap();
    let mut c = g.zeros(n * n).unwrap();
    // The launch returns at once; the naive 4096^3 product takes
    // milliseconds. Host time around the launch alone is far below the
    // event time, which is the point of the lesson.
    let t = std::time::Instant::now();
    g.matmul(Matmul::Naive, &a, &a, &mut c, n, n, n).unwrap();
    let launch_ms = t.elapsed().as_secs_f64() * 1e3;
    g.sync().unwrap();
    let ev = time_events(&g, 0, 3, || {
        g.matmul(Matmul::Naive, &a, &a, &mut c, n, n, n)
    })
    .unwrap();
    assert!(ev.iter().all(|&ms| ms > 1.0), "{ev:?}");
    assert!(
        launch_ms < ev[0] / 10.0,
        "launch {launch_ms} ms vs kernel {} ms",
        ev[0]
    );
}
