//! Every op against PyTorch on random inputs (fixtures/ops.*, made by
//! scripts/export_p01.py), plus the fast linear against its naive reference
//! on awkward shapes, for every kernel and thread split.

use common::compare::check_close;
use common::st;
use common::Tensor;
use p01_engine::linear::{linear_ref, Activation, Kernel, Linear, MR, STRIPE};
use p01_engine::ops::{self, GeluApprox};
use serde_json::Value;

/// float32 results of short reductions (<= 129 terms) against PyTorch's own
/// float32: a few ulps of the output scale.
const ATOL: f32 = 1e-5;
const RTOL: f32 = 1e-5;

#[test]
fn every_op_case_matches_pytorch() {
    let dir = p01_engine::fixtures_dir();
    let cases: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("ops.json")).unwrap()).unwrap();
    let f = st::load(&dir.join("ops.safetensors")).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    let cases = cases["cases"].as_array().unwrap();
    assert!(
        cases.len() >= 15,
        "expected the full case list, found {}",
        cases.len()
    );
    for c in cases {
        let op = c["op"].as_str().unwrap();
        let name = c["case"].as_str().unwrap();
        let t = |k: &str| f.tensor(&format!("{name}/{k}")).unwrap();
        let attrs = &c["attrs"];
        let got = match op {
            "linear" => ops::linear(t("x"), t("weight"), Some(t("bias"))).unwrap(),
            "relu" => ops::relu(t("x")),
            "gelu" => {
                let a = if attrs["approximate"] == "tanh" {
                    GeluApprox::Tanh
                } else {
                    GeluApprox::Erf
                };
                ops::gelu(t("x"), a)
            }
            "layernorm" => {
                let eps = attrs["eps"].as_f64().unwrap() as f32;
                ops::layernorm(t("x"), t("weight"), t("bias"), eps).unwrap()
            }
            "softmax" => ops::softmax(t("x")).unwrap(),
            "embedding" => ops::embedding(t("ids"), t("weight")).unwrap(),
            "add" => ops::add(t("a"), t("b")).unwrap(),
            other => panic!("fixture has unknown op {other}"),
        };
        check_close(name, &got, t("y"), ATOL, RTOL).unwrap_or_else(|e| panic!("{e}"));
        if op == "linear" {
            let naive = ops::linear_naive(t("x"), t("weight"), Some(t("bias"))).unwrap();
            check_close(&format!("{name} (naive)"), &naive, t("y"), ATOL, RTOL)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        seen.insert(op.to_string());
    }
    let all = [
        "add",
        "embedding",
        "gelu",
        "layernorm",
        "linear",
        "relu",
        "softmax",
    ];
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), all);
}

#[test]
fn fast_linear_matches_naive_on_awkward_shapes() {
    let rows_set = [0, 1, 2, MR - 1, MR, MR + 1, 13, 4 * MR - 1, 4 * MR, 97];
    let in_set = [0, 1, 3, 7, 64, 131];
    let out_set = [1, 5, STRIPE - 1, STRIPE, STRIPE + 1, 33, 47];
    let kernels = [Kernel::detect(), Kernel::Portable];
    let mut checked = 0;
    for &rows in &rows_set {
        for &in_f in &in_set {
            for &out_f in &out_set {
                let seed = (rows * 1_000_003 + in_f * 1009 + out_f) as u64;
                let x = common::testdata::uniform(rows * in_f, seed);
                let w = common::testdata::uniform(out_f * in_f, seed + 1);
                let b = common::testdata::uniform(out_f, seed + 2);
                let lin = Linear::new(&w, Some(&b), out_f, in_f);
                let mut expected = linear_ref(&x, rows, &w, Some(&b), out_f);
                for &kernel in &kernels {
                    for threads in [1, 2, 3] {
                        for act in [Activation::None, Activation::Relu] {
                            let mut y = vec![f32::NAN; rows * out_f];
                            lin.forward_with(kernel, &x, rows, &mut y, act, threads);
                            if act == Activation::Relu {
                                ops::relu_inplace(&mut expected);
                            }
                            let what = format!("rows {rows} in {in_f} out {out_f} {kernel:?} threads {threads} {act:?}");
                            let e = Tensor::new(vec![rows, out_f], expected.clone()).unwrap();
                            let g = Tensor::new(vec![rows, out_f], y).unwrap();
                            check_close(&what, &g, &e, 1e-5, 1e-5)
                                .unwrap_or_else(|e| panic!("{e}"));
                            checked += 1;
                        }
                        expected = linear_ref(&x, rows, &w, Some(&b), out_f);
                    }
                }
            }
        }
    }
    assert_eq!(
        checked,
        rows_set.len() * in_set.len() * out_set.len() * 2 * 3 * 2
    );
}

#[test]
fn threaded_paths_are_exercised_and_agree() {
    // Shapes large enough to pass PAR_MIN_MACS: one row (stripe split) and
    // many rows (row split), against the single-thread result.
    for (rows, in_f, out_f) in [
        (1, 576, 8192 + 5),
        (3, 576, 2500),
        (200, 784, 256),
        (37, 784, 256),
    ] {
        assert!(rows * in_f * out_f >= p01_engine::linear::PAR_MIN_MACS);
        let x = common::testdata::uniform(rows * in_f, 7 + rows as u64);
        let w = common::testdata::uniform(out_f * in_f, 8 + in_f as u64);
        let lin = Linear::new(&w, None, out_f, in_f);
        let mut y1 = vec![0.0; rows * out_f];
        let mut y2 = vec![1.0; rows * out_f];
        lin.forward(&x, rows, &mut y1, Activation::None, 1);
        lin.forward(&x, rows, &mut y2, Activation::None, 2);
        assert_eq!(
            y1, y2,
            "rows {rows}: threads must not change the arithmetic"
        );
        let r = linear_ref(&x, rows, &w, None, out_f);
        let d = common::compare::diff(&y1, &r, 1e-4, 1e-4).unwrap();
        assert_eq!(d.n_bad, 0, "rows {rows}: {d:?}");
    }
}

#[test]
fn softmax_survives_huge_logits_and_embedding_rejects_bad_ids() {
    let x = Tensor::new(vec![1, 3], vec![1000.0, 1001.0, -1000.0]).unwrap();
    let y = ops::softmax(&x).unwrap();
    assert!(y.data().iter().all(|v| v.is_finite()), "{:?}", y.data());
    assert!((y.data()[1] - 0.731_058_6).abs() < 1e-6);

    let table = Tensor::new(vec![3, 2], vec![0.0; 6]).unwrap();
    for bad in [3.0, -1.0, 0.5, f32::NAN] {
        let ids = Tensor::new(vec![2], vec![0.0, bad]).unwrap();
        let e = ops::embedding(&ids, &table).unwrap_err();
        assert!(
            matches!(
                e,
                p01_engine::OpError::EmbeddingId {
                    index: 1,
                    vocab: 3,
                    ..
                }
            ),
            "{e}"
        );
    }
}
