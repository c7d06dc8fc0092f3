//! int8 per output channel on Project 01's MNIST MLP, on the 1,000
//! held-out digits PyTorch's fixtures hold, against Project 01's f32
//! engine, on every kernel path this CPU has.
//!
//! What "close" means: per-channel int8 rounds each weight by at most half
//! a step (amax/254 of its row); over 784 inputs that moves a logit by a
//! few hundredths (measured 0.04 weight-only, 0.08 with 8-bit activations,
//! on logits spanning ±20). A wrong scale or a transposed layer moves
//! logits by their whole range and accuracy to chance (10%). The bounds:
//! logits within 0.3, argmax equal on ≥ 99% of digits, accuracy within
//! one point of f32's.

use p10_quant::int8_mlp::{evaluate, Int8Mlp};
use p10_quant::{Dot, Isa};

#[test]
fn int8_mlp_keeps_f32s_predictions_on_every_path() {
    let fx = p01_engine::fixtures_dir();
    for isa in Isa::available() {
        let r = evaluate(
            &fx.join("mlp"),
            &fx.join("mnist_test.safetensors"),
            Dot::new(isa).unwrap(),
            2,
        )
        .unwrap();
        eprintln!("{isa}: {r:?}");
        assert_eq!(r.n, 1000);
        // f32 is Project 01's engine: 92.0% (its README; PyTorch agrees).
        assert!(r.correct[0] >= 900, "{r:?}");
        for i in 0..2 {
            assert!(r.correct[i + 1].abs_diff(r.correct[0]) <= 10, "{isa} {r:?}");
            assert!(r.agree[i] >= 990, "{isa} {r:?}");
            assert!(r.max_diff[i] < 0.3, "{isa} {r:?}");
        }
        // About 4x fewer bytes: int8 blocks (34 bytes per 32) + scales + biases.
        assert!(r.bytes[1] * 3 < r.bytes[0], "{r:?}");
    }
}

#[test]
fn graphs_beyond_linear_relu_chains_are_refused_by_name() {
    let e = Int8Mlp::load(
        &p01_engine::fixtures_dir().join("every_op"),
        Dot::new(Isa::Scalar).unwrap(),
    )
    .unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("model.json") && msg.contains("node"), "{msg}");
}
