//! Criterion: sgemm (packed, 1 thread) beside the `matrixmultiply` and `gemm`
//! crates (1 thread) at N = 256 and 1024, and the M = 1 GEMV path on a
//! SmolLM2 MLP weight (1536 x 576).

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use p02_matmul_bench::{sgemm, GemmOpts, MatMut, MatRef};

fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919 + seed) % 1000) as f32 / 1000.0 - 0.5)
        .collect()
}

fn bench_square(c: &mut Criterion) {
    let mut g = c.benchmark_group("sgemm_square_1t");
    g.sample_size(10);
    for n in [256usize, 1024] {
        let (a, b) = (data(n * n, 1), data(n * n, 2));
        let mut out = vec![0.0f32; n * n];
        g.throughput(Throughput::Elements(2 * (n * n * n) as u64));
        let opts = GemmOpts {
            threads: 1,
            ..GemmOpts::default()
        };
        g.bench_with_input(BenchmarkId::new("ours", n), &n, |bch, &n| {
            bch.iter(|| {
                let av = MatRef::row_major(&a, n, n).unwrap();
                let bv = MatRef::row_major(&b, n, n).unwrap();
                sgemm(
                    av,
                    bv,
                    &mut MatMut::row_major(&mut out, n, n).unwrap(),
                    opts,
                )
                .unwrap()
            })
        });
        g.bench_with_input(BenchmarkId::new("matrixmultiply", n), &n, |bch, &n| {
            bch.iter(|| p02_matmul_bench::peers::matrixmultiply_sgemm(n, n, n, &a, &b, &mut out))
        });
        g.bench_with_input(BenchmarkId::new("gemm_crate", n), &n, |bch, &n| {
            bch.iter(|| p02_matmul_bench::peers::gemm_crate_sgemm(n, n, n, &a, &b, &mut out, 1))
        });
    }
    g.finish();
}

fn bench_gemv(c: &mut Criterion) {
    let (out_f, in_f) = (1536usize, 576usize);
    let (x, w) = (data(in_f, 3), data(out_f * in_f, 4));
    let mut y = vec![0.0f32; out_f];
    let mut g = c.benchmark_group("gemv_1536x576_1t");
    g.throughput(Throughput::Bytes((out_f * in_f * 4) as u64));
    g.bench_function("ours", |bch| {
        bch.iter(|| p02_matmul_bench::linear(&x, 1, &w, out_f, None, &mut y, 1).unwrap())
    });
    g.bench_function("naive", |bch| {
        bch.iter(|| {
            for (o, yo) in y.iter_mut().enumerate() {
                *yo = w[o * in_f..(o + 1) * in_f]
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| a * b)
                    .sum();
            }
        })
    });
    g.finish();
}

criterion_group!(benches, bench_square, bench_gemv);

/// criterion_main!, plus rows for numbers.md: the median and p95 of each
/// benchmark's samples and criterion's own median estimate
/// (`common::criterion_rows`), appended only under `cargo bench`.
fn main() {
    let since = std::time::SystemTime::now();
    benches();
    Criterion::default().configure_from_args().final_summary();
    common::criterion_rows::record_cargo_bench("p02_matmul_bench", since);
}
