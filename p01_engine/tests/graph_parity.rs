//! Whole-graph parity with PyTorch: the trained MNIST MLP on all 1,000
//! held-out digits, and a random-init graph that uses every op.

use common::compare::check_close;
use common::st;
use common::Tensor;
use p01_engine::graph::CompileOptions;
use p01_engine::{Graph, LoadOptions, Workspace};

/// The seed's bar: max|diff| < 1e-5 on the logits.
const LOGITS_ATOL: f32 = 1e-5;

fn mnist() -> (Tensor, Vec<i64>, Tensor) {
    let mut f = st::load(&p01_engine::fixtures_dir().join("mnist_test.safetensors")).unwrap();
    let labels = f.ints("labels").unwrap().1.clone();
    (f.take("images").unwrap(), labels, f.take("logits").unwrap())
}

#[test]
fn mlp_matches_pytorch_on_1000_digits_every_configuration() {
    let (images, labels, expected) = mnist();
    assert_eq!(images.shape(), &[1000, 784]);
    assert_eq!(labels.len(), 1000);
    let want_argmax = expected.argmax_rows().unwrap();
    let dir = p01_engine::fixtures_dir().join("mlp");
    for mmap in [true, false] {
        for fuse in [true, false] {
            for threads in [1, 2] {
                let opts = LoadOptions {
                    mmap,
                    compile: CompileOptions {
                        fuse_linear_relu: fuse,
                    },
                    threads,
                };
                let engine = Graph::load_with(&dir, opts).unwrap();
                let logits = engine.forward(&images).unwrap();
                let what = format!("mlp logits (mmap {mmap}, fuse {fuse}, threads {threads})");
                let d = check_close(&what, &logits, &expected, LOGITS_ATOL, 0.0)
                    .unwrap_or_else(|e| panic!("{e}"));
                assert!(d.max_abs < LOGITS_ATOL);
                assert_eq!(
                    logits.argmax_rows().unwrap(),
                    want_argmax,
                    "{what}: argmax differs"
                );
            }
        }
    }
    let acc = want_argmax
        .iter()
        .zip(&labels)
        .filter(|(p, l)| **p as i64 == **l)
        .count();
    assert!(
        acc > 850,
        "PyTorch's own accuracy on the fixture is {acc}/1000: fixtures look wrong"
    );
}

#[test]
fn mlp_batch_one_equals_batched_rows() {
    let (images, _, expected) = mnist();
    let engine = Graph::load(p01_engine::fixtures_dir().join("mlp")).unwrap();
    let mut ws = Workspace::default();
    for i in [0usize, 1, 499, 999] {
        let y = engine
            .forward_into(&mut ws, images.row(i), 1)
            .unwrap()
            .to_vec();
        let d = common::compare::diff(&y, expected.row(i), LOGITS_ATOL, 0.0).unwrap();
        assert_eq!(d.n_bad, 0, "image {i}: {d:?}");
    }
}

#[test]
fn every_op_graph_matches_pytorch() {
    let dir = p01_engine::fixtures_dir().join("every_op");
    let io = st::load(&dir.join("io.safetensors")).unwrap();
    let json = std::fs::read_to_string(dir.join("model.json")).unwrap();
    for op in [
        "\"embedding\"",
        "\"layernorm\"",
        "\"linear\"",
        "\"gelu\"",
        "\"relu\"",
        "\"add\"",
        "\"softmax\"",
        "\"tanh\"",
        "\"none\"",
    ] {
        assert!(json.contains(op), "every_op graph should use {op}");
    }
    for fuse in [true, false] {
        let opts = LoadOptions {
            compile: CompileOptions {
                fuse_linear_relu: fuse,
            },
            ..LoadOptions::default()
        };
        let engine = Graph::load_with(&dir, opts).unwrap();
        let probs = engine.forward(io.tensor("ids").unwrap()).unwrap();
        check_close(
            "every_op probs",
            &probs,
            io.tensor("probs").unwrap(),
            1e-6,
            1e-5,
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn stats_are_derived_from_the_graph() {
    let engine = Graph::load(p01_engine::fixtures_dir().join("mlp")).unwrap();
    let s = engine.stats();
    // 784*256+256 + 256*128+128 + 128*10+10
    assert_eq!(s.n_params, 235_146);
    assert_eq!(s.weight_bytes, 4 * 235_146);
    assert_eq!(
        s.linear_flops_per_example,
        2 * (784 * 256 + 256 * 128 + 128 * 10) + 256 + 128 + 10
    );
    // Fusion folds both relus into their linears: 3 steps, not 5.
    assert_eq!(engine.plan().nodes.len(), 3);
}
