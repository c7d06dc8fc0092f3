//! Every SIMD dot product against the scalar reference, on random blocks
//! and on the extremes (|q| = 127, all-equal blocks whose scale is 0, the
//! largest nibbles, huge and tiny scales, rows of 1 to 40 blocks); and the
//! integer path against the dequantise-then-f32 one within the bound that
//! 8-bit activations allow.

use common::rng::Rng;
use half::f16;
use p10_quant::act::{ActFormat, QRow};
use p10_quant::dot::scalar as ggml;
use p10_quant::formats::{
    dequantize_row, quantize_row, Block, BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ8_1, QK,
};
use p10_quant::{Dot, Isa};

fn h(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

fn normal(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            // Box-Muller.
            let (u, v) = (rng.next_f64().max(1e-12), rng.next_f64());
            ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32 * scale
        })
        .collect()
}

/// Raw blocks with random codes: every bit pattern the kernels may meet
/// (weights' nibbles 0..15, activations' q in −127..127).
fn raw_q4_1(rng: &mut Rng, n: usize) -> Vec<BlockQ4_1> {
    (0..n)
        .map(|_| BlockQ4_1 {
            d: h(rng.next_f64() as f32 * 0.1),
            m: h(-(rng.next_f64() as f32)),
            qs: std::array::from_fn(|_| rng.below(256) as u8),
        })
        .collect()
}

fn raw_q8(rng: &mut Rng) -> [i8; QK] {
    std::array::from_fn(|_| (rng.below(255) as i32 - 127) as i8)
}

/// Cases: (label, weights row as f32, activations row as f32). Rows are
/// quantised by the crate's quantisers; raw-code cases come separately.
fn f32_cases(rng: &mut Rng) -> Vec<(String, Vec<f32>, Vec<f32>)> {
    let mut v = Vec::new();
    for nb in [1, 2, 3, 7, 18, 40] {
        let n = nb * QK;
        v.push((
            format!("normal {nb}"),
            normal(rng, n, 1.0),
            normal(rng, n, 3.0),
        ));
        // Large activations, with Q8_1's s (an f16: d·Σq must stay
        // under 65,504, as in llama.cpp) still finite.
        v.push((
            format!("large x {nb}"),
            normal(rng, n, 0.02),
            normal(rng, n, 150.0),
        ));
        v.push((
            format!("tiny {nb}"),
            normal(rng, n, 1e-3),
            normal(rng, n, 1e-4),
        ));
    }
    // All equal: Q4_1's d = 0 (everything in m), Q8's q = ±127 everywhere.
    v.push(("constant".into(), vec![0.25; 64], vec![-2.0; 64]));
    v.push(("zeros".into(), vec![0.0; 64], normal(rng, 64, 1.0)));
    let mut spike = normal(rng, 96, 0.01);
    spike[3] = 9.0;
    spike[70] = -9.0;
    v.push(("outliers".into(), spike.clone(), spike));
    v
}

fn tested_paths() -> Vec<Dot> {
    let paths: Vec<Dot> = Isa::available()
        .into_iter()
        .map(|i| Dot::new(i).unwrap())
        .collect();
    eprintln!(
        "paths tested against the scalar reference: {:?}",
        Isa::available()
    );
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        assert!(
            Isa::available().contains(&Isa::Avx2),
            "an AVX2 CPU must test the AVX2 path"
        );
        let has = |f| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && f
        };
        if has(true) {
            assert!(Isa::available().contains(&Isa::Avx512));
        }
        if has(std::arch::is_x86_feature_detected!("avx512vnni")) {
            assert!(Isa::available().contains(&Isa::Avx512Vnni));
        }
    }
    paths
}

/// |a − b| within float reassociation of the per-block terms.
fn close(a: f32, b: f32, scale: f32) -> bool {
    (a - b).abs() <= 1e-5 * scale + f32::MIN_POSITIVE
}

#[test]
fn simd_paths_equal_the_scalar_reference() {
    let mut rng = Rng::new(7);
    let mut checked = 0;
    for dot in tested_paths() {
        for (label, w, x) in f32_cases(&mut rng) {
            let w41: Vec<BlockQ4_1> = quantize_row(&w).unwrap();
            let w40: Vec<BlockQ4_0> = quantize_row(&w).unwrap();
            let w80: Vec<BlockQ8_0> = quantize_row(&w).unwrap();
            let x81: Vec<BlockQ8_1> = quantize_row(&x).unwrap();
            let x80: Vec<BlockQ8_0> = quantize_row(&x).unwrap();
            let scale: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum::<f32>()
                + x.iter().map(|b| b.abs()).sum::<f32>()
                    * w.iter().map(|a| a.abs()).fold(0.0, f32::max);
            for (name, a, b) in [
                (
                    "q4_1",
                    dot.q4_1_q8_1(&w41, &x81),
                    ggml::q4_1_q8_1(&w41, &x81),
                ),
                (
                    "q4_0",
                    dot.q4_0_q8_0(&w40, &x80),
                    ggml::q4_0_q8_0(&w40, &x80),
                ),
                (
                    "q8_0",
                    dot.q8_0_q8_0(&w80, &x80),
                    ggml::q8_0_q8_0(&w80, &x80),
                ),
            ] {
                assert!(
                    close(a, b, scale),
                    "{} {name} {label}: {a} vs {b}",
                    dot.isa()
                );
                checked += 1;
            }
        }
        // Raw codes: every nibble, |q| up to 127.
        for nb in 1..=40 {
            let w = raw_q4_1(&mut rng, nb);
            let x: Vec<BlockQ8_1> = (0..nb)
                .map(|_| {
                    let qs = raw_q8(&mut rng);
                    let d = rng.next_f64() as f32;
                    let s: i32 = qs.iter().map(|&q| q as i32).sum();
                    BlockQ8_1 {
                        d: h(d),
                        s: h(d * s as f32),
                        qs,
                    }
                })
                .collect();
            let (a, b) = (dot.q4_1_q8_1(&w, &x), ggml::q4_1_q8_1(&w, &x));
            let scale = 127.0 * 15.0 * 32.0 * nb as f32;
            assert!(
                close(a, b, scale),
                "{} raw q4_1 {nb}: {a} vs {b}",
                dot.isa()
            );
            let w8: Vec<BlockQ8_0> = (0..nb)
                .map(|_| BlockQ8_0 {
                    d: h(0.01),
                    qs: raw_q8(&mut rng),
                })
                .collect();
            let x8: Vec<BlockQ8_0> = (0..nb)
                .map(|_| BlockQ8_0 {
                    d: h(2.0),
                    qs: raw_q8(&mut rng),
                })
                .collect();
            let (a, b) = (dot.q8_0_q8_0(&w8, &x8), ggml::q8_0_q8_0(&w8, &x8));
            assert!(
                close(a, b, 127.0 * 127.0 * 0.02 * 32.0 * nb as f32),
                "{} raw q8_0 {nb}",
                dot.isa()
            );
            let w4: Vec<BlockQ4_0> = (0..nb)
                .map(|_| BlockQ4_0 {
                    d: h(0.3),
                    qs: std::array::from_fn(|_| rng.below(256) as u8),
                })
                .collect();
            let (a, b) = (dot.q4_0_q8_0(&w4, &x8), ggml::q4_0_q8_0(&w4, &x8));
            assert!(
                close(a, b, 8.0 * 127.0 * 0.6 * 32.0 * nb as f32),
                "{} raw q4_0 {nb}",
                dot.isa()
            );
            checked += 3;
        }
        // All codes at their extremes: saturation would show here.
        let w = vec![
            BlockQ4_1 {
                d: h(1.0),
                m: h(0.0),
                qs: [0xff; 16]
            };
            4
        ];
        let x = vec![
            BlockQ8_1 {
                d: h(1.0),
                s: h(127.0 * 32.0),
                qs: [127; QK]
            };
            4
        ];
        assert_eq!(dot.q4_1_q8_1(&w, &x), 4.0 * 15.0 * 127.0 * 32.0);
        let w8 = vec![
            BlockQ8_0 {
                d: h(1.0),
                qs: [-127; QK]
            };
            4
        ];
        let x8 = vec![
            BlockQ8_0 {
                d: h(1.0),
                qs: [127; QK]
            };
            4
        ];
        assert_eq!(dot.q8_0_q8_0(&w8, &x8), -4.0 * 127.0 * 127.0 * 32.0);
        let w4 = vec![
            BlockQ4_0 {
                d: h(1.0),
                qs: [0x00; 16]
            };
            4
        ];
        let x4 = vec![
            BlockQ8_0 {
                d: h(1.0),
                qs: [-127; QK]
            };
            4
        ];
        assert_eq!(dot.q4_0_q8_0(&w4, &x4), 4.0 * 8.0 * 127.0 * 32.0);
    }
    assert!(checked > 0);
}

/// The integer path against f32: dequantised weights times the original
/// activations. With d = max|x|/127 (f32), q = round(x/d) is within
/// d/2 of x/d (and f32's rounding of x·(1/d), 127 · 2⁻²³ more); the block
/// is stored with d rounded to f16, which moves each q·d by |q| · |Δd| ≤
/// 127 · |Δd|. |Δd| is about d · 2⁻¹¹ while d is a normal f16, but below
/// 6.1e-5 f16 is subnormal and |Δd| is up to 2⁻²⁵ whatever d is, so the
/// bound takes Δd as it is. Per block the difference is at most
/// Σ|w| · (0.5001 d + 127 |Δd|); Q8_1's s adds its own f16 rounding
/// (|m| · (|s| · 2⁻¹¹ + 2⁻²⁵)). Every path is checked on the same rows.
#[test]
fn integer_dots_stay_within_the_activation_quantisation_bound() {
    let mut rng = Rng::new(11);
    let cases = f32_cases(&mut rng);
    for dot in tested_paths() {
        for (label, w, x) in &cases {
            let (w, x) = (w.clone(), x.clone());
            let n = w.len();
            let w41: Vec<BlockQ4_1> = quantize_row(&w).unwrap();
            let x81: Vec<BlockQ8_1> = quantize_row(&x).unwrap();
            let mut wd = vec![0.0f32; n];
            dequantize_row(&w41, &mut wd).unwrap();
            let exact: f64 = wd.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let mut bound = 0.0f64;
            for (j, (wb, xb)) in w41.iter().zip(&x81).enumerate() {
                let dx = f16::from_bits(xb.d).to_f32() as f64;
                let amax = x[j * QK..(j + 1) * QK]
                    .iter()
                    .fold(0f32, |m, v| m.max(v.abs()));
                let d = (amax / 127.0) as f64;
                let wsum: f64 = wd[j * QK..(j + 1) * QK]
                    .iter()
                    .map(|v| v.abs() as f64)
                    .sum();
                let (m, sx) = (
                    f16::from_bits(wb.m).to_f32().abs() as f64,
                    f16::from_bits(xb.s).to_f32().abs() as f64,
                );
                bound += wsum * (0.5001 * d + 127.0 * (dx - d).abs())
                    + m * (sx * 2f64.powi(-11) + 2f64.powi(-25));
            }
            let got = dot.q4_1_q8_1(&w41, &x81) as f64;
            let slack = 1e-5
                * wd.iter()
                    .zip(&x)
                    .map(|(a, b)| (a * b).abs() as f64)
                    .sum::<f64>()
                + 1e-30;
            assert!(
                (got - exact).abs() <= bound + slack,
                "{} {label}: {got} vs {exact} (bound {bound})",
                dot.isa()
            );
            let _ = BlockQ4_1::BYTES;
        }
    }
}

/// Rows that probe the quantiser: random scales, exact ties (v · id lands on
/// k + 0.5 for a range of k, both signs), all-zero blocks (d = 0), a single
/// non-zero value, negative and positive extremes, subnormals and huge values.
fn quantiser_rows(rng: &mut Rng) -> Vec<Vec<f32>> {
    let mut rows: Vec<Vec<f32>> = vec![
        vec![0.0; QK],
        vec![-0.0; 2 * QK],
        {
            let mut r = vec![0.0f32; QK];
            r[7] = -3.5;
            r
        },
        // max |x| = 127 makes id = 1, so x = k + 0.5 is an exact tie.
        (0..QK)
            .map(|j| {
                if j == 0 {
                    127.0
                } else {
                    (j as f32 - 16.0) + 0.5
                }
            })
            .collect(),
        (0..QK)
            .map(|j| if j == 31 { -127.0 } else { -(j as f32) - 0.5 })
            .collect(),
        (0..QK).map(|j| f32::from_bits(1 + j as u32)).collect(), // subnormals
        (0..QK)
            .map(|j| if j % 2 == 0 { 3.0e38 } else { -1.0e38 })
            .collect(),
    ];
    for len in [1, 2, 3, 18, 48] {
        for scale in [1e-6f32, 0.02, 1.0, 300.0] {
            rows.push(normal(rng, len * QK, scale));
        }
    }
    rows
}

#[test]
fn the_simd_activation_quantisers_match_the_scalar_reference_bit_for_bit() {
    let mut rng = Rng::new(0x9a);
    let scalar = Dot::new(Isa::Scalar).unwrap();
    for isa in Isa::available() {
        let dot = Dot::new(isa).unwrap();
        for (i, x) in quantiser_rows(&mut rng).iter().enumerate() {
            // The format's own reference quantiser, as blocks, then as a QRow.
            let q8_0 = QRow::from_q8_0(&quantize_row::<BlockQ8_0>(x).unwrap());
            let q8_1 = QRow::from_q8_1(&quantize_row::<BlockQ8_1>(x).unwrap());
            for (format, reference) in [(ActFormat::Q8_0, q8_0), (ActFormat::Q8_1, q8_1)] {
                let (mut a, mut b) = (QRow::default(), QRow::default());
                dot.quantize(x, format, &mut a).unwrap();
                scalar.quantize(x, format, &mut b).unwrap();
                assert_eq!(a, b, "{format:?}, {isa}, row {i}");
                assert_eq!(b, reference, "{format:?}, row {i}");
            }
        }
        // Ties round away from zero, as C's roundf: 0.5 -> 1, -1.5 -> -2.
        let mut x = vec![0.0f32; QK];
        x[0] = 127.0;
        x[1] = 0.5;
        x[2] = -1.5;
        x[3] = 2.4999998;
        let mut q = QRow::default();
        dot.quantize(&x, ActFormat::Q8_0, &mut q).unwrap();
        assert_eq!(&q.all().codes()[0][..4], &[127, 1, -2, 2], "{isa}");
        // A ragged row is an error, not a short read.
        assert!(
            dot.quantize(&x[..31], ActFormat::Q8_0, &mut q).is_err(),
            "{isa}"
        );
    }
}

/// Weights expanded to f32 for prefill, on every path, against the format's
/// dequantiser: the SIMD paths round d·q + m once (fused), the reference
/// twice, so they differ by at most an ulp of each term; AVX2 and AVX-512
/// give the same values. Raw codes: every nibble, |q| up to 127, 1 to 9
/// blocks.
#[test]
fn weight_expansion_matches_the_dequantiser() {
    use p10_quant::matrix::BlocksRef;
    let mut rng = Rng::new(0xe5);
    let mut simd: Vec<(Isa, Vec<f32>)> = Vec::new();
    for nb in 1..=9 {
        let w41 = raw_q4_1(&mut rng, nb);
        let w80: Vec<BlockQ8_0> = (0..nb)
            .map(|_| BlockQ8_0 {
                d: h(rng.next_f64() as f32 * 0.05),
                qs: raw_q8(&mut rng),
            })
            .collect();
        let mut want41 = vec![0.0f32; nb * QK];
        dequantize_row(&w41, &mut want41).unwrap();
        let mut want80 = vec![0.0f32; nb * QK];
        dequantize_row(&w80, &mut want80).unwrap();
        simd.clear();
        for isa in Isa::available() {
            let dot = Dot::new(isa).unwrap();
            let mut got = vec![f32::NAN; 2 * nb * QK];
            let (a, b) = got.split_at_mut(nb * QK);
            dot.expand(&BlocksRef::Q4_1(&w41), a);
            dot.expand(&BlocksRef::Q8_0(&w80), b);
            for (j, (g, want)) in got.iter().zip(want41.iter().chain(&want80)).enumerate() {
                let blk = &w41[(j / QK).min(nb - 1)];
                let m = f16::from_bits(blk.m).to_f32().abs();
                let ulp = f32::EPSILON * (want.abs() + if j < nb * QK { m } else { 0.0 });
                assert!(
                    (g - want).abs() <= ulp,
                    "{isa} {nb} blocks, value {j}: {g} vs {want}"
                );
            }
            if isa != Isa::Scalar {
                simd.push((isa, got));
            }
        }
        for (isa, got) in &simd {
            assert_eq!(got, &simd[0].1, "{isa} vs {}, {nb} blocks", simd[0].0);
        }
    }
}

/// Q4_1 rows expanded straight into p02's packed sliver, on every path,
/// against the scalar layout loop (every value d·q + m fused, so bit for
/// bit), and against the dequantiser (an ulp): partial slivers (count < nr,
/// so zero columns), 16-row groups with 1 to 16 live rows, an nr that is
/// not a multiple of 16 (the portable loop on every path), block offsets.
#[test]
fn sliver_expansion_is_the_transposed_rows() {
    let mut rng = Rng::new(0x51);
    let (rows, per) = (70, 5);
    let w = raw_q4_1(&mut rng, rows * per);
    let mut deq = vec![0.0f32; rows * per * QK];
    dequantize_row(&w, &mut deq).unwrap();
    let scalar = Dot::new(Isa::Scalar).unwrap();
    for (j0, count, b0, nb, nr) in [
        (0, 32, 0, 5, 32),
        (3, 17, 1, 3, 32),
        (40, 1, 4, 1, 32),
        (50, 16, 0, 2, 16),
        (60, 10, 2, 3, 48),
        (1, 7, 0, 2, 8),
    ] {
        let mut want = vec![f32::NAN; QK * nb * nr];
        scalar.expand_sliver_q4_1(&w, per, j0, count, b0, nb, nr, &mut want);
        for (p, d) in want.chunks_exact(nr).enumerate() {
            for (c, &v) in d.iter().enumerate() {
                if c < count {
                    let e = deq[(j0 + c) * per * QK + b0 * QK + p];
                    let m = f16::from_bits(w[(j0 + c) * per + b0 + p / QK].m).to_f32();
                    assert!(
                        (v - e).abs() <= f32::EPSILON * (e.abs() + m.abs()),
                        "({p}, {c})"
                    );
                } else {
                    assert_eq!(v, 0.0, "padding ({p}, {c})");
                }
            }
        }
        for isa in Isa::available() {
            let mut got = vec![f32::NAN; QK * nb * nr];
            Dot::new(isa)
                .unwrap()
                .expand_sliver_q4_1(&w, per, j0, count, b0, nb, nr, &mut got);
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{isa}: rows {j0}+{count}, blocks {b0}+{nb}, nr {nr}");
        }
    }
}

/// The per-row reference over a `QRow` (`dot::scalar::row`, what the tile
/// kernels are held to within rounding) is ggml's block arithmetic bit for
/// bit: the layout loses nothing.
#[test]
fn the_row_reference_over_a_qrow_is_ggmls_arithmetic_exactly() {
    let mut rng = Rng::new(11);
    for (label, w, x) in f32_cases(&mut rng) {
        let w41: Vec<BlockQ4_1> = quantize_row(&w).unwrap();
        let w40: Vec<BlockQ4_0> = quantize_row(&w).unwrap();
        let w80: Vec<BlockQ8_0> = quantize_row(&w).unwrap();
        let x81: Vec<BlockQ8_1> = quantize_row(&x).unwrap();
        let x80: Vec<BlockQ8_0> = quantize_row(&x).unwrap();
        let (q1, q0) = (QRow::from_q8_1(&x81), QRow::from_q8_0(&x80));
        for (name, a, b) in [
            (
                "q4_1",
                ggml::row::q4_1(&w41, q1.all()),
                ggml::q4_1_q8_1(&w41, &x81),
            ),
            (
                "q4_0",
                ggml::row::q4_0(&w40, q0.all()),
                ggml::q4_0_q8_0(&w40, &x80),
            ),
            (
                "q8_0",
                ggml::row::q8_0(&w80, q0.all()),
                ggml::q8_0_q8_0(&w80, &x80),
            ),
        ] {
            assert_eq!(a.to_bits(), b.to_bits(), "{name} {label}: {a} vs {b}");
        }
    }
}
