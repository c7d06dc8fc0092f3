//! The chat template: the model's own Jinja template (GGUF
//! `tokenizer.chat_template`, as transformers' `apply_chat_template` and
//! llama.cpp use it), rendered with minijinja; ChatML when the file has none.

use common::openai::{ChatMessage, Content};
use minijinja::{context, Environment};
use serde::Serialize;

use crate::error::ApiError;

#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

#[derive(Serialize)]
struct Msg<'a> {
    role: &'a str,
    content: String,
}

const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

impl ChatTemplate {
    /// `source`: the template text (None → ChatML). A template that does not
    /// compile is an error naming it.
    pub fn new(source: Option<&str>, bos_token: &str, eos_token: &str) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(false);
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
            .map_err(|e| format!("the model's chat template does not compile: {e}"))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The prompt text for `messages`, ending with the assistant turn opened.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, ApiError> {
        if messages.is_empty() {
            return Err(ApiError::invalid(
                "messages",
                "`messages` must not be empty",
            ));
        }
        let mut msgs = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            if !matches!(
                m.role.as_str(),
                "system" | "user" | "assistant" | "developer"
            ) {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    format!(
                        "role `{}` is not supported; use system, user or assistant",
                        m.role
                    ),
                ));
            }
            let content = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => text.push_str(t),
                            _ => {
                                return Err(ApiError::invalid(
                                    &format!("messages[{i}].content[{j}]"),
                                    format!(
                                        "content part of type `{}` is not supported (text only)",
                                        p.kind
                                    ),
                                ))
                            }
                        }
                    }
                    text
                }
            };
            let role = if m.role == "developer" {
                "system"
            } else {
                &m.role
            };
            msgs.push(Msg { role, content });
        }
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ApiError::bad_body(e.to_string()))?;
        tmpl.render(context! {
            messages => msgs,
            add_generation_prompt => true,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| ApiError::bad_body(format!("the chat template rejected the messages: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, text: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: Some(Content::Text(text.into())),
        }
    }

    #[test]
    fn chatml_fallback_renders_turns_and_opens_the_assistant() {
        let t = ChatTemplate::new(None, "", "").unwrap();
        let s = t.render(&[msg("system", "S"), msg("user", "hi")]).unwrap();
        assert_eq!(
            s,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn bad_roles_parts_and_empty_lists_name_the_field() {
        let t = ChatTemplate::new(None, "", "").unwrap();
        assert_eq!(
            t.render(&[]).unwrap_err().param.as_deref(),
            Some("messages")
        );
        let e = t
            .render(&[msg("user", "a"), msg("robot", "b")])
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1].role"));
        assert!(ChatTemplate::new(Some("{% for %}"), "", "").is_err());
    }
}
