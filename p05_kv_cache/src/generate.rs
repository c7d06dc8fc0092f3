//! The generation loop later crates share: prefill, then sample → decode
//! until a stop token, a stop string or the token budget; text is streamed as
//! it becomes whole UTF-8 and never includes a stop string, even one split
//! across tokens.

use std::time::Instant;

use common::Model;
use p04_transformer::generate::Utf8Stream;
use p04_transformer::Tokenizer;
use thiserror::Error;

use crate::sampling::{Sampler, SamplingError, SamplingParams};

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

#[derive(Clone, Debug)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Extra stop token ids (the model's own stop ids always apply).
    pub stop_ids: Vec<u32>,
    pub stop_strings: Vec<String>,
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub text: String,
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
}

impl Generation {
    pub fn prefill_tok_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_seconds.max(1e-12)
    }

    /// Decode speed over the tokens after the first (the first comes from prefill).
    pub fn decode_tok_per_s(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_seconds.max(1e-12)
    }
}

#[derive(Debug, Error)]
pub enum GenerateError<E: std::error::Error + 'static> {
    #[error(
        "prompt of {prompt} tokens plus max_tokens {max_tokens} exceeds the context of {context}"
    )]
    Context {
        prompt: usize,
        max_tokens: usize,
        context: usize,
    },
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Model(E),
}

/// Holds back text that could still become a stop string.
#[derive(Debug, Default)]
struct StopFilter {
    pending: String,
}

impl StopFilter {
    /// Add text; return (text safe to emit, whether a stop string was hit).
    fn push(&mut self, text: &str, stops: &[String]) -> (String, bool) {
        self.pending.push_str(text);
        if let Some(at) = stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Keep back the longest suffix that is a proper prefix of some stop string.
        let keep = stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(move |&i| s.is_char_boundary(i))
                    .map(move |i| &s[..i])
            })
            .filter(|prefix| self.pending.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Generate from `prompt` (token ids), calling `on_text` with each piece of
/// text as it is final.
pub fn generate<M: Model>(
    model: &M,
    tok: &Tokenizer,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_text: impl FnMut(&str),
) -> Result<Generation, GenerateError<M::Error>> {
    let info = model.info();
    let context = info.context_length;
    if prompt.len() + params.max_tokens > context {
        return Err(GenerateError::Context {
            prompt: prompt.len(),
            max_tokens: params.max_tokens,
            context,
        });
    }
    let mut sampler = Sampler::new(params.sampling.clone())?;
    let stop_ids: Vec<u32> = info
        .stop_ids
        .iter()
        .chain(&params.stop_ids)
        .copied()
        .collect();
    let mut history = prompt.to_vec();
    let mut tokens = Vec::new();
    let mut text = String::new();
    let mut utf8 = Utf8Stream::default();
    let mut stops = StopFilter::default();
    let mut finish = FinishReason::Length;

    let t0 = Instant::now();
    let (mut logits, mut cache) = model
        .prefill(prompt, prompt.len() + params.max_tokens)
        .map_err(GenerateError::Model)?;
    let prefill_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for step in 0..params.max_tokens {
        let next = sampler.sample(&mut logits, &history);
        if stop_ids.contains(&next) {
            finish = FinishReason::Stop;
            break;
        }
        tokens.push(next);
        history.push(next);
        let piece = utf8.push(&tok.decode_bytes(&[next]));
        let (safe, hit) = stops.push(&piece, &params.stop_strings);
        if !safe.is_empty() {
            on_text(&safe);
            text.push_str(&safe);
        }
        if hit {
            finish = FinishReason::Stop;
            break;
        }
        if step + 1 < params.max_tokens {
            model
                .decode(next, &mut cache, &mut logits)
                .map_err(GenerateError::Model)?;
        }
    }
    if finish == FinishReason::Length {
        let rest = stops.flush();
        if !rest.is_empty() {
            on_text(&rest);
            text.push_str(&rest);
        }
    }
    Ok(Generation {
        text,
        tokens,
        finish,
        prompt_tokens: prompt.len(),
        prefill_seconds,
        decode_seconds: t1.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::StopFilter;

    #[test]
    fn stop_string_split_across_pieces_is_caught_and_not_emitted() {
        let stops = vec!["<END>".to_string()];
        let mut f = StopFilter::default();
        let mut out = String::new();
        for piece in ["Hello <", "EN", "D> never"] {
            let (safe, hit) = f.push(piece, &stops);
            out.push_str(&safe);
            if hit {
                assert_eq!(out, "Hello ");
                return;
            }
        }
        panic!("stop string not detected: {out:?}");
    }

    #[test]
    fn text_that_only_looks_like_a_stop_prefix_is_released() {
        let stops = vec!["<END>".to_string()];
        let mut f = StopFilter::default();
        let (a, _) = f.push("a <E", &stops);
        assert_eq!(a, "a ");
        let (b, hit) = f.push("x", &stops);
        assert_eq!((b.as_str(), hit), ("<Ex", false));
    }
}
