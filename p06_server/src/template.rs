//! Chat messages off the wire into (role, text) turns for p04's
//! [`PromptBuilder`](p04_transformer::PromptBuilder), which owns the model's
//! chat template (one for every front). Here only what is OpenAI-specific:
//! content given as a list of parts is joined, and parts that are not text
//! are refused naming the field.

use common::openai::{ChatMessage, Content};
use p04_transformer::PromptError;

use common::engine::EngineError;

/// (role, text) of each message, in order.
pub fn turns(messages: &[ChatMessage]) -> Result<Vec<(&str, String)>, EngineError> {
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let content = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => text.push_str(t),
                        _ => {
                            return Err(EngineError::InvalidRequest {
                                param: Some(format!("messages[{i}].content[{j}]")),
                                message: format!(
                                    "content part of type `{}` is not supported (text only)",
                                    p.kind
                                ),
                            })
                        }
                    }
                }
                text
            }
        };
        out.push((m.role.as_str(), content));
    }
    Ok(out)
}

/// A prompt error as the request's fault (a 400, naming the field when
/// there is one).
pub fn prompt_error(e: PromptError) -> EngineError {
    EngineError::InvalidRequest {
        message: e.to_string(),
        param: e.param(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::openai::ContentPart;

    #[test]
    fn text_parts_are_joined_and_other_parts_name_the_field() {
        let text = |t: &str| ContentPart {
            kind: "text".into(),
            text: Some(t.into()),
        };
        let m = ChatMessage {
            role: "user".into(),
            content: Some(Content::Parts(vec![text("a"), text("b")])),
        };
        assert_eq!(turns(&[m]).unwrap(), vec![("user", "ab".to_string())]);
        let image = ChatMessage {
            role: "user".into(),
            content: Some(Content::Parts(vec![
                text("a"),
                ContentPart {
                    kind: "image_url".into(),
                    text: None,
                },
            ])),
        };
        let e = turns(&[image]).unwrap_err();
        assert!(
            matches!(&e, EngineError::InvalidRequest { param: Some(p), .. } if p == "messages[0].content[1]"),
            "{e:?}"
        );
    }
}
