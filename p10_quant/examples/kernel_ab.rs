//! One thread's dot-product speed per kernel path, with the weights in
//! cache (a 576 × 576 Q4_1 matrix, 207 KB, and the 49152 × 576 Q8_0 head
//! cut to 576 rows): what each path costs per block when memory is not
//! the limit. `cargo run --release -p p10_quant --example kernel_ab [reps] [cols]`
//! [rows] (576 × 576 by default; 1,536 columns is down's width; 40,000
//! rows of 576 are 14 MB of Q4_1, past L2, so the weights stream).
use p10_quant::act::QRow;
use p10_quant::formats::{quantize_row, BlockQ4_1, BlockQ8_0, BlockQ8_1, QK};
use p10_quant::{Dot, Isa};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let reps: usize = std::env::args().nth(1).map_or(Ok(2000), |s| s.parse())?;
    let cols: usize = std::env::args().nth(2).map_or(Ok(576), |s| s.parse())?;
    let rows: usize = std::env::args().nth(3).map_or(Ok(576), |s| s.parse())?;
    let w = common::testdata::uniform(rows * cols, 1);
    let x = common::testdata::uniform(cols, 2);
    let w41: Vec<BlockQ4_1> = quantize_row(&w)?;
    let w80: Vec<BlockQ8_0> = quantize_row(&w)?;
    let x81 = QRow::from_q8_1(&quantize_row::<BlockQ8_1>(&x)?);
    let x80 = QRow::from_q8_0(&quantize_row::<BlockQ8_0>(&x)?);
    let per = cols / QK;
    let blocks = (rows * per * reps) as f64;
    let bytes = rows * per * 20;
    let bw = p02_matmul_bench::ceilings::read_bandwidth(bytes, 1);
    println!(
        "one thread reads a {:.1} MB buffer at {bw:.1} GB/s: a Q4_1 block (20 B) every {:.2} ns",
        bytes as f64 / 1e6,
        20.0 / bw
    );
    println!("path        q4_1 ns/block  q8_0 ns/block  (one thread)");
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
