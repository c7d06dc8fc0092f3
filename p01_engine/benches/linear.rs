//! Criterion: the packed linear (AVX2 when available, and the portable path)
//! against the naive reference, at the MLP's fc1 shape (784 -> 256).

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use p01_engine::linear::{linear_ref, Activation, Kernel, Linear};

fn bench_linear(c: &mut Criterion) {
    let (in_f, out_f) = (784, 256);
    let w: Vec<f32> = (0..in_f * out_f)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let b: Vec<f32> = (0..out_f).map(|i| i as f32 / out_f as f32).collect();
    let lin = Linear::new(&w, Some(&b), out_f, in_f);
    let mut g = c.benchmark_group("linear_784x256");
    for rows in [1usize, 64] {
        let x: Vec<f32> = (0..rows * in_f)
            .map(|i| ((i * 31) % 255) as f32 / 255.0)
            .collect();
        let mut y = vec![0.0; rows * out_f];
        g.throughput(Throughput::Elements((2 * rows * in_f * out_f) as u64));
        g.bench_with_input(BenchmarkId::new("naive", rows), &rows, |bch, &r| {
            bch.iter(|| linear_ref(&x, r, &w, Some(&b), out_f))
        });
        for kernel in [Kernel::Portable, Kernel::detect()] {
            g.bench_with_input(
                BenchmarkId::new(format!("packed_{kernel:?}"), rows),
                &rows,
                |bch, &r| bch.iter(|| lin.forward_with(kernel, &x, r, &mut y, Activation::None, 1)),
            );
        }
    }
    g.finish();
}

criterion_group!(benches, bench_linear);

/// criterion_main!, plus rows for numbers.md: the median and p95 of each
/// benchmark's samples and criterion's own median estimate
/// (`common::criterion_rows`), appended only under `cargo bench`.
fn main() {
    let since = std::time::SystemTime::now();
    benches();
    Criterion::default().configure_from_args().final_summary();
    common::criterion_rows::record_cargo_bench("p01_engine", since);
}
