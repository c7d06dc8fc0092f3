//! Sampling settings, one type from the request to the sampler: what an
//! OpenAI request carries (`temperature`, `top_p`, ...), range-checked in
//! one place. Project 05's `Sampler` applies them; servers fill them from
//! the request body.

use thiserror::Error;

/// A setting out of range; [`SamplingError::param`] names the request field.
#[derive(Clone, Debug, Error, PartialEq)]
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

/// Per-request sampling settings. `Default` is the OpenAI API's
/// (temperature 1, everything else off); [`SamplingParams::greedy`] is
/// temperature 0, what local generation and parity tests use.
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
    /// None: the engine picks one (a server counts them up per request).
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            ..SamplingParams::greedy()
        }
    }
}

impl SamplingParams {
    /// Temperature 0: always the argmax (penalties still apply).
    pub fn greedy() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: None,
        }
    }

    /// The parameters of choice `i` of a request with `n` > 1: choice 0
    /// samples as asked, choice i > 0 with seed + i (its own stream of
    /// draws). Every engine that answers `n` > 1 seeds its choices so.
    pub fn of_choice(&self, i: u64) -> SamplingParams {
        let mut p = self.clone();
        if i > 0 {
            p.seed = Some(self.seed.unwrap_or(0).wrapping_add(i));
        }
        p
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_apis_and_every_error_names_its_field() {
        assert_eq!(SamplingParams::default().temperature, 1.0);
        assert_eq!(SamplingParams::greedy().temperature, 0.0);
        assert!(SamplingParams::default().validate().is_ok());
        let bad = |p: SamplingParams| p.validate().unwrap_err().param();
        let g = SamplingParams::greedy;
        assert_eq!(
            bad(SamplingParams {
                temperature: f32::NAN,
                ..g()
            }),
            "temperature"
        );
        assert_eq!(bad(SamplingParams { top_p: 0.0, ..g() }), "top_p");
        assert_eq!(
            bad(SamplingParams {
                top_k: Some(0),
                ..g()
            }),
            "top_k"
        );
        assert_eq!(bad(SamplingParams { min_p: 1.5, ..g() }), "min_p");
        assert_eq!(
            bad(SamplingParams {
                repetition_penalty: 0.0,
                ..g()
            }),
            "repetition_penalty"
        );
    }
}
