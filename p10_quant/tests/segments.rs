//! Row-parallel segments (Project 04's `segments.rs`) on native weights:
//! the fused path (x quantised once, all S segments in one dispatch) gives
//! the bits of each segment's own product, as a tensor-parallel rank
//! computes it on its slice of x, folded in the all-reduce's order; on
//! every kernel path this CPU has, Q4_1 and Q8_0, for 1 to 20 rows.

use common::rng::Rng;
use p04_transformer::proj::LinearWeights;
use p04_transformer::segments::{fold_segments, Segmented};
use p10_quant::int_path::fused_segment_calls;
use p10_quant::{Dot, Format, Isa, Pool, QuantMatrix};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn fused_segments_equal_each_ranks_product_folded_bit_for_bit() {
    let (n, s, width) = (40, 3, 64); // 40 outputs, 3 segments of 64 columns
    let k = s * width;
    let mut rng = Rng::new(7);
    let w: Vec<f32> = (0..n * k).map(|_| rng.next_f32() - 0.5).collect();
    for isa in Isa::available() {
        let dot = Dot::new(isa).unwrap();
        for format in [Format::Q4_1, Format::Q8_0] {
            let part = |j: usize| {
                QuantMatrix::quantize(&w, n, k, format, dot)
                    .unwrap()
                    .select(None, j * width..(j + 1) * width)
                    .unwrap()
            };
            let fused = Segmented::new(
                (0..s)
                    .map(|j| Box::new(part(j)) as Box<dyn LinearWeights>)
                    .collect(),
            )
            .unwrap();
            // The ranks: each its own matrix and its own columns of x.
            let ranks: Vec<QuantMatrix> = (0..s).map(part).collect();
            for m in 1..=20 {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| (rng.next_f32() - 0.5) * (1 + i % 5) as f32)
                    .collect();
                let mut y = vec![0.0f32; m * n];
                let calls = fused_segment_calls();
                fused.apply_into(&x, m, &mut y, 2).unwrap();
                assert_eq!(fused_segment_calls(), calls + 1, "the fused path ran");
                let partials: Vec<Vec<f32>> = ranks
                    .iter()
                    .enumerate()
                    .map(|(j, r)| {
                        let xj: Vec<f32> = x
                            .chunks_exact(k)
                            .flat_map(|row| row[j * width..(j + 1) * width].to_vec())
                            .collect();
                        let mut p = vec![0.0f32; m * n];
                        r.matmul(&xj, m, &mut p, Pool::global(), 1).unwrap();
                        p
                    })
                    .collect();
                let mut want = vec![0.0f32; m * n];
                fold_segments(&partials.concat(), n, &mut want);
                assert_eq!(bits(&y), bits(&want), "{isa:?} {format:?}, m = {m}");
            }
        }
    }
}
