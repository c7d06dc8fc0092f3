//! The BPE tokenizer built from SmolLM2's GGUF metadata against transformers'
//! tokenizer on 240 varied strings (ASCII, accents, scripts, CJK, emoji,
//! digits, whitespace runs, code, special tokens): identical ids, and decode
//! returns the original text.

use p04_transformer::{GgufFile, Tokenizer};
use serde_json::Value;

#[test]
fn corpus_matches_transformers_exactly() {
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).unwrap_or_else(|e| panic!("{e}"));
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap().header).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    let text =
        std::fs::read_to_string(p04_transformer::fixtures_dir().join("tokenizer_corpus.json"))
            .unwrap();
    let corpus: Value = serde_json::from_str(&text).unwrap();
    let cases = corpus["cases"].as_array().unwrap();
    assert!(cases.len() >= 200);
    let mut bad = Vec::new();
    for c in cases {
        let s = c["text"].as_str().unwrap();
        let want: Vec<u32> = c["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = tok.encode(s);
        if got != want {
            bad.push(format!("{s:?}: got {got:?}, transformers {want:?}"));
        }
        // Byte-level BPE is lossless: decoding gives the text back exactly,
        // as transformers 5's decode does (4.57's applied
        // clean_up_tokenization_spaces, turning " ," into ",").
        assert_eq!(tok.decode(&want), s, "decode of {s:?}");
        assert_eq!(
            tok.decode(&want),
            c["decoded"].as_str().unwrap(),
            "transformers' decode of {s:?}"
        );
    }
    assert!(
        bad.is_empty(),
        "{} of {} differ:\n{}",
        bad.len(),
        cases.len(),
        bad.join("\n")
    );
    assert_eq!((tok.bos_id, tok.eos_id), (Some(1), Some(2)));
}

#[test]
fn prompts_and_chat_template_give_the_parity_fixture_ids() {
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).unwrap_or_else(|e| panic!("{e}"));
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap().header).unwrap();
    let dir = p04_transformer::fixtures_dir();
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("smollm2_parity.json")).unwrap())
            .unwrap();
    let fx = common::st::load(&dir.join("smollm2_parity.safetensors")).unwrap();
    let texts = meta["prompts"].as_array().unwrap();
    assert_eq!(texts.len(), 5);
    let prompts = p04_transformer::PromptBuilder::new(std::sync::Arc::new(tok)).unwrap();
    let tok = prompts.tokenizer();
    for (i, p) in texts.iter().enumerate() {
        let text = p["text"].as_str().unwrap();
        // The file's BOS policy (add_bos_token = false), as transformers 5
        // applies it: no BOS in front.
        let ids = prompts.encode_text(text);
        let want: Vec<u32> = fx
            .ints(&format!("p{i}/ids"))
            .unwrap()
            .1
            .iter()
            .map(|&v| v as u32)
            .collect();
        assert_eq!(ids, want, "prompt {i} {text:?}");
        let greedy: Vec<u32> = fx
            .ints(&format!("p{i}/greedy"))
            .unwrap()
            .1
            .iter()
            .map(|&v| v as u32)
            .collect();
        assert_eq!(
            tok.decode(&greedy),
            p["greedy_text"].as_str().unwrap(),
            "prompt {i} continuation"
        );
    }
    // The GGUF's own Jinja template, rendered by minijinja, equals
    // transformers' apply_chat_template: the single-turn parity prompt and
    // multi-turn conversations, with and without a system turn.
    let chat = prompts
        .chat_text(&[("user", "What is the capital of France?")])
        .unwrap();
    assert_eq!(chat, texts[4]["text"].as_str().unwrap(), "single turn");
    let convs = meta["chat_templates"].as_array().unwrap();
    assert!(convs.len() >= 2);
    for c in convs {
        let turns: Vec<(&str, &str)> = c["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        assert_eq!(
            prompts.chat_text(&turns).unwrap(),
            c["text"].as_str().unwrap(),
            "{turns:?}"
        );
    }
    // The BOS policy on a plain prompt, against transformers' own ids.
    let hello: Vec<u32> = serde_json::from_value(meta["bos_policy"]["ids"].clone()).unwrap();
    assert_eq!(
        prompts.encode_text(meta["bos_policy"]["text"].as_str().unwrap()),
        hello
    );
}

#[test]
fn tokenizer_json_from_hf_tokenizers_matches_transformers() {
    let dir = p04_transformer::fixtures_dir().join("tiny_bpe");
    let tok = Tokenizer::from_tokenizer_json(&dir.join("tokenizer.json")).unwrap();
    let corpus: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_corpus.json")).unwrap())
            .unwrap();
    let cases = corpus["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for c in cases {
        let s = c["text"].as_str().unwrap();
        let want: Vec<u32> = c["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tok.encode(s), want, "{s:?}");
        assert_eq!(tok.decode(&want), s);
    }
    // A config this loader does not handle is a clear error, not a wrong tokenizer.
    let tmp = std::env::temp_dir().join(format!("p04-tok-{}.json", std::process::id()));
    let mut j: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap())
            .unwrap();
    j["pre_tokenizer"]["add_prefix_space"] = Value::Bool(true);
    std::fs::write(&tmp, j.to_string()).unwrap();
    let e = Tokenizer::from_tokenizer_json(&tmp)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("pre_tokenizer") && e.contains("not supported"),
        "{e}"
    );
    std::fs::remove_file(&tmp).ok();
}

/// The linear-time encoder (one scan for specials, heap merges) against
/// the naive one (a search per special after each split, the O(n²) merge
/// loop) on SmolLM2's vocabulary: the corpus, long runs of one letter (the
/// hostile prompt), runs of digits, spaces and a two-byte letter, specials
/// back to back and inside near-misses. The corpus itself is checked
/// against transformers above.
#[test]
fn fast_encode_equals_the_naive_reference() {
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).unwrap_or_else(|e| panic!("{e}"));
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap().header).unwrap();
    let corpus: Value = serde_json::from_str(
        &std::fs::read_to_string(p04_transformer::fixtures_dir().join("tokenizer_corpus.json"))
            .unwrap(),
    )
    .unwrap();
    let mut texts: Vec<String> = corpus["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect();
    for n in [1, 2, 3, 17, 255, 2000] {
        texts.push("a".repeat(n));
        texts.push(format!(" {}", "ab".repeat(n)));
        texts.push("1".repeat(n));
        texts.push(" ".repeat(n) + "x");
        texts.push("é".repeat(n));
    }
    texts.push("<|im_start|><|im_end|><|im_start|>user\nhi<|im_end|>".into());
    texts.push("<|im_start<|im_start|>|>endoftext<|endoftext|>x".into());
    assert!(texts.len() > 240);
    for t in &texts {
        assert_eq!(tok.encode(t), tok.encode_naive(t), "{t:?}");
    }
}
