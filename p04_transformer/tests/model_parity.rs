//! Forward passes against transformers: tiny random GPT2LMHeadModel and LlamaForCausalLM
//! (GQA, untied head) from its save_pretrained directory, and
//! SmolLM2-135M-Instruct from the Q4_1 GGUF (last-position logits and 32
//! greedy tokens for 5 prompts, one chat-formatted).

use common::compare::check_close;
use common::st;
use p04_transformer::{GgufFile, Llama, ModelError};

fn ids_u32(v: &[i64]) -> Vec<u32> {
    v.iter()
        .map(|&i| u32::try_from(i).expect("fixture ids are small"))
        .collect()
}

#[test]
fn tiny_llama_matches_transformers_at_every_position() {
    let dir = p04_transformer::fixtures_dir().join("tiny_llama");
    let model = Llama::from_hf_dir(&dir).unwrap();
    assert_eq!(
        (model.cfg.n_head, model.cfg.n_kv_head),
        (4, 2),
        "GQA must be on"
    );
    assert!(!model.tied, "this fixture has an untied head");
    let io = st::load(&dir.join("io.safetensors")).unwrap();
    let (shape, ids) = io.ints("ids").unwrap();
    let logits = model.forward(&ids_u32(ids), shape[0], shape[1]).unwrap();
    // 2 layers of width 32: float32 sums of <= 64 terms; 1e-4 is ~100 ulps at logit scale ~2.
    check_close(
        "tiny llama logits",
        &logits,
        io.tensor("logits").unwrap(),
        1e-4,
        0.0,
    )
    .unwrap_or_else(|e| panic!("{e}"));
}

/// Measured worst |logit - transformers| over 5 prompts x 49,152 logits: 5.2e-5
/// (f32 sums of 576..1536 terms through 30 layers, in a different order than
/// PyTorch's; logits reach ~30). The bound leaves 4x for other CPUs' kernels.
const SMOLLM2_LOGIT_ATOL: f32 = 2e-4;

#[test]
fn smollm2_gguf_matches_transformers_logits_and_32_greedy_tokens() {
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).unwrap_or_else(|e| panic!("{e}"));
    let model = Llama::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    assert!(model.tied, "SmolLM2 ties its head to the embeddings");
    let fx = st::load(&p04_transformer::fixtures_dir().join("smollm2_parity.safetensors")).unwrap();
    let mut worst = 0.0f32;
    for p in 0..5 {
        let ids = ids_u32(&fx.ints(&format!("p{p}/ids")).unwrap().1);
        let want = fx.tensor(&format!("p{p}/last_logits")).unwrap();
        let logits = model.forward(&ids, 1, ids.len()).unwrap();
        let v = logits.shape()[2];
        let last =
            common::Tensor::new(vec![v], logits.data()[(ids.len() - 1) * v..].to_vec()).unwrap();
        let d = check_close(
            &format!("prompt {p} last logits"),
            &last,
            want,
            SMOLLM2_LOGIT_ATOL,
            0.0,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        worst = worst.max(d.max_abs);

        // Greedy: argmax, append, recompute everything (no cache yet).
        let greedy = fx.ints(&format!("p{p}/greedy")).unwrap().1.clone();
        let mut seq = ids.clone();
        for (step, &expected) in greedy.iter().enumerate() {
            let logits = model.forward(&seq, 1, seq.len()).unwrap();
            let next = logits.data()[(seq.len() - 1) * v..]
                .iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, &x)| if x > b.1 { (i, x) } else { b },
                )
                .0;
            assert_eq!(next as i64, expected, "prompt {p}, greedy step {step}");
            seq.push(next as u32);
        }
    }
    eprintln!("SmolLM2 worst |logit diff| over 5 prompts: {worst:e}");
}

#[test]
fn bad_ids_and_lengths_are_errors() {
    let model = Llama::from_hf_dir(&p04_transformer::fixtures_dir().join("tiny_llama")).unwrap();
    let e = model.forward(&[1, 2, 101], 1, 3).unwrap_err().to_string();
    assert!(
        e.contains("token id 101 at position 2") && e.contains("101"),
        "{e}"
    );
    let e = model.forward(&vec![1; 65], 1, 65).unwrap_err().to_string();
    assert!(
        e.contains("65 tokens exceeds the model's context of 64"),
        "{e}"
    );
    assert!(model.forward(&[1, 2, 3], 2, 2).is_err());
}

#[test]
fn tiny_gpt2_matches_transformers_at_every_position() {
    let dir = p04_transformer::fixtures_dir().join("tiny_gpt2");
    let model = p04_transformer::Gpt2::from_hf_dir(&dir).unwrap();
    let io = st::load(&dir.join("io.safetensors")).unwrap();
    let (shape, ids) = io.ints("ids").unwrap();
    let logits = model.forward(&ids_u32(ids), shape[0], shape[1]).unwrap();
    check_close(
        "tiny gpt2 logits",
        &logits,
        io.tensor("logits").unwrap(),
        1e-4,
        0.0,
    )
    .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn gpt2_loads_the_published_layout_without_prefix() {
    // The real `gpt2` checkpoint names tensors `h.0.attn.c_attn.weight`, not
    // `transformer.h.0...`: rewrite the fixture that way and load it unchanged.
    let src = p04_transformer::fixtures_dir().join("tiny_gpt2");
    let dir = std::env::temp_dir().join(format!("p04-gpt2-bare-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let f = st::load(&src.join("model.safetensors")).unwrap();
    let renamed: Vec<(String, common::Tensor)> = f
        .tensors
        .iter()
        .map(|(k, v)| (k.trim_start_matches("transformer.").to_string(), v.clone()))
        .collect();
    assert!(renamed.iter().all(|(k, _)| !k.starts_with("transformer.")));
    let refs: Vec<(&str, &common::Tensor)> = renamed.iter().map(|(k, v)| (k.as_str(), v)).collect();
    st::save(&dir.join("model.safetensors"), &refs).unwrap();
    let bare = p04_transformer::Gpt2::from_hf_dir(&dir).unwrap();
    let prefixed = p04_transformer::Gpt2::from_hf_dir(&src).unwrap();
    let ids = [3u32, 1, 4, 1, 5];
    assert_eq!(
        bare.forward(&ids, 1, 5).unwrap(),
        prefixed.forward(&ids, 1, 5).unwrap()
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn mis_shaped_tensor_and_unknown_architecture_are_named() {
    let src = p04_transformer::fixtures_dir().join("tiny_llama");
    let dir = std::env::temp_dir().join(format!("p04-badcfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["intermediate_size"] = serde_json::json!(65);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let e = Llama::from_hf_dir(&dir).unwrap_err().to_string();
    assert!(
        e.contains("model.layers.0.mlp.gate_proj.weight")
            && e.contains("[64, 32]")
            && e.contains("[65, 32]"),
        "{e}"
    );
    cfg["intermediate_size"] = serde_json::json!(64);
    cfg["model_type"] = serde_json::json!("mamba");
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let e = p04_transformer::model::Transformer::load(&dir)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`mamba`") && e.contains("llama, gpt2"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Hyper-parameters that would overflow a product or allocate without
/// bound (block list, RoPE tables) are refused by name before any
/// allocation; before, a huge `max_position_embeddings` reached
/// `vec![0; seq * half]` and a GPT-2 `n_embd` of 0 passed the loader and
/// panicked in `chunks_exact(0)` at the first forward.
#[test]
fn hostile_hyper_parameters_are_config_errors() {
    let cases: [(&str, &str, serde_json::Value, &str); 6] = [
        (
            "tiny_llama",
            "max_position_embeddings",
            serde_json::json!(1u64 << 40),
            "context_length",
        ),
        (
            "tiny_llama",
            "num_hidden_layers",
            serde_json::json!(1u64 << 50),
            "block_count",
        ),
        (
            "tiny_llama",
            "head_dim",
            serde_json::json!(1u64 << 62),
            "n_head x head_dim",
        ),
        (
            "tiny_llama",
            "intermediate_size",
            serde_json::json!(1u64 << 40),
            "intermediate_size",
        ),
        ("tiny_gpt2", "n_embd", serde_json::json!(0), "n_embd"),
        (
            "tiny_gpt2",
            "n_layer",
            serde_json::json!(1u64 << 50),
            "n_layer",
        ),
    ];
    for (i, (fixture, key, value, named)) in cases.into_iter().enumerate() {
        let src = p04_transformer::fixtures_dir().join(fixture);
        let dir = std::env::temp_dir().join(format!("p04-hostile-{}-{i}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
        let mut cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap())
                .unwrap();
        cfg[key] = value;
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        let e = p04_transformer::model::Transformer::load(&dir).unwrap_err();
        assert!(
            matches!(e, ModelError::Config { .. }) && e.to_string().contains(named),
            "{fixture} {key}: {e}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// The public entry points refuse an empty input with a typed error (they
/// underflowed `t - 1` or `numel - vocab` before).
#[test]
fn empty_inputs_are_errors_not_panics() {
    let model = p04_transformer::model::Transformer::load(
        &p04_transformer::fixtures_dir().join("tiny_llama"),
    )
    .unwrap()
    .model;
    assert!(matches!(
        p04_transformer::trace::causality(&model, &[]),
        Err(ModelError::EmptyInput { .. })
    ));
    assert!(p04_transformer::trace::causality(&model, &[3]).is_ok());
    assert!(matches!(
        p04_transformer::generate::greedy(&model, &[], 3, None, |_| {}),
        Err(ModelError::EmptyInput { .. })
    ));
    assert!(matches!(
        p04_transformer::generate::greedy(&model, &[1], usize::MAX, None, |_| {}),
        Err(ModelError::Context {
            len: usize::MAX,
            ..
        })
    ));
}
