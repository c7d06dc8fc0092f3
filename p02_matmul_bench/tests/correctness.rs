//! Every variant, kernel, thread count and operand layout against the f64
//! reference, on awkward shapes: 0, 1, primes, non-square, one off the
//! register tile (MR, NR) and the cache blocks (KC, MC), strided and
//! transposed operands, padded leading dimensions.

use p02_matmul_bench::gemm::gemm_packed;
use p02_matmul_bench::reference::{error_bound, gemm_ref};
use p02_matmul_bench::variants::{b_transposed, blocked, ikj, naive_ijk};
use p02_matmul_bench::{sgemm_with, GemmError, GemmOpts, MatMut, MatRef, MicroKernel};

/// Operand storage: how a logical (rows, cols) matrix is laid out in memory.
#[derive(Clone, Copy, Debug)]
enum Layout {
    RowMajor,
    /// Stored as its transpose, read through swapped strides.
    Transposed,
    /// Row-major with 3 elements of padding per row.
    Padded,
}

/// A buffer and a view of a logical (rows, cols) matrix with values `vals`.
fn store(vals: &[f32], rows: usize, cols: usize, layout: Layout) -> (Vec<f32>, usize, usize) {
    match layout {
        Layout::RowMajor => (vals.to_vec(), cols, 1),
        Layout::Transposed => {
            let mut t = vec![0.0; rows * cols];
            for i in 0..rows {
                for j in 0..cols {
                    t[j * rows + i] = vals[i * cols + j];
                }
            }
            (t, 1, rows)
        }
        Layout::Padded => {
            let ld = cols + 3;
            let mut p = vec![f32::NAN; rows * ld];
            for i in 0..rows {
                p[i * ld..i * ld + cols].copy_from_slice(&vals[i * cols..(i + 1) * cols]);
            }
            (p, ld, 1)
        }
    }
}

type Variant = fn(MatRef, MatRef, &mut MatMut);

const SHAPES: &[(usize, usize, usize)] = &[
    (0, 0, 0),
    (0, 5, 3),
    (3, 0, 5),
    (4, 5, 0),
    (1, 1, 1),
    (1, 17, 13),
    (2, 3, 5),
    (7, 13, 11),
    (5, 15, 31),
    (6, 16, 256),
    (7, 17, 257),
    (13, 33, 255),
    (143, 31, 9),
    (145, 47, 3),
    (193, 65, 37),
    (1, 577, 70),
    (97, 131, 263),
    // A row stride of 2 KB (4K aliasing): packed for the 6x16 kernels, read
    // in place (whole 8-row slivers and a packed tail) for the 8x32 ones.
    (19, 40, 512),
];

fn check(what: &str, got: &MatMut, expected: &[f32], scale: &[f64], k: usize) {
    for i in 0..got.rows() {
        for j in 0..got.cols() {
            let g = got.as_slice()[i * got.ld() + j];
            let e = expected[i * got.ld() + j];
            let bound = error_bound(k, scale[i * got.cols() + j]);
            assert!(
                (f64::from(g) - f64::from(e)).abs() <= bound,
                "{what}: C[{i}, {j}] = {g}, reference {e}, bound {bound:e}"
            );
        }
        // Padding past the last column must be untouched.
        for j in got.cols()..got.ld() {
            assert!(
                got.as_slice()[i * got.ld() + j] == 7.0,
                "{what}: padding C[{i}, {j}] was written"
            );
        }
    }
}

#[test]
fn variants_match_reference() {
    let variants: [(&str, Variant); 4] = [
        ("naive_ijk", naive_ijk),
        ("ikj", ikj),
        ("b_transposed", b_transposed),
        ("blocked", blocked),
    ];
    for &(m, n, k) in SHAPES {
        for (la, lb) in [
            (Layout::RowMajor, Layout::RowMajor),
            (Layout::Transposed, Layout::Transposed),
            (Layout::Padded, Layout::Transposed),
        ] {
            let av = common::testdata::uniform(m * k, (m * 31 + k) as u64);
            let bv = common::testdata::uniform(k * n, (n * 17 + k + 1) as u64);
            let (ab, ars, acs) = store(&av, m, k, la);
            let (bb, brs, bcs) = store(&bv, k, n, lb);
            let a = MatRef::new(&ab, m, k, ars, acs).unwrap();
            let b = MatRef::new(&bb, k, n, brs, bcs).unwrap();
            let mut ref_c = vec![7.0f32; m * (n + 2)];
            let scale = gemm_ref(
                1.0,
                a,
                b,
                0.0,
                &mut MatMut::new(&mut ref_c, m, n, n + 2).unwrap(),
                None,
            );
            for (name, f) in variants {
                let mut c = vec![7.0f32; m * (n + 2)];
                let mut cm = MatMut::new(&mut c, m, n, n + 2).unwrap();
                f(a, b, &mut cm);
                check(
                    &format!("{name} {m}x{n}x{k} {la:?}/{lb:?}"),
                    &cm,
                    &ref_c,
                    &scale,
                    k,
                );
            }
        }
    }
}

#[test]
fn packed_kernels_and_threads_match_reference() {
    let kernels = MicroKernel::available();
    assert!(
        kernels
            .iter()
            .any(|k| k.name().starts_with("portable 8x32")),
        "the AVX-512 geometry must be tested"
    );
    let mut shapes = SHAPES.to_vec();
    shapes.push((200, 150, 300)); // above PAR_MIN_MACS: the threaded path runs
    shapes.push((3, 1000, 1500)); // few rows, many columns: threads split N
    for &(m, n, k) in &shapes {
        for (la, lb) in [
            (Layout::RowMajor, Layout::RowMajor),
            (Layout::Transposed, Layout::Transposed),
            (Layout::Padded, Layout::Padded),
        ] {
            let av = common::testdata::uniform(m * k, (m * 7 + k) as u64);
            let bv = common::testdata::uniform(k * n, (n * 5 + k + 3) as u64);
            let c0 = common::testdata::uniform(m * (n + 2), 99);
            let bias = common::testdata::uniform(n, 5);
            let (ab, ars, acs) = store(&av, m, k, la);
            let (bb, brs, bcs) = store(&bv, k, n, lb);
            let a = MatRef::new(&ab, m, k, ars, acs).unwrap();
            let b = MatRef::new(&bb, k, n, brs, bcs).unwrap();
            for (alpha, beta, with_bias) in
                [(1.0, 0.0, false), (0.5, 1.0, true), (-2.0, 0.25, false)]
            {
                let init = |c: &mut Vec<f32>| {
                    for i in 0..m {
                        for j in 0..n + 2 {
                            c[i * (n + 2) + j] = if j >= n {
                                7.0
                            } else if beta == 0.0 {
                                f32::NAN
                            } else {
                                c0[i * (n + 2) + j]
                            };
                        }
                    }
                };
                let mut ref_c = vec![0.0; m * (n + 2)];
                init(&mut ref_c);
                let bias_opt = with_bias.then_some(bias.as_slice());
                let scale = gemm_ref(
                    alpha,
                    a,
                    b,
                    beta,
                    &mut MatMut::new(&mut ref_c, m, n, n + 2).unwrap(),
                    bias_opt,
                );
                for kern in &kernels {
                    for threads in [1, 2] {
                        let what = format!("{} threads {threads} {m}x{n}x{k} {la:?}/{lb:?} alpha {alpha} beta {beta} bias {with_bias}", kern.name());
                        let mut c = vec![0.0; m * (n + 2)];
                        init(&mut c);
                        let mut cm = MatMut::new(&mut c, m, n, n + 2).unwrap();
                        if with_bias {
                            let opts = GemmOpts {
                                alpha,
                                beta,
                                bias: bias_opt,
                                threads,
                            };
                            sgemm_with(a, b, &mut cm, opts, *kern).unwrap();
                        } else {
                            // The packed driver directly (sgemm would take GEMV for m = 1).
                            gemm_packed(alpha, a, b, beta, &mut cm, *kern, threads).unwrap();
                        }
                        check(&what, &cm, &ref_c, &scale, k);
                    }
                }
            }
        }
    }
}

#[test]
fn gemv_path_matches_reference_in_both_layouts() {
    for &(n, k) in &[
        (1, 1),
        (3, 5),
        (17, 15),
        (63, 64),
        (65, 129),
        (576, 576),
        (1536, 576),
        (3000, 700),
    ] {
        let x = common::testdata::uniform(k, k as u64);
        let w = common::testdata::uniform(n * k, (n + k) as u64);
        for transposed in [true, false] {
            let a = MatRef::row_major(&x, 1, k).unwrap();
            // transposed: W (n, k) seen as (k, n); else B (k, n) row-major with the same values.
            let b = if transposed {
                MatRef::row_major(&w, n, k).unwrap().t()
            } else {
                MatRef::row_major(&w, k, n).unwrap()
            };
            let mut ref_y = vec![0.0; n];
            let scale = gemm_ref(
                1.0,
                a,
                b,
                0.0,
                &mut MatMut::row_major(&mut ref_y, 1, n).unwrap(),
                None,
            );
            for threads in [1, 2] {
                let mut y = vec![f32::NAN; n];
                let mut ym = MatMut::row_major(&mut y, 1, n).unwrap();
                p02_matmul_bench::gemv::gemv(1.0, a, b, 0.0, &mut ym, threads).unwrap();
                check(
                    &format!("gemv n {n} k {k} transposed {transposed} threads {threads}"),
                    &ym,
                    &ref_y,
                    &scale,
                    k,
                );
            }
        }
    }
}

#[test]
fn bad_shapes_are_errors_not_panics() {
    let a = vec![0.0; 6];
    // A view that would read past its buffer.
    assert!(matches!(
        MatRef::new(&a, 3, 3, 3, 1),
        Err(GemmError::Buffer { .. })
    ));
    assert!(matches!(
        MatRef::new(&a, usize::MAX, 2, usize::MAX, 1),
        Err(GemmError::Buffer { needed: None, .. })
    ));
    let a2 = MatRef::row_major(&a, 2, 3).unwrap();
    let b = MatRef::row_major(&a, 2, 3).unwrap();
    let mut c = vec![0.0; 9];
    let mut cm = MatMut::row_major(&mut c, 2, 3).unwrap();
    let e = p02_matmul_bench::sgemm(a2, b, &mut cm, GemmOpts::default()).unwrap_err();
    assert_eq!(
        e,
        GemmError::Shape {
            a: (2, 3),
            b: (2, 3),
            c: (2, 3)
        }
    );
    let b = MatRef::row_major(&a, 3, 2).unwrap();
    let mut c = vec![0.0; 4];
    let mut cm = MatMut::row_major(&mut c, 2, 2).unwrap();
    let opts = GemmOpts {
        bias: Some(&[1.0, 2.0, 3.0]),
        ..GemmOpts::default()
    };
    assert_eq!(
        p02_matmul_bench::sgemm(a2, b, &mut cm, opts).unwrap_err(),
        GemmError::Bias { len: 3, n: 2 }
    );
    let mut y = vec![0.0; 3];
    assert!(matches!(
        p02_matmul_bench::linear(&a, 2, &a[..5], 2, None, &mut y, 1),
        Err(GemmError::Linear { .. })
    ));
    assert!(p02_matmul_bench::linear(&a, 2, &a, 2, None, &mut y[..2], 1).is_err());
    let mut y = vec![0.0; 4];
    p02_matmul_bench::linear(&a, 2, &a, 2, None, &mut y, 1).unwrap();
}

/// The lower-level safe entry points check shapes too: before, a mismatched
/// C went straight to the raw-pointer driver (gemm_packed) or was sliced
/// past its end (gemv).
#[test]
fn low_level_entry_points_check_shapes() {
    use p02_matmul_bench::gemv::gemv;
    let a = vec![1.0f32; 64];
    let x = MatRef::row_major(&a, 1, 8).unwrap();
    let w = MatRef::row_major(&a, 8, 8).unwrap(); // (K, N) = (8, 8)
    let mut small = vec![0.0f32; 4];
    // C has 4 columns, B 8: every entry point refuses, none writes.
    for kern in MicroKernel::available() {
        let mut cm = MatMut::row_major(&mut small, 1, 4).unwrap();
        assert!(matches!(
            gemm_packed(1.0, x, w, 0.0, &mut cm, kern, 2),
            Err(GemmError::Shape { .. })
        ));
    }
    let mut cm = MatMut::row_major(&mut small, 1, 4).unwrap();
    assert!(matches!(
        gemv(1.0, x, w, 0.0, &mut cm, 1),
        Err(GemmError::Shape { .. })
    ));
    // Two rows of x are not a GEMV.
    let x2 = MatRef::row_major(&a, 2, 8).unwrap();
    let mut c = vec![0.0f32; 16];
    let mut cm = MatMut::row_major(&mut c, 2, 8).unwrap();
    assert!(matches!(
        gemv(1.0, x2, w, 0.0, &mut cm, 1),
        Err(GemmError::Shape { .. })
    ));
    assert_eq!(small, vec![0.0; 4], "nothing was written");
    // K = 0 is an empty sum: C = beta * C, for both.
    let empty: [f32; 0] = [];
    let x0 = MatRef::row_major(&empty, 1, 0).unwrap();
    let w0 = MatRef::row_major(&empty, 0, 4).unwrap();
    let mut y = vec![3.0f32; 4];
    gemv(
        1.0,
        x0,
        w0,
        0.5,
        &mut MatMut::row_major(&mut y, 1, 4).unwrap(),
        1,
    )
    .unwrap();
    assert_eq!(y, vec![1.5; 4]);
    gemm_packed(
        1.0,
        x0,
        w0,
        0.0,
        &mut MatMut::row_major(&mut y, 1, 4).unwrap(),
        MicroKernel::PORTABLE,
        1,
    )
    .unwrap();
    assert_eq!(y, vec![0.0; 4]);
}

#[test]
fn prepacked_b_matches_reference() {
    use p02_matmul_bench::{sgemm_prepacked, PackedB};
    let kernels = MicroKernel::available();
    let mut shapes = SHAPES.to_vec();
    // Plus small batches whose last rows are an edge of 1-3 rows under
    // full-width slivers (6x16 and 8x32 tiles): 8, 9, 10, 11, 16 rows.
    shapes.extend([(200, 150, 300), (3, 1000, 1500), (40, 5000, 600)]);
    shapes.extend([
        (8, 64, 300),
        (9, 48, 257),
        (10, 96, 260),
        (11, 64, 33),
        (16, 96, 600),
    ]);
    for &(m, n, k) in &shapes {
        let av = common::testdata::uniform(m * k, (m + 3 * k) as u64);
        let w = common::testdata::uniform(n * k, (n + k) as u64); // W (n, k): B = W^T
        let bias = common::testdata::uniform(n, 11);
        let a = MatRef::row_major(&av, m, k).unwrap();
        let b = MatRef::row_major(&w, n, k).unwrap().t();
        let mut ref_c = vec![7.0; m * (n + 2)];
        let scale = gemm_ref(
            1.0,
            a,
            b,
            0.0,
            &mut MatMut::new(&mut ref_c, m, n, n + 2).unwrap(),
            Some(&bias),
        );
        for kern in &kernels {
            let packed = PackedB::new(b, *kern);
            assert_eq!((packed.rows(), packed.cols()), (k, n));
            for threads in [1, 2] {
                let mut c = vec![7.0; m * (n + 2)];
                for v in c.chunks_mut(n + 2) {
                    v[..n].fill(f32::NAN);
                }
                let mut cm = MatMut::new(&mut c, m, n, n + 2).unwrap();
                sgemm_prepacked(
                    a,
                    &packed,
                    &mut cm,
                    GemmOpts {
                        bias: Some(&bias),
                        threads,
                        ..GemmOpts::default()
                    },
                )
                .unwrap();
                check(
                    &format!("prepacked {} threads {threads} {m}x{n}x{k}", kern.name()),
                    &cm,
                    &ref_c,
                    &scale,
                    k,
                );
            }
        }
    }
    let w = vec![0.0; 6];
    assert!(PackedB::linear_weight(&w, 4, 2).is_err());
    let p = PackedB::linear_weight(&w, 3, 2).unwrap();
    let x = vec![0.0; 4];
    let mut y = vec![0.0; 2 * 4];
    let e = sgemm_prepacked(
        MatRef::row_major(&x, 2, 2).unwrap(),
        &p,
        &mut MatMut::row_major(&mut y, 2, 4).unwrap(),
        GemmOpts::default(),
    );
    assert!(matches!(e, Err(GemmError::Shape { .. })));
}

/// Packing from a row producer gives the same products as packing the f32
/// matrix, bit for bit, for shapes with ragged slivers, panels and K blocks.
#[test]
fn packing_from_weight_rows_equals_packing_the_matrix() {
    use p02_matmul_bench::{sgemm_prepacked, PackedB};
    for (out_f, in_f, rows) in [(3, 2, 1), (17, 33, 5), (700, 1100, 9), (64, 576, 16)] {
        let w: Vec<f32> = (0..out_f * in_f)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let x: Vec<f32> = (0..rows * in_f)
            .map(|i| ((i * 31) % 97) as f32 / 50.0 - 1.0)
            .collect();
        let a = PackedB::linear_weight(&w, out_f, in_f).unwrap();
        let b = PackedB::from_weight_rows(out_f, in_f, 2, |j0, count, buf| {
            buf.copy_from_slice(&w[j0 * in_f..(j0 + count) * in_f])
        });
        let run = |p: &PackedB| {
            let mut y = vec![0.0f32; rows * out_f];
            sgemm_prepacked(
                MatRef::row_major(&x, rows, in_f).unwrap(),
                p,
                &mut MatMut::row_major(&mut y, rows, out_f).unwrap(),
                GemmOpts::default(),
            )
            .unwrap();
            y
        };
        assert_eq!(run(&a), run(&b), "{out_f}x{in_f}");
    }
}

#[test]
fn sliver_transpose_matches_the_scalar_reference() {
    use p02_matmul_bench::pack::{transpose_sliver, transpose_sliver_scalar};
    // nr 8/16/32 take the AVX tiles where present; 6 the scalar loop. kc off
    // the 8-wide tile, p0 inside the row, padded row strides.
    for (nr, ld, p0, kc) in [
        (8, 8, 0, 8),
        (16, 576, 256, 256),
        (16, 1537, 3, 1533),
        (32, 100, 7, 91),
        (8, 20, 1, 5),
        (6, 40, 2, 37),
    ] {
        let w: Vec<f32> = (0..nr * ld).map(|i| i as f32 * 0.5 - 3.0).collect();
        let mut fast = vec![f32::NAN; kc * nr + 3];
        let mut slow = fast.clone();
        transpose_sliver(&w, ld, p0, kc, nr, &mut fast);
        transpose_sliver_scalar(&w, ld, p0, kc, nr, &mut slow);
        assert_eq!(
            fast[..kc * nr],
            slow[..kc * nr],
            "nr {nr} ld {ld} p0 {p0} kc {kc}"
        );
        assert!(
            fast[kc * nr..].iter().all(|v| v.is_nan()),
            "wrote past kc·nr"
        );
        for p in [0, kc / 2, kc - 1] {
            for c in [0, nr - 1] {
                assert_eq!(slow[p * nr + c], w[c * ld + p0 + p]);
            }
        }
    }
}

#[test]
fn empty_slivers_write_nothing() {
    use p02_matmul_bench::pack::{transpose_sliver, transpose_sliver_scalar};
    let w = vec![1.0f32; 64];
    let mut dst = vec![f32::NAN; 8];
    transpose_sliver(&w, 8, 0, 8, 0, &mut dst);
    transpose_sliver(&w, 8, 0, 0, 8, &mut dst);
    transpose_sliver_scalar(&w, 8, 0, 8, 0, &mut dst);
    transpose_sliver_scalar(&w, 8, 0, 0, 8, &mut dst);
    assert!(dst.iter().all(|v| v.is_nan()));
}

#[test]
#[should_panic(expected = "need more than")]
fn sliver_transpose_refuses_a_short_source() {
    let w = vec![0.0f32; 16 * 64 - 1];
    let mut dst = vec![0.0f32; 64 * 16];
    p02_matmul_bench::pack::transpose_sliver(&w, 64, 0, 64, 16, &mut dst);
}

/// The in-loop weight producer (Project 10's prefill path) against the f64
/// reference: ragged slivers, panels and K blocks, one and two threads, a
/// K unit of 1 and of 32 (a quantised block), bias and beta; every range it
/// is asked for is inside W and on the unit.
#[test]
fn weight_rows_in_the_loop_match_reference() {
    use p02_matmul_bench::sgemm_weight_rows;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let shapes = [
        (1, 3, 32, 32),
        (7, 17, 64, 32),
        (16, 700, 576, 32),
        (40, 33, 1536, 32),
        (13, 31, 257, 1),
        (256, 96, 192, 32),
    ];
    for (m, n, k, k_unit) in shapes {
        let av = common::testdata::uniform(m * k, (m + 5 * k) as u64);
        let w = common::testdata::uniform(n * k, (2 * n + k) as u64); // W (n, k)
        let bias = common::testdata::uniform(n, 13);
        let c0 = common::testdata::uniform(m * n, 17);
        let a = MatRef::row_major(&av, m, k).unwrap();
        let b = MatRef::row_major(&w, n, k).unwrap().t();
        let mut ref_c = vec![7.0; m * (n + 2)];
        for (r, v) in ref_c.chunks_mut(n + 2).zip(c0.chunks(n)) {
            r[..n].copy_from_slice(v);
        }
        let scale = gemm_ref(
            0.5,
            a,
            b,
            2.0,
            &mut MatMut::new(&mut ref_c, m, n, n + 2).unwrap(),
            Some(&bias),
        );
        for threads in [1, 2] {
            let asked = AtomicUsize::new(0);
            let produce = |j0: usize, count: usize, p0: usize, kc: usize, out: &mut [f32]| {
                assert!(j0 + count <= n && p0 + kc <= k, "range outside W");
                assert!(
                    p0.is_multiple_of(k_unit) && kc.is_multiple_of(k_unit),
                    "off the unit"
                );
                assert_eq!(out.len(), count * kc);
                for (r, row) in out.chunks_exact_mut(kc).enumerate() {
                    let src = (j0 + r) * k + p0;
                    row.copy_from_slice(&w[src..src + kc]);
                }
                asked.fetch_add(count * kc, Ordering::Relaxed);
            };
            let mut c = vec![7.0; m * (n + 2)];
            for (r, v) in c.chunks_mut(n + 2).zip(c0.chunks(n)) {
                r[..n].copy_from_slice(v);
            }
            let mut cm = MatMut::new(&mut c, m, n, n + 2).unwrap();
            let opts = GemmOpts {
                alpha: 0.5,
                beta: 2.0,
                bias: Some(&bias),
                threads,
            };
            sgemm_weight_rows(a, n, k_unit, &produce, &mut cm, opts).unwrap();
            check(
                &format!("weight rows threads {threads} {m}x{n}x{k} unit {k_unit}"),
                &cm,
                &ref_c,
                &scale,
                k,
            );
            // Each weight once when the columns split (or one thread).
            let split = threads == 1 || n >= threads * MicroKernel::best().nr();
            if split {
                assert_eq!(asked.load(Ordering::Relaxed), n * k, "{m}x{n}x{k}");
            }
            // The same W as packed slivers, written straight into the
            // micro-kernel's layout.
            let asked = AtomicUsize::new(0);
            let sliver =
                |j0: usize, count: usize, p0: usize, kc: usize, nr: usize, dst: &mut [f32]| {
                    assert!(
                        count <= nr && j0 + count <= n && p0 + kc <= k,
                        "range outside W"
                    );
                    assert!(
                        p0.is_multiple_of(k_unit) && kc.is_multiple_of(k_unit),
                        "off the unit"
                    );
                    assert_eq!(dst.len(), kc * nr);
                    for (p, d) in dst.chunks_exact_mut(nr).enumerate() {
                        for (col, v) in d.iter_mut().enumerate() {
                            *v = if col < count {
                                w[(j0 + col) * k + p0 + p]
                            } else {
                                0.0
                            };
                        }
                    }
                    asked.fetch_add(count * kc, Ordering::Relaxed);
                };
            let mut c = vec![7.0; m * (n + 2)];
            for (r, v) in c.chunks_mut(n + 2).zip(c0.chunks(n)) {
                r[..n].copy_from_slice(v);
            }
            let mut cm = MatMut::new(&mut c, m, n, n + 2).unwrap();
            p02_matmul_bench::sgemm_weight_slivers(a, n, k_unit, &sliver, &mut cm, opts).unwrap();
            check(
                &format!("weight slivers threads {threads} {m}x{n}x{k} unit {k_unit}"),
                &cm,
                &ref_c,
                &scale,
                k,
            );
            if split {
                assert_eq!(asked.load(Ordering::Relaxed), n * k, "{m}x{n}x{k}");
            }
        }
    }
    // K not a multiple of the unit, or a zero unit: an error, not a panic.
    let (x, mut y) = (vec![0.0; 2 * 40], vec![0.0; 2 * 3]);
    let none = |_: usize, _: usize, _: usize, _: usize, _: &mut [f32]| {};
    for unit in [0, 32] {
        let e = sgemm_weight_rows(
            MatRef::row_major(&x, 2, 40).unwrap(),
            3,
            unit,
            &none,
            &mut MatMut::row_major(&mut y, 2, 3).unwrap(),
            GemmOpts::default(),
        );
        assert_eq!(
            e,
            Err(GemmError::KUnit {
                k: 40,
                k_unit: unit
            })
        );
    }
}
