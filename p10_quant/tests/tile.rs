//! The integer kernel family (`tile.rs`) on every path this CPU has: for
//! m = 1…70 activation rows and ragged weight-row counts and widths, each
//! output bit for bit the single-row kernel's (so a row's result cannot
//! depend on how many rows share the product or which tile it lands in)
//! and bit for bit the portable reference (every path does the same
//! arithmetic), within float reassociation of ggml's per-row sum, and
//! nothing written outside the output window.

use common::rng::Rng;
use half::f16;
use p10_quant::act::{ActFormat, QRow};
use p10_quant::dot::scalar::row as ggml;
use p10_quant::formats::{BlockQ4_0, BlockQ4_1, BlockQ8_0, QK};
use p10_quant::panel::Panels;
use p10_quant::tile::OutRows;
use p10_quant::{Dot, Isa};

fn h(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

fn paths() -> Vec<Dot> {
    let isas = Isa::available();
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        assert!(
            isas.contains(&Isa::Avx2),
            "an AVX2 CPU must test the AVX2 path"
        );
    }
    eprintln!("tile paths tested: {isas:?}");
    isas.into_iter().map(|i| Dot::new(i).unwrap()).collect()
}

/// Activations with a spread of magnitudes per block (so scales differ).
fn acts(rng: &mut Rng, m: usize, per: usize) -> Vec<f32> {
    (0..m * per * QK)
        .map(|i| {
            let block_scale = 0.05 + ((i / QK) % 7) as f32;
            (rng.next_f64() as f32 - 0.5) * block_scale
        })
        .collect()
}

struct Weights {
    q41: Vec<BlockQ4_1>,
    q40: Vec<BlockQ4_0>,
    q80: Vec<BlockQ8_0>,
}

fn weights(rng: &mut Rng, blocks: usize) -> Weights {
    let mut d = || h(rng.next_f64() as f32 * 0.1 + 1e-3);
    let q41 = (0..blocks)
        .map(|_| BlockQ4_1 {
            d: d(),
            m: h(-0.3),
            qs: [0; 16],
        })
        .collect::<Vec<_>>();
    let mut w = Weights {
        q41,
        q40: vec![BlockQ4_0::default(); blocks],
        q80: vec![BlockQ8_0::default(); blocks],
    };
    for i in 0..blocks {
        w.q41[i].m = h(-(rng.next_f64() as f32) * 0.5);
        w.q41[i].qs = std::array::from_fn(|_| rng.below(256) as u8);
        w.q40[i] = BlockQ4_0 {
            d: h(rng.next_f64() as f32 * 0.1),
            qs: std::array::from_fn(|_| rng.below(256) as u8),
        };
        w.q80[i] = BlockQ8_0 {
            d: h(rng.next_f64() as f32 * 0.01),
            qs: std::array::from_fn(|_| (rng.below(255) as i32 - 127) as i8),
        };
    }
    w
}

/// y (m, n) with ld = n + 2, NaN everywhere first; returns y.
fn run(m: usize, n: usize, f: impl FnOnce(OutRows)) -> Vec<f32> {
    let ld = n + 2;
    let mut y = vec![f32::NAN; m * ld + 3];
    f(OutRows::new(&mut y, m, n, ld).expect("window fits"));
    y
}

fn check_window(y: &[f32], m: usize, n: usize, what: &str) {
    let ld = n + 2;
    for (k, v) in y.iter().enumerate() {
        let inside = k / ld < m && k % ld < n;
        assert_eq!(
            inside,
            !v.is_nan(),
            "{what}: element {k} (inside: {inside}) is {v}"
        );
    }
}

#[test]
fn every_row_of_a_tile_product_is_the_single_row_kernel_bit_for_bit() {
    let mut rng = Rng::new(31);
    let scalar = Dot::new(Isa::Scalar).unwrap();
    let mut checked = 0usize;
    // Rows: below, at and past a group of 16, and two groups plus a prime.
    for (per, n) in [
        (1usize, 5usize),
        (2, 16),
        (3, 17),
        (17, 7),
        (18, 37),
        (33, 3),
    ] {
        let w = weights(&mut rng, n * per);
        let panels = [
            Panels::from_q4_1(&w.q41, n, per),
            Panels::from_q4_0(&w.q40, n, per),
            Panels::from_q8_0(&w.q80, n, per),
        ];
        let ms: Vec<usize> = if per <= 18 {
            (1..=70).collect()
        } else {
            vec![1, 2, 5, 16, 17, 64, 70]
        };
        let x = acts(&mut rng, 70, per);
        for dot in paths() {
            let (mut x1, mut x0) = (QRow::default(), QRow::default());
            dot.quantize(&x, ActFormat::Q8_1, &mut x1).unwrap();
            dot.quantize(&x, ActFormat::Q8_0, &mut x0).unwrap();
            let xs = [&x1, &x0, &x0];
            for &m in &ms {
                for (f, (p, xq)) in ["q4_1", "q4_0", "q8_0"].iter().zip(panels.iter().zip(xs)) {
                    let what = format!("{} {f} per {per} n {n} m {m}", dot.isa());
                    let y = run(m, n, |o| dot.tiles(p, 0..p.groups(), xq.all(), o));
                    let yr = run(m, n, |o| scalar.tiles(p, 0..p.groups(), xq.all(), o));
                    check_window(&y, m, n, &what);
                    for i in 0..m {
                        let xi = xq.blocks(i * per..(i + 1) * per);
                        for r in 0..n {
                            let (got, refv) = (y[i * (n + 2) + r], yr[i * (n + 2) + r]);
                            let wr = r * per..(r + 1) * per;
                            let (solo, ggml_v) = match *f {
                                "q4_1" => {
                                    (dot.q4_1(&w.q41[wr.clone()], xi), ggml::q4_1(&w.q41[wr], xi))
                                }
                                "q4_0" => {
                                    (dot.q4_0(&w.q40[wr.clone()], xi), ggml::q4_0(&w.q40[wr], xi))
                                }
                                _ => (dot.q8_0(&w.q80[wr.clone()], xi), ggml::q8_0(&w.q80[wr], xi)),
                            };
                            assert_eq!(
                                got.to_bits(),
                                solo.to_bits(),
                                "{what} ({i}, {r}): {got} vs single-row {solo}"
                            );
                            assert_eq!(
                                got.to_bits(),
                                refv.to_bits(),
                                "{what} ({i}, {r}): {got} vs reference {refv}"
                            );
                            // Σ of per-block terms in another rounding order: within
                            // f32 rounding of the terms' magnitudes (each at most
                            // d_w·d_x·127·15·32 + |m·s| ≤ 0.1·0.03·60,960 + 0.5·100).
                            let tol = 4e-6 * per as f32 * 300.0;
                            assert!(
                                (got - ggml_v).abs() <= tol,
                                "{what} ({i}, {r}): {got} vs ggml's {ggml_v}"
                            );
                            checked += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(checked > 100_000, "only {checked} outputs checked");
}

#[test]
fn groups_split_anywhere_give_the_same_outputs() {
    // The threads of a product each take a range of groups: any split
    // gives every output the bits of the whole product.
    let mut rng = Rng::new(9);
    let (per, n, m) = (5usize, 53usize, 11usize);
    let w = weights(&mut rng, n * per);
    let p = Panels::from_q4_1(&w.q41, n, per);
    let x = acts(&mut rng, m, per);
    for dot in paths() {
        let mut xq = QRow::default();
        dot.quantize(&x, ActFormat::Q8_1, &mut xq).unwrap();
        let whole = run(m, n, |o| dot.tiles(&p, 0..p.groups(), xq.all(), o));
        for split in 1..p.groups() {
            let (a, b) = (split * 16, n - split * 16);
            let ya = run(m, a, |o| dot.tiles(&p, 0..split, xq.all(), o));
            let yb = run(m, b, |o| dot.tiles(&p, split..p.groups(), xq.all(), o));
            for i in 0..m {
                for r in 0..n {
                    let part = if r < a {
                        ya[i * (a + 2) + r]
                    } else {
                        yb[i * (b + 2) + r - a]
                    };
                    assert_eq!(
                        part.to_bits(),
                        whole[i * (n + 2) + r].to_bits(),
                        "{} split {split} ({i}, {r})",
                        dot.isa()
                    );
                }
            }
        }
    }
}

#[test]
fn a_shape_that_does_not_fit_writes_nothing() {
    let mut rng = Rng::new(5);
    let w = weights(&mut rng, 6);
    let p = Panels::from_q4_1(&w.q41, 2, 3);
    let x = acts(&mut rng, 2, 3);
    for dot in paths() {
        let mut xq = QRow::default();
        dot.quantize(&x, ActFormat::Q8_1, &mut xq).unwrap();
        // 2 rows of 3 blocks: out asks for 3 rows; 3 activation rows; a group past the end.
        let y = run(2, 3, |o| dot.tiles(&p, 0..1, xq.all(), o));
        assert!(
            y.iter().all(|v| v.is_nan()),
            "{}: wrote for a bad n",
            dot.isa()
        );
        let y = run(3, 2, |o| dot.tiles(&p, 0..1, xq.all(), o));
        assert!(y.iter().all(|v| v.is_nan()), "{}: read past x", dot.isa());
        let y = run(2, 2, |o| dot.tiles(&p, 0..2, xq.all(), o));
        assert!(
            y.iter().all(|v| v.is_nan()),
            "{}: groups past the panels",
            dot.isa()
        );
    }
    assert!(
        OutRows::new(&mut [0.0; 5], 2, 3, 3).is_none(),
        "a short y is refused"
    );
    assert!(
        OutRows::new(&mut [0.0; 9], 2, 3, 2).is_none(),
        "ld < n is refused"
    );
}
