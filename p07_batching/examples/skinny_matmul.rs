//! Where a batched decode step's time goes: SmolLM2's projection shapes at
//! M = 1..32 rows through p04's packed `Proj` (p02's sgemm), per call.
//!
//!   cargo run --release -p p07_batching --example skinny_matmul

use std::time::Duration;

use common::stats::{time_it, BenchConfig};
use p04_transformer::llama::Proj;

fn main() {
    let threads = rayon::current_num_threads();
    let shapes = [
        ("q/o 576x576", 576, 576),
        ("gate 576->1536", 576, 1536),
        ("down 1536->576", 1536, 576),
        ("head 576->49152", 576, 49152),
    ];
    let cfg = BenchConfig {
        warmup_iters: 3,
        min_samples: 15,
        min_time: Duration::ZERO,
        max_samples: 15,
    };
    println!(
        "{:>18} {:>4} {:>10} {:>10} {:>8}",
        "shape", "M", "us", "us/row", "GFLOP/s"
    );
    for (name, k, n) in shapes {
        let w = common::testdata::uniform(k * n, 1);
        let p = Proj::new(&w, n, k).unwrap();
        for m in [1usize, 2, 4, 6, 8, 12, 16, 24, 32] {
            let x = common::testdata::uniform(m * k, 2);
            let mut y = vec![0.0f32; m * n];
            let s = time_it(cfg, || p.apply_into(&x, m, &mut y, threads).unwrap());
            println!(
                "{name:>18} {m:>4} {:>10.1} {:>10.1} {:>8.1}",
                s.median * 1e6,
                s.median * 1e6 / m as f64,
                2.0 * (m * k * n) as f64 / s.median / 1e9
            );
        }
    }
}
