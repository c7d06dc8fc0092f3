//! One thread's multiply-add rate of the integer tile kernels per path and
//! activation-row count m, weights in cache (576 rows × `cols`, Q4_1):
//! `cargo run --release -p p10_quant --example tile_rate [cols] [reps] [rows]`
//! (576 rows by default; 16,384 and more are past L2).
use p10_quant::act::{ActFormat, QRow};
use p10_quant::formats::{quantize_row, BlockQ4_1, QK};
use p10_quant::panel::Panels;
use p10_quant::tile::OutRows;
use p10_quant::{Dot, Isa};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let cols: usize = std::env::args().nth(1).map_or(Ok(1536), |s| s.parse())?;
    let reps: usize = std::env::args().nth(2).map_or(Ok(20), |s| s.parse())?;
    let rows: usize = std::env::args().nth(3).map_or(Ok(576), |s| s.parse())?;
    let w: Vec<BlockQ4_1> = quantize_row(&common::testdata::uniform(rows * cols, 1))?;
    let per = cols / QK;
    let panels = Panels::from_q4_1(&w, rows, per);
    println!("path        m   GMAC/s (one thread, {rows} x {cols} Q4_1 in cache)");
    for isa in Isa::available() {
        let dot = Dot::new(isa)?;
        for m in [1usize, 2, 4, 8, 16, 32, 64] {
            let x = common::testdata::uniform(m * cols, 2);
            let mut xq = QRow::default();
            dot.quantize(&x, ActFormat::Q8_1, &mut xq)?;
            let mut y = vec![0.0f32; m * rows];
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t = Instant::now();
                for _ in 0..reps {
                    let o = OutRows::new(&mut y, m, rows, rows).expect("fits");
                    dot.tiles(&panels, 0..panels.groups(), xq.all(), o);
                }
                best = best.min(t.elapsed().as_secs_f64());
            }
            let macs = (m * rows * cols * reps) as f64;
            println!("{:<10} {m:3} {:7.1}", isa.name(), macs / best / 1e9);
        }
    }
    Ok(())
}
