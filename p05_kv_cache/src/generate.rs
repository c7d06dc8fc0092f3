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
    /// Keep going past the model's own stop tokens (fixed-length benchmarks).
    pub ignore_eos: bool,
    /// No stop token may be sampled before this many tokens (vLLM's
    /// `min_tokens`: their logits are set to -inf until then). 0 = off.
    pub min_tokens: usize,
    /// Report log p of each sampled token and this many top alternatives.
    pub logprobs: Option<usize>,
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

/// One sampled token, as [`Generator::next_token`] hands it out.
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
    pub finish: Option<FinishReason>,
}

/// A generation driven one token at a time, so a server can stream each
/// step, watch for a client that left, and drop the cache at once.
/// [`generate`] is the same loop run to the end.
#[derive(Debug)]
pub struct Generator<'a, M: Model> {
    model: &'a M,
    tok: &'a Tokenizer,
    params: GenerateParams,
    sampler: Sampler,
    stop_ids: Vec<u32>,
    /// Prompt and generated tokens (the repetition penalty reads it).
    history: Vec<u32>,
    prompt_tokens: usize,
    generated: usize,
    /// (vocab_size) logits for the next position.
    logits: Vec<f32>,
    cache: M::Cache,
    utf8: Utf8Stream,
    stops: StopFilter,
    /// The last sampled token, not yet run through the model: it is fed at
    /// the start of the next step, so each token is handed out as soon as
    /// it is sampled (a server streams it one decode step earlier).
    pending: Option<u32>,
    done: bool,
    prefill_seconds: f64,
}

impl<'a, M: Model> Generator<'a, M> {
    /// Check the request against the context, then prefill the prompt.
    pub fn start(
        model: &'a M,
        tok: &'a Tokenizer,
        prompt: &[u32],
        params: &GenerateParams,
    ) -> Result<Self, GenerateError<M::Error>> {
        let info = model.info();
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
        let t0 = Instant::now();
        let (logits, cache) = model
            .prefill(prompt, prompt.len() + params.max_tokens)
            .map_err(GenerateError::Model)?;
        Ok(Generator {
            model,
            tok,
            params: params.clone(),
            sampler,
            stop_ids,
            history: prompt.to_vec(),
            prompt_tokens: prompt.len(),
            generated: 0,
            logits,
            cache,
            utf8: Utf8Stream::default(),
            stops: StopFilter::default(),
            pending: None,
            done: params.max_tokens == 0,
            prefill_seconds: t0.elapsed().as_secs_f64(),
        })
    }

    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Tokens sampled so far (a stop token is not counted).
    pub fn generated_tokens(&self) -> usize {
        self.generated
    }

    pub fn prefill_seconds(&self) -> f64 {
        self.prefill_seconds
    }

    /// K/V memory this generation holds (freed when it is dropped).
    pub fn cache_bytes(&self) -> usize {
        self.model.cache_bytes(&self.cache)
    }

    /// Run the previous token through the model (one decode step), then
    /// sample the next. `None` once finished. A stop token ends the
    /// generation with a step whose token is the stop id and whose text is empty.
    pub fn next_token(&mut self) -> Result<Option<Step>, GenerateError<M::Error>> {
        if self.done {
            return Ok(None);
        }
        if let Some(prev) = self.pending.take() {
            self.model
                .decode(prev, &mut self.cache, &mut self.logits)
                .map_err(GenerateError::Model)?;
        }
        let (logprob, top_logprobs) = match self.params.logprobs {
            Some(top) => {
                let (lp, top) = log_probs(&self.logits, top);
                (Some(lp), top)
            }
            None => (None, Vec::new()),
        };
        if self.generated < self.params.min_tokens {
            for &id in &self.stop_ids {
                if let Some(l) = self.logits.get_mut(id as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        let next = self.sampler.sample(&mut self.logits, &self.history);
        let logprob = logprob.map(|lp| lp[next as usize]);
        if self.stop_ids.contains(&next) {
            self.done = true;
            return Ok(Some(Step {
                token: next,
                text: String::new(),
                logprob,
                top_logprobs,
                finish: Some(FinishReason::Stop),
            }));
        }
        self.generated += 1;
        self.history.push(next);
        let piece = self.utf8.push(&self.tok.decode_bytes(&[next]));
        let (mut text, hit) = self.stops.push(&piece, &self.params.stop_strings);
        let finish = if hit {
            Some(FinishReason::Stop)
        } else if self.generated == self.params.max_tokens {
            text.push_str(&self.stops.flush());
            Some(FinishReason::Length)
        } else {
            self.pending = Some(next);
            None
        };
        self.done = finish.is_some();
        Ok(Some(Step {
            token: next,
            text,
            logprob,
            top_logprobs,
            finish,
        }))
    }
}

/// log-softmax of `logits` (vocab) and its `top` largest entries, most likely first.
pub fn log_probs(logits: &[f32], top: usize) -> (Vec<f32>, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let log_z = max + sum.ln() as f32;
    let lp: Vec<f32> = logits.iter().map(|&l| l - log_z).collect();
    let mut idx: Vec<u32> = (0..lp.len() as u32).collect();
    let desc = |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]).then(a.cmp(b));
    let top = top.min(idx.len());
    if top > 0 && top < idx.len() {
        idx.select_nth_unstable_by(top - 1, desc);
    }
    idx.truncate(top);
    idx.sort_unstable_by(desc);
    let top = idx.into_iter().map(|i| (i, lp[i as usize])).collect();
    (lp, top)
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
    let mut g = Generator::start(model, tok, prompt, params)?;
    let t1 = Instant::now();
    let mut tokens = Vec::new();
    let mut text = String::new();
    let mut finish = FinishReason::Length;
    while let Some(step) = g.next_token()? {
        if !step.text.is_empty() {
            on_text(&step.text);
            text.push_str(&step.text);
        }
        // A stop token ends the generation but is not part of the output.
        if g.generated_tokens() > tokens.len() {
            tokens.push(step.token);
        }
        if let Some(f) = step.finish {
            finish = f;
        }
    }
    Ok(Generation {
        text,
        tokens,
        finish,
        prompt_tokens: prompt.len(),
        prefill_seconds: g.prefill_seconds(),
        decode_seconds: t1.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::{log_probs, StopFilter};

    #[test]
    fn log_probs_match_a_naive_f64_log_softmax() {
        let logits: Vec<f32> = common::testdata::uniform(1000, 7)
            .iter()
            .map(|v| v * 30.0)
            .collect();
        let (lp, top) = log_probs(&logits, 5);
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        for (i, &l) in logits.iter().enumerate() {
            let want = f64::from(l) - z.ln();
            assert!(
                (f64::from(lp[i]) - want).abs() < 1e-4,
                "{i}: {} vs {want}",
                lp[i]
            );
        }
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let want: Vec<u32> = order[..5].iter().map(|&i| i as u32).collect();
        let got: Vec<u32> = top.iter().map(|t| t.0).collect();
        assert_eq!(got, want);
        assert_eq!(log_probs(&logits, 5000).1.len(), 1000);
    }

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
