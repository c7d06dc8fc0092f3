//! A quantised matrix product equals its rows' dot products exactly, for
//! decode (m = 1) and prefill shapes (m crossing the 64-row tile), on one
//! thread or two; and it is the f32 product of the dequantised weights up
//! to the activations' 8-bit rounding.

use common::rng::Rng;
use p10_quant::formats::{quantize_row, BlockQ8_0, BlockQ8_1, QK};
use p10_quant::matrix::{MatrixError, PanelExpansion};
use p10_quant::{Blocks, Dot, Format, Isa, Pool, QuantMatrix};

fn random(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale)
        .collect()
}

#[test]
fn products_equal_row_dots_on_any_thread_count() {
    let mut rng = Rng::new(3);
    let pool = Pool::new(2, std::time::Duration::from_micros(100));
    let (n, k) = (45, 96);
    let w = random(&mut rng, n * k, 0.5);
    for isa in Isa::available() {
        let dot = Dot::new(isa).unwrap();
        for format in [Format::Q4_1, Format::Q4_0, Format::Q8_0, Format::I8Channel] {
            let mat = QuantMatrix::quantize(&w, n, k, format, dot).unwrap();
            let row_scale = |r: usize| mat.row_scale().map_or(1.0, |s| s[r]);
            for m in [1, 3, 70] {
                let x = random(&mut rng, m * k, 2.0);
                let mut want = vec![0.0f32; m * n];
                for i in 0..m {
                    let xi = &x[i * k..(i + 1) * k];
                    for r in 0..n {
                        let per = k / QK;
                        want[i * n + r] = match mat.blocks() {
                            Blocks::Q4_1(b) => {
                                let xq: Vec<BlockQ8_1> = quantize_row(xi).unwrap();
                                dot.q4_1_q8_1(&b[r * per..(r + 1) * per], &xq)
                            }
                            Blocks::Q4_0(b) => {
                                let xq: Vec<BlockQ8_0> = quantize_row(xi).unwrap();
                                dot.q4_0_q8_0(&b[r * per..(r + 1) * per], &xq)
                            }
                            Blocks::Q8_0(b) => {
                                let xq: Vec<BlockQ8_0> = quantize_row(xi).unwrap();
                                dot.q8_0_q8_0(&b[r * per..(r + 1) * per], &xq) * row_scale(r)
                            }
                        };
                    }
                }
                for threads in [1, 2] {
                    let mut y = vec![f32::NAN; m * n];
                    mat.matmul_int(&x, m, &mut y, &pool, threads).unwrap();
                    assert_eq!(y, want, "{isa} {format:?} m={m} threads={threads}");
                }
                // Against f32 on the dequantised weights: within 2% of the
                // output's scale (8-bit activations: ~0.4% per value, averaged
                // over k = 96 terms).
                let wd = mat.dequantize();
                let mut y = vec![0.0f32; m * n];
                mat.matmul_int(&x, m, &mut y, &pool, 2).unwrap();
                for i in 0..m {
                    for r in 0..n {
                        let terms = (0..k).map(|j| wd[r * k + j] * x[i * k + j]);
                        let exact: f32 = terms.clone().sum();
                        let scale: f32 = terms.map(f32::abs).sum();
                        assert!(
                            (y[i * n + r] - exact).abs() <= 0.02 * scale,
                            "{isa} {format:?} ({i}, {r}): {} vs {exact}",
                            y[i * n + r]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn shapes_and_permutations_are_checked() {
    let dot = Dot::new(Isa::Scalar).unwrap();
    let w = vec![0.5f32; 4 * 64];
    assert!(matches!(
        QuantMatrix::quantize(&w, 4, 64, Format::Q8_0, dot)
            .unwrap()
            .permute_rows(&[0, 1, 2]),
        Err(MatrixError::Permutation { .. })
    ));
    assert!(QuantMatrix::quantize(&w, 8, 32, Format::Q4_1, dot).is_ok());
    assert!(QuantMatrix::quantize(&w, 4, 60, Format::Q4_1, dot).is_err());
    // Zero-width rows are an error, for every format (not a panic).
    for f in [Format::Q4_1, Format::Q4_0, Format::Q8_0, Format::I8Channel] {
        assert!(QuantMatrix::quantize(&[], 4, 0, f, dot).is_err(), "{f:?}");
    }
    let m = QuantMatrix::quantize(&w, 4, 64, Format::Q4_1, dot).unwrap();
    let mut y = vec![0.0; 4];
    let pool = Pool::new(1, std::time::Duration::ZERO);
    assert!(m.matmul(&[0.0; 63], 1, &mut y, &pool, 1).is_err());
    // Permuting rows moves whole rows of blocks.
    let mut rng = Rng::new(1);
    let w = random(&mut rng, 4 * 64, 1.0);
    let m = QuantMatrix::quantize(&w, 4, 64, Format::Q4_1, dot).unwrap();
    let d = m.dequantize();
    let p = QuantMatrix::quantize(&w, 4, 64, Format::Q4_1, dot)
        .unwrap()
        .permute_rows(&[2, 0, 3, 1])
        .unwrap();
    let dp = p.dequantize();
    for (dst, src) in [2, 0, 3, 1].into_iter().enumerate() {
        assert_eq!(dp[dst * 64..(dst + 1) * 64], d[src * 64..(src + 1) * 64]);
    }
}

/// The prefill path (weights expanded into p02's packed panels, inside its
/// loop or whole first; f32 sgemm) is the product of the dequantised
/// weights: equal to a naive f64 product within f32 summation error (the SIMD expansion rounds once per weight,
/// the reference twice: an ulp).
#[test]
fn the_f32_path_is_the_dequantised_product() {
    let mut rng = Rng::new(5);
    let (n, k, m) = (300, 576, 40);
    let w = random(&mut rng, n * k, 0.5);
    let x = random(&mut rng, m * k, 2.0);
    for isa in Isa::available() {
        for format in [Format::Q4_1, Format::Q8_0, Format::Q4_0, Format::I8Channel] {
            let mat = QuantMatrix::quantize(&w, n, k, format, Dot::new(isa).unwrap()).unwrap();
            let wd = mat.dequantize();
            for how in [
                PanelExpansion::InLoop,
                PanelExpansion::InLoopRows,
                PanelExpansion::Prepacked,
            ] {
                let mut y = vec![0.0f32; m * n];
                mat.matmul_f32_with(&x, m, &mut y, 2, how).unwrap();
                for i in 0..m {
                    for r in 0..n {
                        let exact: f64 = (0..k)
                            .map(|j| wd[r * k + j] as f64 * x[i * k + j] as f64)
                            .sum();
                        let scale: f64 = (0..k)
                            .map(|j| (wd[r * k + j] * x[i * k + j]).abs() as f64)
                            .sum();
                        let got = y[i * n + r] as f64;
                        assert!(
                            (got - exact).abs() <= 1e-5 * scale + 1e-30,
                            "{isa} {format:?} {how:?} ({i}, {r}): {got} vs {exact}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn int8_per_channel_rounds_each_row_to_its_own_scale() {
    let dot = Dot::new(Isa::Scalar).unwrap();
    let mut rng = Rng::new(9);
    let (n, k) = (6, 64);
    let mut w = random(&mut rng, n * k, 1.0);
    // Rows of very different ranges, an all-zero row, a row of one value.
    w[k..2 * k].iter_mut().for_each(|v| *v *= 1e-3);
    w[2 * k..3 * k].fill(0.0);
    w[3 * k..4 * k].fill(-0.25);
    let mat = QuantMatrix::quantize(&w, n, k, Format::I8Channel, dot).unwrap();
    let scales = mat.row_scale().unwrap().to_vec();
    let Blocks::Q8_0(blocks) = mat.blocks() else {
        panic!("int8 rows are held as Q8_0 blocks")
    };
    let wd = mat.dequantize();
    for r in 0..n {
        let row = &w[r * k..(r + 1) * k];
        let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_eq!(scales[r], amax / 127.0, "row {r}");
        let qs: Vec<i8> = blocks[r * 2..r * 2 + 2].iter().flat_map(|b| b.qs).collect();
        if amax > 0.0 {
            // The largest magnitude lands on ±127; every value within half a step.
            assert_eq!(
                qs.iter().map(|q| q.unsigned_abs()).max(),
                Some(127),
                "row {r}"
            );
        } else {
            assert!(qs.iter().all(|&q| q == 0));
        }
        for (j, (&a, &b)) in row.iter().zip(&wd[r * k..(r + 1) * k]).enumerate() {
            assert!(
                (a - b).abs() <= scales[r] * 0.5 * (1.0 + 1e-6),
                "({r}, {j}): {a} vs {b}"
            );
        }
    }
    assert!(blocks.iter().all(|b| b.d == 0x3c00), "block scales are 1");
    // Permuting rows moves their scales with them.
    let p = QuantMatrix::quantize(&w, n, k, Format::I8Channel, dot)
        .unwrap()
        .permute_rows(&[5, 4, 3, 2, 1, 0])
        .unwrap();
    let rev: Vec<f32> = scales.iter().rev().copied().collect();
    assert_eq!(p.row_scale().unwrap(), &rev[..]);
    assert_eq!(p.dequantize()[..k], wd[5 * k..]);
}

/// q/k/v in one dispatch: a group's outputs equal each matrix's own
/// product exactly (same quantised x, same dots), on one thread or two,
/// for decode and tiled shapes; mixed formats fall back to one by one
/// through the seam, with the same results.
#[test]
fn fused_groups_equal_their_members_products() {
    use p04_transformer::Proj;
    use p10_quant::int_path::GroupError;
    let mut rng = Rng::new(21);
    let pool = Pool::new(2, std::time::Duration::from_micros(100));
    let k = 96;
    let shapes = [45, 13, 13];
    for isa in Isa::available() {
        let dot = Dot::new(isa).unwrap();
        for format in [Format::Q4_1, Format::Q4_0, Format::Q8_0, Format::I8Channel] {
            let mats: Vec<QuantMatrix> = shapes
                .iter()
                .map(|&n| {
                    QuantMatrix::quantize(&random(&mut rng, n * k, 0.5), n, k, format, dot).unwrap()
                })
                .collect();
            for m in [1, 3, 70] {
                let x = random(&mut rng, m * k, 2.0);
                let want: Vec<Vec<f32>> = mats
                    .iter()
                    .zip(shapes)
                    .map(|(w, n)| {
                        let mut y = vec![0.0f32; m * n];
                        w.matmul_int(&x, m, &mut y, &pool, 1).unwrap();
                        y
                    })
                    .collect();
                for threads in [1, 2] {
                    let mut ys: Vec<Vec<f32>> =
                        shapes.iter().map(|&n| vec![f32::NAN; m * n]).collect();
                    let mut views: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[..]).collect();
                    let refs: Vec<&QuantMatrix> = mats.iter().collect();
                    QuantMatrix::matmul_int_group(&refs, &x, m, &mut views, &pool, threads)
                        .unwrap();
                    assert_eq!(ys, want, "{isa} {format:?} m={m} threads={threads}");
                }
            }
        }
        // Mixed formats: refused by the fused path, run one by one by the seam.
        let (n, m) = (13, 2);
        let w = random(&mut rng, n * k, 0.5);
        let a = QuantMatrix::quantize(&w, n, k, Format::Q4_1, dot).unwrap();
        let b = QuantMatrix::quantize(&w, n, k, Format::Q8_0, dot).unwrap();
        let x = random(&mut rng, m * k, 1.0);
        let (mut ya, mut yb) = (vec![0.0f32; m * n], vec![0.0f32; m * n]);
        assert!(matches!(
            QuantMatrix::matmul_int_group(&[&a, &b], &x, m, &mut [&mut ya, &mut yb], &pool, 2),
            Err(GroupError::Mixed)
        ));
        let f = Proj::new(&w, n, k).unwrap();
        let (pa, pb) = (
            Proj::from_weights(Box::new(
                QuantMatrix::quantize(&w, n, k, Format::Q4_1, dot).unwrap(),
            )),
            Proj::from_weights(Box::new(
                QuantMatrix::quantize(&w, n, k, Format::Q8_0, dot).unwrap(),
            )),
        );
        let mut ys = [
            vec![0.0f32; m * n],
            vec![0.0f32; m * n],
            vec![0.0f32; m * n],
        ];
        let [y0, y1, y2] = &mut ys;
        Proj::apply_group(&[&pa, &pb, &f], &x, m, &mut [y0, y1, y2], 2).unwrap();
        assert_eq!(ys[0], pa.apply(&x, m, 2).unwrap(), "{isa}");
        assert_eq!(ys[1], pb.apply(&x, m, 2).unwrap(), "{isa}");
        assert_eq!(ys[2], f.apply(&x, m, 2).unwrap(), "{isa}");
        // Two block formats: the fused path answers Mixed, the format's
        // own apply_group falls back to one by one.
        let (mut ya, mut yb) = (vec![0.0f32; m * n], vec![0.0f32; m * n]);
        Proj::apply_group(&[&pa, &pb], &x, m, &mut [&mut ya, &mut yb], 2).unwrap();
        assert_eq!(ya, ys[0], "{isa}");
        assert_eq!(yb, ys[1], "{isa}");
        // Too few output buffers is an error, not a panic.
        let mut y = vec![0.0f32; m * n];
        assert!(Proj::apply_group(&[&pa, &pb], &x, m, &mut [&mut y], 2).is_err());
    }
}

/// A tensor-parallel rank's part: selected rows give exactly the whole
/// product's columns of those rows; column parts (on block boundaries)
/// are products of those input columns alone, whose sum is the whole
/// product up to the order of the float additions; a part off the block
/// grid is refused.
#[test]
fn selected_rows_and_columns_are_parts_of_the_whole_product() {
    let mut rng = Rng::new(11);
    let pool = Pool::new(1, std::time::Duration::from_micros(100));
    let (n, k, m) = (37, 128, 3);
    let w = random(&mut rng, n * k, 0.5);
    let x = random(&mut rng, m * k, 2.0);
    let dot = Dot::detect();
    for format in [Format::Q4_1, Format::Q8_0] {
        let whole = QuantMatrix::quantize(&w, n, k, format, dot).unwrap();
        let mut want = vec![0.0f32; m * n];
        whole.matmul_int(&x, m, &mut want, &pool, 1).unwrap();
        let rows = [5usize, 0, 36, 17];
        let part = QuantMatrix::quantize(&w, n, k, format, dot)
            .unwrap()
            .select(Some(&rows), 0..k)
            .unwrap();
        let mut y = vec![0.0f32; m * rows.len()];
        part.matmul_int(&x, m, &mut y, &pool, 1).unwrap();
        for i in 0..m {
            for (j, &r) in rows.iter().enumerate() {
                assert_eq!(y[i * rows.len() + j], want[i * n + r], "{format:?}");
            }
        }
        let mut sum = vec![0.0f32; m * n];
        for cols in [0..32, 32..96, 96..128] {
            let part = QuantMatrix::quantize(&w, n, k, format, dot)
                .unwrap()
                .select(None, cols.clone())
                .unwrap();
            let xs: Vec<f32> = (0..m)
                .flat_map(|i| x[i * k..][cols.clone()].to_vec())
                .collect();
            let mut y = vec![0.0f32; m * n];
            part.matmul_int(&xs, m, &mut y, &pool, 1).unwrap();
            sum.iter_mut().zip(&y).for_each(|(s, y)| *s += y);
        }
        for (a, b) in sum.iter().zip(&want) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "{format:?}: {a} vs {b}"
            );
        }
        let again = QuantMatrix::quantize(&w, n, k, format, dot).unwrap();
        assert!(matches!(
            again.select(None, 16..48),
            Err(MatrixError::Columns { .. })
        ));
    }
}
