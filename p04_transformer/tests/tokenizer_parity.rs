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
        // Byte-level BPE is lossless: decoding gives the text back exactly.
        // (transformers' own decode differs on a few strings: it applies
        // clean_up_tokenization_spaces, turning " ," into ",".)
        assert_eq!(tok.decode(&want), s, "decode of {s:?}");
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
    let prompts = meta["prompts"].as_array().unwrap();
    assert_eq!(prompts.len(), 5);
    for (i, p) in prompts.iter().enumerate() {
        let text = p["text"].as_str().unwrap();
        // transformers' GGUF conversion prepends <|im_start|> (its BOS) although
        // the file says add_bos_token = false; the fixture ids carry it.
        let mut ids = vec![tok.bos_id.unwrap()];
        ids.extend(tok.encode(text));
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
            clean_up(&tok.decode(&greedy)),
            p["greedy_text"].as_str().unwrap(),
            "prompt {i} continuation"
        );
    }
    let chat = tok.chat_prompt(&[("user", "What is the capital of France?")]);
    assert_eq!(
        chat,
        prompts[4]["text"].as_str().unwrap(),
        "ChatML template with the default system prompt"
    );
}

/// transformers' `clean_up_tokenization` (applied by its decode by default).
fn clean_up(s: &str) -> String {
    [
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ]
    .iter()
    .fold(s.to_string(), |acc, (from, to)| acc.replace(from, to))
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
