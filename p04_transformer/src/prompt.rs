//! Input processing, one place for every front (the p04/p05 CLIs, the
//! servers' engines): the model's chat template, the model file's BOS
//! policy and tokenisation. No HTTP in here.
//!
//! - The chat template is the model's own Jinja template (GGUF
//!   `tokenizer.chat_template`, as transformers' `apply_chat_template` and
//!   llama.cpp render it), with minijinja; ChatML when the file has none.
//! - BOS follows the file (`tokenizer.ggml.add_bos_token`), as llama.cpp and
//!   transformers 5 apply it: SmolLM2's GGUF says false, so its prompts
//!   start with their first text token. (transformers 4.57's GGUF path
//!   prepended `<|im_start|>` regardless; Project 07 dropped that quirk.)

use std::sync::Arc;

use common::openai::ChatEnd;
use minijinja::{context, Environment};
use serde::Serialize;
use thiserror::Error;

use crate::Tokenizer;

/// The ChatML template, for models whose file carries none.
pub const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Why a prompt could not be built; `param` names the request field at fault.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PromptError {
    #[error("`messages` must not be empty")]
    NoMessages,
    #[error("role `{role}` is not supported; use system, user or assistant")]
    Role { index: usize, role: String },
    #[error("the model's chat template does not compile: {0}")]
    Compile(String),
    #[error("the chat template rejected the messages: {0}")]
    Render(String),
    #[error("continue_final_message: {0}")]
    ContinueFinal(String),
}

impl PromptError {
    /// The request field the error is about, OpenAI style.
    pub fn param(&self) -> Option<String> {
        match self {
            PromptError::NoMessages | PromptError::ContinueFinal(_) => Some("messages".into()),
            PromptError::Role { index, .. } => Some(format!("messages[{index}].role")),
            PromptError::Compile(_) | PromptError::Render(_) => None,
        }
    }
}

#[derive(Serialize)]
struct Msg<'a> {
    role: &'a str,
    content: &'a str,
}

/// A tokenizer with its model's chat template and BOS policy.
#[derive(Debug)]
pub struct PromptBuilder {
    tokenizer: Arc<Tokenizer>,
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl PromptBuilder {
    /// The template from the tokenizer's model file (ChatML if it has none).
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<PromptBuilder, PromptError> {
        let source = tokenizer.chat_template.clone();
        PromptBuilder::with_template(tokenizer, source.as_deref())
    }

    /// An explicit template (None: ChatML).
    pub fn with_template(
        tokenizer: Arc<Tokenizer>,
        source: Option<&str>,
    ) -> Result<PromptBuilder, PromptError> {
        let mut env = Environment::new();
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", source.unwrap_or(CHATML).to_string())
            .map_err(|e| PromptError::Compile(e.to_string()))?;
        let token = |id: Option<u32>| id.map(|i| tokenizer.decode(&[i])).unwrap_or_default();
        Ok(PromptBuilder {
            bos_token: token(tokenizer.bos_id),
            eos_token: token(tokenizer.eos_id),
            env,
            tokenizer,
        })
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The prompt text for a conversation of (role, content) turns, ending
    /// with the assistant turn opened. `developer` is read as `system`.
    pub fn chat_text(&self, turns: &[(&str, &str)]) -> Result<String, PromptError> {
        self.chat_text_ending(turns, ChatEnd::Open)
    }

    /// As [`Self::chat_text`], ending as `end` asks. `ContinueFinal` is
    /// transformers' `continue_final_message`: rendered without a
    /// generation prompt, then cut just after the final message's content
    /// (its last occurrence, whitespace-trimmed as transformers finds it),
    /// so that its end-of-turn marker is gone and the model goes on
    /// writing it.
    pub fn chat_text_ending(
        &self,
        turns: &[(&str, &str)],
        end: ChatEnd,
    ) -> Result<String, PromptError> {
        let mut text = self.render(turns, end == ChatEnd::Open)?;
        if end == ChatEnd::ContinueFinal {
            let last = turns.last().map_or("", |t| t.1);
            let stripped = last.trim();
            if stripped.is_empty() {
                return Err(PromptError::ContinueFinal(
                    "the final message is empty: there is nothing to continue".into(),
                ));
            }
            let Some(at) = text.rfind(stripped) else {
                return Err(PromptError::ContinueFinal(
                    "the chat template does not render the final message's content".into(),
                ));
            };
            // The template kept the content's trailing whitespace: keep it.
            let lstripped = last.trim_start();
            let cut = match text[at..].starts_with(lstripped) {
                true => at + lstripped.len(),
                false => at + stripped.len(),
            };
            text.truncate(cut);
        }
        Ok(text)
    }

    fn render(&self, turns: &[(&str, &str)], open: bool) -> Result<String, PromptError> {
        if turns.is_empty() {
            return Err(PromptError::NoMessages);
        }
        let mut msgs = Vec::with_capacity(turns.len());
        for (index, &(role, content)) in turns.iter().enumerate() {
            let role = match role {
                "system" | "user" | "assistant" => role,
                "developer" => "system",
                _ => {
                    return Err(PromptError::Role {
                        index,
                        role: role.to_string(),
                    })
                }
            };
            msgs.push(Msg { role, content });
        }
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| PromptError::Render(e.to_string()))?;
        tmpl.render(context! {
            messages => msgs,
            add_generation_prompt => open,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| PromptError::Render(e.to_string()))
    }

    /// Token ids of a text prompt: BOS first when the model file asks for it.
    pub fn encode_text(&self, text: &str) -> Vec<u32> {
        let t = &self.tokenizer;
        let mut ids: Vec<u32> = Vec::new();
        if t.add_bos {
            ids.extend(t.bos_id);
        }
        ids.extend(t.encode(text));
        ids
    }

    /// Token ids of a conversation (template, then [`Self::encode_text`]).
    pub fn encode_chat(&self, turns: &[(&str, &str)]) -> Result<Vec<u32>, PromptError> {
        self.encode_chat_ending(turns, ChatEnd::Open)
    }

    /// Token ids of a conversation ending as `end` asks.
    pub fn encode_chat_ending(
        &self,
        turns: &[(&str, &str)],
        end: ChatEnd,
    ) -> Result<Vec<u32>, PromptError> {
        Ok(self.encode_text(&self.chat_text_ending(turns, end)?))
    }
}

/// Room left for generation: `max_tokens` (None: up to the context) checked
/// against `prompt_len` and the model's `context`. Err carries the
/// max_tokens that did not fit.
pub fn check_context(
    prompt_len: usize,
    max_tokens: Option<usize>,
    context: usize,
) -> Result<usize, usize> {
    let max_tokens = max_tokens.unwrap_or(context.saturating_sub(prompt_len));
    if max_tokens == 0 || prompt_len.saturating_add(max_tokens) > context {
        return Err(max_tokens);
    }
    Ok(max_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builder(source: Option<&str>) -> PromptBuilder {
        let tok = Tokenizer::from_tokenizer_json(
            &crate::fixtures_dir()
                .join("tiny_bpe")
                .join("tokenizer.json"),
        )
        .unwrap();
        PromptBuilder::with_template(Arc::new(tok), source).unwrap()
    }

    #[test]
    fn chatml_fallback_renders_turns_and_opens_the_assistant() {
        let t = builder(None);
        let s = t
            .chat_text(&[("system", "S"), ("developer", "D"), ("user", "hi")])
            .unwrap();
        assert_eq!(
            s,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>system\nD<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn a_final_message_is_continued_without_its_end_of_turn() {
        let t = builder(None);
        let turns = [("user", "hi"), ("assistant", "Hello, wor")];
        let head = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(
            t.chat_text_ending(&turns, ChatEnd::ContinueFinal).unwrap(),
            format!("{head}Hello, wor")
        );
        assert_eq!(
            t.chat_text_ending(&turns, ChatEnd::Closed).unwrap(),
            format!("{head}Hello, wor<|im_end|>\n")
        );
        // Trailing whitespace the template keeps is kept.
        let turns = [("user", "hi"), ("assistant", "Hello \n")];
        assert_eq!(
            t.chat_text_ending(&turns, ChatEnd::ContinueFinal).unwrap(),
            format!("{head}Hello \n")
        );
        // Cut at the final message, not an earlier equal one.
        let turns = [("user", "Hello"), ("assistant", "Hello")];
        let s = t.chat_text_ending(&turns, ChatEnd::ContinueFinal).unwrap();
        assert_eq!(
            s,
            "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHello"
        );
        let e = t
            .chat_text_ending(
                &[("user", "hi"), ("assistant", " ")],
                ChatEnd::ContinueFinal,
            )
            .unwrap_err();
        assert_eq!(e.param().as_deref(), Some("messages"));
    }

    #[test]
    fn bad_roles_empty_lists_and_bad_templates_name_the_problem() {
        let t = builder(None);
        assert_eq!(
            t.chat_text(&[]).unwrap_err().param().as_deref(),
            Some("messages")
        );
        let e = t.chat_text(&[("user", "a"), ("robot", "b")]).unwrap_err();
        assert_eq!(e.param().as_deref(), Some("messages[1].role"));
        let tok = Arc::new(
            Tokenizer::from_tokenizer_json(
                &crate::fixtures_dir()
                    .join("tiny_bpe")
                    .join("tokenizer.json"),
            )
            .unwrap(),
        );
        assert!(matches!(
            PromptBuilder::with_template(tok, Some("{% for %}")),
            Err(PromptError::Compile(_))
        ));
        let raising = builder(Some("{{ raise_exception('no system turns') }}"));
        assert!(
            matches!(raising.chat_text(&[("user", "a")]), Err(PromptError::Render(m)) if m.contains("no system turns"))
        );
    }

    #[test]
    fn context_check_fills_the_room_or_refuses() {
        assert_eq!(check_context(10, None, 64), Ok(54));
        assert_eq!(check_context(10, Some(54), 64), Ok(54));
        assert_eq!(check_context(10, Some(55), 64), Err(55));
        assert_eq!(check_context(64, None, 64), Err(0));
    }
}
