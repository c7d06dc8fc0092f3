//! int8 per channel on a GPT-2 layout model (Project 04's `tiny_gpt2`
//! fixture, made by transformers): the projections really are int8 behind
//! the seam, and the model stays close to its f32 self on the fixture's ids.

use common::st;
use p10_quant::int8_gpt2::{compare, load_int8};
use p10_quant::Dot;

#[test]
fn tiny_gpt2_in_int8_per_channel_stays_close_to_f32() {
    let dir = p04_transformer::fixtures_dir().join("tiny_gpt2");
    let io = st::load(&dir.join("io.safetensors")).unwrap();
    let (shape, ids) = io.ints("ids").unwrap();
    let ids: Vec<u32> = ids.iter().map(|&i| u32::try_from(i).unwrap()).collect();
    for isa in p10_quant::Isa::available() {
        let dot = Dot::new(isa).unwrap();
        let q = load_int8(&dir, dot).unwrap();
        assert_eq!(q.blocks[0].c_attn.w.weights().format(), "I8 per channel");
        let r = compare(&dir, &ids, shape[0], shape[1], dot).unwrap();
        // The seam carried int8: a quarter of the bytes (plus a scale per
        // block and per row), and logits that are not f32's exactly.
        assert!(
            r.weight_bytes[1] * 3 < r.weight_bytes[0],
            "{isa}: {:?}",
            r.weight_bytes
        );
        assert!(
            r.max_abs_logit_diff > 0.0,
            "{isa}: int8 gave f32's logits exactly"
        );
        // Predicted before running: per-channel int8 moves each weight by at
        // most half a step (1/254 of its row's largest), so next-token
        // choices hold at all but near-ties and the divergence is ~1e-4.
        assert!(
            r.argmax_agree * 7 >= r.positions * 6,
            "{isa}: argmax agrees at {} of {} positions",
            r.argmax_agree,
            r.positions
        );
        assert!(r.mean_kl < 1e-2, "{isa}: mean KL {}", r.mean_kl);
        println!(
            "{isa}: {}/{} argmax equal, max |logit diff| {:.4}, mean KL {:.2e}, bytes {:?}",
            r.argmax_agree, r.positions, r.max_abs_logit_diff, r.mean_kl, r.weight_bytes
        );
    }
}

#[test]
fn a_width_that_is_not_whole_blocks_is_refused_with_the_tensor_named() {
    // GPT-2 widths are multiples of 32; a model whose are not is an error
    // naming the tensor, not a short read.
    let dir = std::path::PathBuf::from("some/gpt2");
    assert!(p10_quant::int8_gpt2::check_width(&dir, "h.0.attn.c_attn", 96, 32).is_ok());
    let e = p10_quant::int8_gpt2::check_width(&dir, "h.0.attn.c_attn", 96, 33).unwrap_err();
    assert!(e.to_string().contains("h.0.attn.c_attn"), "{e}");
    assert!(p10_quant::int8_gpt2::check_width(&dir, "x", 96, 0).is_err());
}
