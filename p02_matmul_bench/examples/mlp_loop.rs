//! Profiling aid: run the MNIST MLP through sgemm in a loop
//! (`perf record cargo run --release -p p02_matmul_bench --example mlp_loop -- 256`).
fn main() -> anyhow::Result<()> {
    let batch: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(256);
    let iters: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let threads: usize = std::env::args()
        .nth(3)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let dir = p01_engine::fixtures_dir();
    let mlp = p02_matmul_bench::mlp::Mlp::load(&dir.join("mlp/weights.safetensors"))?;
    let x: Vec<f32> = (0..batch * 784).map(|i| (i % 255) as f32 / 255.0).collect();
    let mut bufs = p02_matmul_bench::mlp::MlpBuffers::default();
    let inside = std::env::args().nth(4).is_some_and(|s| s == "inside");
    let mut run = || -> anyhow::Result<f64> {
        let t = std::time::Instant::now();
        for _ in 0..iters {
            std::hint::black_box(mlp.forward(&x, batch, &mut bufs, threads)?);
        }
        Ok(t.elapsed().as_secs_f64() * 1e6 / iters as f64)
    };
    // "inside": run the loop on a pool worker, so the caller is not parked
    // and woken around every parallel call.
    let us = if inside {
        rayon::scope(|_| run())?
    } else {
        run()?
    };
    println!("{us:.1} us per call");
    Ok(())
}
