//! One thread's dot-product speed per kernel path, with the weights in
//! cache (a 576 × 576 Q4_1 matrix, 207 KB, and the 49152 × 576 Q8_0 head
//! cut to 576 rows): what each path costs per block when memory is not
//! the limit. `cargo run --release -p p10_quant --example kernel_ab [reps]`.
use p10_quant::act::QRow;
use p10_quant::formats::{quantize_row, BlockQ4_1, BlockQ8_0, BlockQ8_1, QK};
use p10_quant::{Dot, Isa};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let reps: usize = std::env::args().nth(1).map_or(Ok(2000), |s| s.parse())?;
    let (rows, cols) = (576, 576);
    let w = common::testdata::uniform(rows * cols, 1);
    let x = common::testdata::uniform(cols, 2);
    let w41: Vec<BlockQ4_1> = quantize_row(&w)?;
    let w80: Vec<BlockQ8_0> = quantize_row(&w)?;
    let x81 = QRow::from_q8_1(&quantize_row::<BlockQ8_1>(&x)?);
    let x80 = QRow::from_q8_0(&quantize_row::<BlockQ8_0>(&x)?);
    let per = cols / QK;
    let blocks = (rows * per * reps) as f64;
    println!("path        q4_1 ns/block  q8_0 ns/block  (one thread, in cache)");
    for isa in Isa::available() {
        let dot = Dot::new(isa)?;
        let mut best = [f64::MAX; 2];
        let mut sink = 0.0f32;
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..reps {
                for r in 0..rows {
                    sink += dot.q4_1(&w41[r * per..(r + 1) * per], x81.all());
                }
            }
            best[0] = best[0].min(t.elapsed().as_secs_f64() * 1e9 / blocks);
            let t = Instant::now();
            for _ in 0..reps {
                for r in 0..rows {
                    sink += dot.q8_0(&w80[r * per..(r + 1) * per], x80.all());
                }
            }
            best[1] = best[1].min(t.elapsed().as_secs_f64() * 1e9 / blocks);
        }
        println!(
            "{:<11} {:>13.2}  {:>13.2}  ({sink:.1e})",
            isa.name(),
            best[0],
            best[1]
        );
    }
    Ok(())
}
