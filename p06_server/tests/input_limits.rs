//! A prompt that cannot fit the context whatever its tokens is refused
//! before tokenizing: every token decodes to at most `max_token_bytes`
//! bytes, so b bytes are at least b / max_token_bytes tokens.

use std::sync::Arc;

use common::engine::{EngineError, PromptInput};
use common::openai::{ChatMessage, Content};
use common::ModelInfo;
use p04_transformer::{GgufFile, Tokenizer};
use p06_server::input::InputProcessor;

fn smollm2_tokenizer() -> Arc<Tokenizer> {
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).unwrap_or_else(|e| panic!("{e}"));
    Arc::new(Tokenizer::from_gguf(&GgufFile::open(&path).unwrap().header).unwrap())
}

#[test]
fn no_token_decodes_to_more_than_max_token_bytes() {
    let tok = smollm2_tokenizer();
    let per = tok.max_token_bytes();
    let longest = (0..tok.vocab_size() as u32)
        .map(|id| tok.decode_bytes(&[id]).len())
        .max()
        .unwrap();
    assert_eq!(longest, per, "the bound is the longest token, exactly");
}

#[test]
fn oversized_prompts_are_refused_before_tokenizing() {
    let tok = smollm2_tokenizer();
    let per = tok.max_token_bytes();
    let info = ModelInfo {
        name: "smollm2".into(),
        vocab_size: tok.vocab_size(),
        context_length: 16,
        bos_id: None,
        stop_ids: vec![],
    };
    let input = InputProcessor::new(tok.clone(), &info).unwrap();
    // 16·per bytes might be 16 tokens, so they go on to the tokenizer (the
    // context check after it gives the exact count); one byte more cannot
    // be fewer than 17 tokens, and is refused without tokenizing.
    assert!(input
        .encode(&PromptInput::Text("a".repeat(16 * per)))
        .is_ok());
    for (what, prompt, param) in [
        (
            "text",
            PromptInput::Text("a".repeat(16 * per + 1)),
            "prompt",
        ),
        ("1 MiB", PromptInput::Text("a".repeat(1 << 20)), "prompt"),
        (
            "chat",
            PromptInput::Chat(vec![ChatMessage {
                role: "user".into(),
                content: Some(Content::Text("a".repeat(16 * per + 1))),
            }]),
            "messages",
        ),
    ] {
        match input.encode(&prompt) {
            Err(EngineError::InvalidRequest { message, param: p }) => {
                assert_eq!(p.as_deref(), Some(param), "{what}");
                assert!(
                    message.contains("context of 16 tokens"),
                    "{what}: {message}"
                );
            }
            other => panic!("{what}: {other:?}"),
        }
    }
}
