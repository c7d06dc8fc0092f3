//! The generation loop later crates share: prefill, then sample → decode
//! until a stop token, a stop string or the token budget; text is streamed as
//! it becomes whole UTF-8 and never includes a stop string, even one split
//! across tokens.

use std::time::Instant;

use common::Model;
use p04_transformer::Tokenizer;
use thiserror::Error;

use crate::sampling::{SamplingError, SamplingParams};
pub use crate::sequence::{Sequence, Step};

/// Why generation ended (common's one type; local generation never
/// produces `Abort`, which only a server's cancellation does).
pub use common::Finish;

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

impl GenerateParams {
    /// Greedy and exactly `max_tokens` long (stop tokens ignored): what
    /// parity tests and fixed-length benchmarks run.
    pub fn greedy(max_tokens: usize) -> GenerateParams {
        GenerateParams {
            max_tokens,
            sampling: SamplingParams::greedy(),
            stop_ids: vec![],
            stop_strings: vec![],
            ignore_eos: true,
            min_tokens: 0,
            logprobs: None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub text: String,
    pub tokens: Vec<u32>,
    pub finish: Finish,
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

/// A generation driven one token at a time, so a server can stream each
/// step, watch for a client that left, and drop the cache at once: a
/// [`Sequence`] (the per-request state) with a model, its cache and a
/// logits row: a batch of one. [`generate`] is the same loop run to the end.
#[derive(Debug)]
pub struct Generator<'a, M: Model> {
    model: &'a M,
    tok: &'a Tokenizer,
    seq: Sequence,
    /// (vocab_size) logits for the next position.
    logits: Vec<f32>,
    cache: M::Cache,
    /// Whether `logits` are for the next position (after prefill, or after
    /// the last sampled token was fed). The sampled token is fed at the
    /// start of the next step, so each token is handed out as soon as it is
    /// sampled (a server streams it one decode step earlier).
    fresh: bool,
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
        let seq = Sequence::new(model.info(), prompt, params)?;
        let t0 = Instant::now();
        let (logits, cache) = model
            .prefill(prompt, prompt.len() + params.max_tokens)
            .map_err(GenerateError::Model)?;
        Ok(Generator {
            model,
            tok,
            seq,
            logits,
            cache,
            fresh: true,
            prefill_seconds: t0.elapsed().as_secs_f64(),
        })
    }

    pub fn prompt_tokens(&self) -> usize {
        self.seq.prompt_tokens()
    }

    /// Tokens sampled so far (a stop token is not counted).
    pub fn generated_tokens(&self) -> usize {
        self.seq.generated_tokens()
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
        if self.seq.is_finished() {
            return Ok(None);
        }
        if !self.fresh {
            if let Some(prev) = self.seq.next_input() {
                self.model
                    .decode(prev, &mut self.cache, &mut self.logits)
                    .map_err(GenerateError::Model)?;
            }
        }
        self.fresh = false;
        Ok(Some(self.seq.on_logits(&mut self.logits, self.tok)))
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
    let mut finish = Finish::Length;
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
    use super::log_probs;

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
}
