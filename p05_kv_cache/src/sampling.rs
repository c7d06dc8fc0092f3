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
//!
//! Only what a filter keeps is sorted: top-p selects a growing top set
//! (64, then 4x) until its mass reaches p; min-p alone keeps the tokens above
//! its floor; with neither, the draw walks the vocabulary unsorted. Sorting
//! all 49,152 of SmolLM2's logits every token cost 2.7 ms, a quarter of a
//! native decode step.

/// The settings (one type from the request to the sampler) live in
/// `common`, so a request and an engine name them the same way.
pub use common::sampling::{SamplingError, SamplingParams};

pub use common::rng::Rng;

/// A sampler for one sequence (holds its generator and a reusable buffer).
#[derive(Debug)]
pub struct Sampler {
    /// Private: validated once in `new`, so `top_k = Some(0)` or a negative
    /// temperature cannot be set afterwards.
    params: SamplingParams,
    rng: Rng,
    /// Draws taken from `rng` so far (its position in the stream).
    draws: u64,
    /// (probability or logit, token), reused across steps.
    cand: Vec<(f32, u32)>,
}

/// Where a sampler is in its random stream: with the same settings, a
/// sampler made from it draws what the original would draw next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SamplerState {
    pub seed: u64,
    pub draws: u64,
}

/// Greedy's choice: common's one `argmax` (first index on ties).
pub use common::argmax;

impl Sampler {
    /// The validated settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    pub fn new(params: SamplingParams) -> Result<Sampler, SamplingError> {
        params.validate()?;
        // No seed: 0 (a server assigns one per request before this).
        let rng = Rng::new(params.seed.unwrap_or(0));
        Ok(Sampler {
            params,
            rng,
            draws: 0,
            cand: Vec::new(),
        })
    }

    /// A sampler that continues from `state` (its seed replaces the
    /// settings' own).
    pub fn resume(params: SamplingParams, state: SamplerState) -> Result<Sampler, SamplingError> {
        let params = SamplingParams {
            seed: Some(state.seed),
            ..params
        };
        let mut s = Sampler::new(params)?;
        s.rng = Rng::at(state.seed, state.draws);
        s.draws = state.draws;
        Ok(s)
    }

    /// Where a sampler with `params` stands once it has sampled `tokens`
    /// tokens from its start: [`Sampler::sample`] takes one draw per token
    /// unless greedy. A worker continuing a request whose tokens another
    /// worker sampled resumes from here (it has the tokens, not the
    /// sampler).
    pub fn state_after(params: &SamplingParams, tokens: usize) -> SamplerState {
        SamplerState {
            seed: params.seed.unwrap_or(0),
            draws: match params.temperature == 0.0 {
                true => 0,
                false => tokens as u64,
            },
        }
    }

    pub fn state(&self) -> SamplerState {
        SamplerState {
            seed: self.params.seed.unwrap_or(0),
            draws: self.draws,
        }
    }

    /// Steps 1 and 3–7: the distribution a draw is made from, as
    /// (probability, token) sorted by probability, summing to 1. Not for greedy.
    pub fn distribution(&mut self, logits: &mut [f32], history: &[u32]) -> &[(f32, u32)] {
        self.filter(logits, history, true);
        &self.cand
    }

    /// The distribution into `self.cand`: sorted when a filter truncated it
    /// (top-p and min-p keep a most-probable prefix); otherwise sorted only
    /// if `sorted` is asked (a draw does not need it, and sorting the whole
    /// vocabulary every token costs milliseconds).
    fn filter(&mut self, logits: &mut [f32], history: &[u32], sorted: bool) {
        let p = &self.params;
        apply_repetition_penalty(logits, history, p.repetition_penalty);
        let inv_t = 1.0 / p.temperature;
        let desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        self.cand.clear();
        self.cand.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (l * inv_t, i as u32)),
        );
        if let Some(k) = p.top_k {
            if k < self.cand.len() {
                self.cand.select_nth_unstable_by(k - 1, desc);
                self.cand.truncate(k);
            }
        }
        // softmax (max-subtracted) over the kept logits, in place, unsorted
        let max = self
            .cand
            .iter()
            .map(|c| c.0)
            .fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f64;
        for c in &mut self.cand {
            c.0 = (c.0 - max).exp();
            sum += f64::from(c.0);
        }
        for c in &mut self.cand {
            c.0 = (f64::from(c.0) / sum) as f32;
        }
        if p.top_p < 1.0 {
            // top-p: the smallest prefix (by probability) whose mass
            // reaches p. Only that prefix needs sorting: select the top 64,
            // then 4x more while their mass falls short (a peaked
            // distribution stops at the first round; a flat one ends in a
            // full sort, the old cost).
            let n = self.cand.len();
            let mut k = 64.min(n);
            let keep = loop {
                if k < n {
                    self.cand.select_nth_unstable_by(k - 1, desc);
                }
                self.cand[..k].sort_unstable_by(desc);
                let mut mass = 0.0f64;
                let hit = self.cand[..k].iter().position(|c| {
                    mass += f64::from(c.0);
                    mass >= f64::from(p.top_p)
                });
                match hit {
                    Some(i) => break i + 1,
                    None if k == n => break n,
                    None => k = (k * 4).min(n),
                }
            };
            self.cand.truncate(keep);
        } else if p.min_p > 0.0 {
            // min-p alone: only tokens above its floor survive; sort those.
            let floor = (1.0 / sum) as f32 * p.min_p; // the top probability is exp(0) / sum
            self.cand.retain(|c| c.0 >= floor);
            self.cand.sort_unstable_by(desc);
        } else if sorted {
            self.cand.sort_unstable_by(desc);
        }
        // min-p: relative to the most probable token (first, when it applies)
        if p.min_p > 0.0 {
            let floor = self.cand.first().map_or(0.0, |c| c.0) * p.min_p;
            let keep = self.cand.iter().take_while(|c| c.0 >= floor).count().max(1);
            self.cand.truncate(keep);
        }
        let total: f64 = self.cand.iter().map(|c| f64::from(c.0)).sum();
        for c in &mut self.cand {
            c.0 = (f64::from(c.0) / total) as f32;
        }
    }

    /// The next token. `logits` is modified (penalties, scaling).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        if self.params.temperature == 0.0 {
            apply_repetition_penalty(logits, history, self.params.repetition_penalty);
            return argmax(logits);
        }
        let u = self.rng.next_f64();
        self.draws += 1;
        // The same distribution as `distribution`; untruncated, it is walked
        // in vocabulary order rather than sorted (same draw probabilities).
        self.filter(logits, history, false);
        let dist = &self.cand;
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
