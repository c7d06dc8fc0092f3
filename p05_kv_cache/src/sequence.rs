//! Per-request state, apart from any model or cache: the token history, the
//! sampler, the stop ids and strings, the UTF-8 decoder, log-probabilities
//! and the finish logic. An engine's loop reads schedule → run one batched
//! step → `on_logits(row)` for each sequence (nano-vllm's `step()`); p05's
//! [`crate::generate::Generator`] is the same with a batch of one.

use common::ModelInfo;
use p04_transformer::generate::Utf8Stream;
use p04_transformer::Tokenizer;

use crate::generate::{log_probs, Finish, GenerateError, GenerateParams};
use crate::sampling::{Sampler, SamplerState};

/// One sampled token, as [`Sequence::on_logits`] (and `Generator::next_token`) hands it out.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub token: u32,
    /// Text that became final with this token (may be empty: an unfinished
    /// UTF-8 character, or text held back while it could be a stop string).
    pub text: String,
    /// log p(token) under the model's distribution (raw logits, before
    /// penalties and temperature), when logprobs were asked for.
    pub logprob: Option<f32>,
    /// The `top_logprobs` most likely tokens and their log p, most likely first.
    pub top_logprobs: Vec<(u32, f32)>,
    /// Set on the last step; `text` then includes any held-back text.
    pub finish: Option<Finish>,
}

/// One request's generation state. It owns no K/V and no scratch: those
/// belong to the K/V store and the engine's workspace.
#[derive(Debug)]
pub struct Sequence {
    params: GenerateParams,
    sampler: Sampler,
    stop_ids: Vec<u32>,
    /// Prompt and generated tokens (the repetition penalty reads it).
    history: Vec<u32>,
    prompt_tokens: usize,
    generated: usize,
    utf8: Utf8Stream,
    stops: StopFilter,
    finish: Option<Finish>,
}

impl Sequence {
    /// Check the request against the model's context and the sampling
    /// settings. `max_tokens == 0` starts finished.
    pub fn new<E: std::error::Error + 'static>(
        info: &ModelInfo,
        prompt: &[u32],
        params: &GenerateParams,
    ) -> Result<Sequence, GenerateError<E>> {
        let context = info.context_length;
        if prompt.len().saturating_add(params.max_tokens) > context {
            return Err(GenerateError::Context {
                prompt: prompt.len(),
                max_tokens: params.max_tokens,
                context,
            });
        }
        let sampler = Sampler::new(params.sampling.clone())?;
        let stop_ids: Vec<u32> = if params.ignore_eos {
            params.stop_ids.clone()
        } else {
            info.stop_ids
                .iter()
                .chain(&params.stop_ids)
                .copied()
                .collect()
        };
        Ok(Sequence {
            params: params.clone(),
            sampler,
            stop_ids,
            history: prompt.to_vec(),
            prompt_tokens: prompt.len(),
            generated: 0,
            utf8: Utf8Stream::default(),
            stops: StopFilter::default(),
            finish: (params.max_tokens == 0).then_some(Finish::Length),
        })
    }

    /// A sequence another engine started: `output` are the tokens it
    /// sampled after `prompt` (no stop token among them), `sampler` where
    /// its random stream stands. The text state (UTF-8 bytes of an
    /// unfinished character, text held back as a possible stop string) is
    /// rebuilt by replaying `output`, so the next token's text is what the
    /// first engine would have sent. Finished if `output` already ends it.
    pub fn resume<E: std::error::Error + 'static>(
        info: &ModelInfo,
        prompt: &[u32],
        output: &[u32],
        params: &GenerateParams,
        sampler: SamplerState,
        tok: &Tokenizer,
    ) -> Result<Sequence, GenerateError<E>> {
        let mut seq = Sequence::new(info, prompt, params)?;
        seq.sampler = Sampler::resume(params.sampling.clone(), sampler)?;
        for &t in output {
            if seq.finish.is_some() {
                break;
            }
            seq.accept(t, tok);
        }
        Ok(seq)
    }

    /// Where the sampler's random stream stands.
    pub fn sampler_state(&self) -> SamplerState {
        self.sampler.state()
    }

    /// The tokens sampled after the prompt.
    pub fn output(&self) -> &[u32] {
        &self.history[self.prompt_tokens..]
    }

    pub fn prompt(&self) -> &[u32] {
        &self.history[..self.prompt_tokens]
    }

    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Tokens sampled so far (a stop token is not counted).
    pub fn generated_tokens(&self) -> usize {
        self.generated
    }

    /// Prompt then generated tokens.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    pub fn params(&self) -> &GenerateParams {
        &self.params
    }

    pub fn finish(&self) -> Option<Finish> {
        self.finish
    }

    pub fn is_finished(&self) -> bool {
        self.finish.is_some()
    }

    /// The token the model must see next: the last one sampled (None before
    /// the first sample, and once finished).
    pub fn next_input(&self) -> Option<u32> {
        match self.finish {
            None if self.generated > 0 => self.history.last().copied(),
            _ => None,
        }
    }

    /// Sample the next token from this sequence's row of logits (vocab;
    /// changed in place by penalties and masks) and advance: history, text,
    /// stop ids and strings, `max_tokens`. A stop token finishes the
    /// sequence with a step whose token is the stop id and whose text is
    /// empty (it is not counted or added to the history).
    pub fn on_logits(&mut self, logits: &mut [f32], tok: &Tokenizer) -> Step {
        let (logprob, top_logprobs) = match self.params.logprobs {
            Some(top) => {
                let (lp, top) = log_probs(logits, top);
                (Some(lp), top)
            }
            None => (None, Vec::new()),
        };
        if self.generated < self.params.min_tokens {
            for &id in &self.stop_ids {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        let next = self.sampler.sample(logits, &self.history);
        // An empty row has no token to score (`sample` returns 0 for it).
        let logprob = logprob.and_then(|lp| lp.get(next as usize).copied());
        if self.stop_ids.contains(&next) {
            self.finish = Some(Finish::Stop);
            return Step {
                token: next,
                text: String::new(),
                logprob,
                top_logprobs,
                finish: self.finish,
            };
        }
        let text = self.accept(next, tok);
        Step {
            token: next,
            text,
            logprob,
            top_logprobs,
            finish: self.finish,
        }
    }

    /// Take `next` (not a stop id) as the next output token: history, text
    /// (returned: what became final), stop strings, `max_tokens`.
    fn accept(&mut self, next: u32, tok: &Tokenizer) -> String {
        self.generated += 1;
        self.history.push(next);
        let piece = self.utf8.push(&tok.decode_bytes(&[next]));
        let (mut text, hit) = self.stops.push(&piece, &self.params.stop_strings);
        self.finish = if hit {
            Some(Finish::Stop)
        } else if self.generated == self.params.max_tokens {
            text.push_str(&self.stops.flush());
            Some(Finish::Length)
        } else {
            None
        };
        text
    }
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
