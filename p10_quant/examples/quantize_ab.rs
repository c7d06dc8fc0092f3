//! The activation quantiser, scalar vs SIMD, on SmolLM2's row widths
//! (576: q/k/v, o, gate/up inputs; 1536: down's input), interleaved, medians
//! of 31 rounds of 2,000 rows each.
//!
//!     cargo run --release -p p10_quant --example quantize_ab

use std::time::Instant;

use p10_quant::act::{ActFormat, QRow};
use p10_quant::{Dot, Isa};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut rng = common::rng::Rng::new(7);
    let paths: Vec<Dot> = Isa::available()
        .into_iter()
        .filter_map(|i| Dot::new(i).ok())
        .collect();
    for width in [576usize, 1536] {
        let x: Vec<f32> = (0..width).map(|_| rng.next_f32() * 4.0 - 2.0).collect();
        let mut times = vec![Vec::new(); paths.len()];
        let mut q = QRow::default();
        for _ in 0..31 {
            for (p, dot) in paths.iter().enumerate() {
                let t = Instant::now();
                for _ in 0..1000 {
                    for format in [ActFormat::Q8_1, ActFormat::Q8_0] {
                        dot.quantize(std::hint::black_box(&x), format, &mut q)
                            .unwrap();
                    }
                }
                times[p].push(t.elapsed().as_secs_f64() / 2000.0);
            }
        }
        for (dot, t) in paths.iter().zip(times) {
            println!(
                "width {width:>5} {:>6}: {:>8.2} us per row",
                dot.isa().name(),
                median(t) * 1e6
            );
        }
    }
}
