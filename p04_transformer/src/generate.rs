//! Greedy generation without a KV cache: every step runs the whole sequence
//! through the model again (Project 05 removes exactly this cost).

use std::time::Instant;

use crate::error::ModelError;
use crate::model::{argmax_last, Transformer};

/// What a generation did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GenStats {
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub seconds: f64,
}

impl GenStats {
    pub fn tok_per_s(&self) -> f64 {
        self.new_tokens as f64 / self.seconds.max(1e-12)
    }
}

/// Append up to `n` greedy tokens to `prompt`, calling `on_token` for each;
/// stops early at `stop`. Errors before any work if the result would not fit
/// the context.
pub fn greedy(
    model: &Transformer,
    prompt: &[u32],
    n: usize,
    stop: Option<u32>,
    mut on_token: impl FnMut(u32),
) -> Result<(Vec<u32>, GenStats), ModelError> {
    let ctx = model.context();
    if prompt.is_empty() {
        return Err(ModelError::EmptyInput {
            what: "greedy generation",
        });
    }
    let len = prompt.len().saturating_add(n);
    if len > ctx {
        return Err(ModelError::Context { len, ctx });
    }
    let t0 = Instant::now();
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..n {
        let logits = model.forward(&seq, 1, seq.len())?;
        let next = argmax_last(&logits);
        seq.push(next);
        out.push(next);
        on_token(next);
        if Some(next) == stop {
            break;
        }
    }
    let stats = GenStats {
        prompt_tokens: prompt.len(),
        new_tokens: out.len(),
        seconds: t0.elapsed().as_secs_f64(),
    };
    Ok((out, stats))
}

/// Turns a growing byte stream into text pieces that are always whole UTF-8:
/// bytes of a character split across tokens are held until it completes.
#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Add bytes; return the text that is now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            // An invalid sequence (not just an incomplete tail) is emitted as U+FFFD.
            Err(e) if e.error_len().is_some() => self.pending.len(),
            Err(e) => e.valid_up_to(),
        };
        let text = String::from_utf8_lossy(&self.pending[..valid]).into_owned();
        self.pending.drain(..valid);
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_stream_holds_split_characters() {
        let mut s = Utf8Stream::default();
        let e = "é😀".as_bytes();
        assert_eq!(s.push(&e[..1]), "");
        assert_eq!(s.push(&e[1..3]), "é");
        assert_eq!(s.push(&e[3..5]), "");
        assert_eq!(s.push(&e[5..]), "😀");
        assert_eq!(s.push(&[0xff, b'a']), "\u{fffd}a");
    }
}
