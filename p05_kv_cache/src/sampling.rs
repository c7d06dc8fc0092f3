//! Choosing the next token from logits, in this order:
//!
//! 1. repetition penalty: each token already in the sequence has its logit
//!    divided by `repetition_penalty` if positive, multiplied if negative (as
//!    transformers does);
//! 2. temperature 0 → greedy: the argmax, nothing below applies;
//! 3. logits / temperature;
//! 4. top-k: keep the k largest;
//! 5. softmax over what is kept;
//! 6. top-p: keep the smallest most-probable set whose mass reaches p;
//! 7. min-p: drop tokens below min_p x the top probability;
//! 8. renormalise and draw with the request's seeded generator.

use thiserror::Error;

#[derive(Debug, Error, PartialEq)]
pub enum SamplingError {
    #[error("temperature must be >= 0 and finite, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("top_k must be >= 1 when set, got 0")]
    TopK,
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
    #[error("repetition_penalty must be > 0 and finite, got {0}")]
    RepetitionPenalty(f32),
}

/// Per-request sampling settings.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    pub top_k: Option<usize>,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    /// 1 = off.
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if self.top_k == Some(0) {
            return Err(SamplingError::TopK);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::MinP(self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(SamplingError::RepetitionPenalty(self.repetition_penalty));
        }
        Ok(())
    }
}

pub use common::rng::Rng;

/// A sampler for one sequence (holds its generator and a reusable buffer).
#[derive(Debug)]
pub struct Sampler {
    /// Private: validated once in `new`, so `top_k = Some(0)` or a negative
    /// temperature cannot be set afterwards.
    params: SamplingParams,
    rng: Rng,
    /// (probability or logit, token), reused across steps.
    cand: Vec<(f32, u32)>,
}

/// Index of the largest value (first on ties).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

impl SamplingError {
    /// The request field at fault (OpenAI's `param`).
    pub fn param(&self) -> &'static str {
        match self {
            SamplingError::Temperature(_) => "temperature",
            SamplingError::TopP(_) => "top_p",
            SamplingError::TopK => "top_k",
            SamplingError::MinP(_) => "min_p",
            SamplingError::RepetitionPenalty(_) => "repetition_penalty",
        }
    }
}

impl Sampler {
    /// The validated settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    pub fn new(params: SamplingParams) -> Result<Sampler, SamplingError> {
        params.validate()?;
        let rng = Rng::new(params.seed);
        Ok(Sampler {
            params,
            rng,
            cand: Vec::new(),
        })
    }

    /// Steps 1 and 3–7: the distribution a draw is made from, as
    /// (probability, token) sorted by probability, summing to 1. Not for greedy.
    pub fn distribution(&mut self, logits: &mut [f32], history: &[u32]) -> &[(f32, u32)] {
        let p = &self.params;
        apply_repetition_penalty(logits, history, p.repetition_penalty);
        let inv_t = 1.0 / p.temperature;
        self.cand.clear();
        self.cand.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (l * inv_t, i as u32)),
        );
        let desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if let Some(k) = p.top_k {
            if k < self.cand.len() {
                self.cand.select_nth_unstable_by(k - 1, desc);
                self.cand.truncate(k);
            }
        }
        self.cand.sort_unstable_by(desc);
        // softmax (max-subtracted) over the kept logits
        let max = self.cand.first().map_or(0.0, |c| c.0);
        let mut sum = 0.0f64;
        for c in &mut self.cand {
            c.0 = (c.0 - max).exp();
            sum += f64::from(c.0);
        }
        for c in &mut self.cand {
            c.0 = (f64::from(c.0) / sum) as f32;
        }
        // top-p: the smallest prefix whose mass reaches p
        if p.top_p < 1.0 {
            let mut mass = 0.0f64;
            let mut keep = self.cand.len();
            for (i, c) in self.cand.iter().enumerate() {
                mass += f64::from(c.0);
                if mass >= f64::from(p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
            self.cand.truncate(keep);
        }
        // min-p: relative to the most probable token
        if p.min_p > 0.0 {
            let floor = self.cand.first().map_or(0.0, |c| c.0) * p.min_p;
            let keep = self.cand.iter().take_while(|c| c.0 >= floor).count().max(1);
            self.cand.truncate(keep);
        }
        let total: f64 = self.cand.iter().map(|c| f64::from(c.0)).sum();
        for c in &mut self.cand {
            c.0 = (f64::from(c.0) / total) as f32;
        }
        &self.cand
    }

    /// The next token. `logits` is modified (penalties, scaling).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        if self.params.temperature == 0.0 {
            apply_repetition_penalty(logits, history, self.params.repetition_penalty);
            return argmax(logits);
        }
        let u = self.rng.next_f64();
        let dist = self.distribution(logits, history);
        let mut acc = 0.0f64;
        for &(p, tok) in dist {
            acc += f64::from(p);
            if u < acc {
                return tok;
            }
        }
        dist.last().map_or(0, |c| c.1)
    }
}

/// Step 1 (transformers' rule): logit / penalty if positive, x penalty if not,
/// once per distinct token in `history` (a bitset over the vocabulary
/// remembers which: linear in the history, not quadratic).
pub fn apply_repetition_penalty(logits: &mut [f32], history: &[u32], penalty: f32) {
    if penalty == 1.0 {
        return;
    }
    let mut seen = vec![0u64; logits.len().div_ceil(64)];
    for &t in history {
        let t = t as usize;
        let (Some(word), Some(l)) = (seen.get_mut(t / 64), logits.get_mut(t)) else {
            continue;
        };
        let bit = 1u64 << (t % 64);
        if *word & bit != 0 {
            continue;
        }
        *word |= bit;
        *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
    }
}
