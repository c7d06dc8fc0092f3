//! Timing and statistics: warm up, run several times, report median / p95 /
//! min / max / mean.

use std::time::{Duration, Instant};

/// Summary of a set of samples (same unit as the samples).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub min: f64,
    pub median: f64,
    pub p95: f64,
    pub max: f64,
    pub mean: f64,
}

/// Percentile by linear interpolation between closest ranks (numpy's default),
/// over already sorted samples. `q` in [0, 100].
pub fn percentile_sorted(sorted: &[f64], q: f64) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        1 => sorted[0],
        n => {
            let pos = (q.clamp(0.0, 100.0) / 100.0) * (n - 1) as f64;
            let lo = pos.floor() as usize;
            let hi = pos.ceil() as usize;
            let frac = pos - lo as f64;
            sorted[lo] + (sorted[hi] - sorted[lo]) * frac
        }
    }
}

/// Summarise samples; NaN for an empty set.
pub fn summarize(samples: &[f64]) -> Summary {
    let mut s: Vec<f64> = samples.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    Summary {
        n,
        min: s.first().copied().unwrap_or(f64::NAN),
        median: percentile_sorted(&s, 50.0),
        p95: percentile_sorted(&s, 95.0),
        max: s.last().copied().unwrap_or(f64::NAN),
        mean: if n == 0 {
            f64::NAN
        } else {
            s.iter().sum::<f64>() / n as f64
        },
    }
}

/// How long to measure.
#[derive(Clone, Copy, Debug)]
pub struct BenchConfig {
    /// Untimed calls before measuring.
    pub warmup_iters: usize,
    /// Minimum timed samples.
    pub min_samples: usize,
    /// Keep sampling until this much time has passed (or `max_samples`).
    pub min_time: Duration,
    pub max_samples: usize,
}

impl Default for BenchConfig {
    fn default() -> Self {
        Self {
            warmup_iters: 10,
            min_samples: 20,
            min_time: Duration::from_millis(300),
            max_samples: 10_000,
        }
    }
}

/// Time `f` per call, in seconds: warm up, then sample until both
/// `min_samples` and `min_time` are reached.
pub fn time_it<F: FnMut()>(cfg: BenchConfig, mut f: F) -> Summary {
    for _ in 0..cfg.warmup_iters {
        f();
    }
    let mut samples = Vec::with_capacity(cfg.min_samples);
    let start = Instant::now();
    while samples.len() < cfg.max_samples
        && (samples.len() < cfg.min_samples || start.elapsed() < cfg.min_time)
    {
        let t = Instant::now();
        f();
        samples.push(t.elapsed().as_secs_f64());
    }
    summarize(&samples)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_match_numpy_linear() {
        // numpy.percentile([1, 2, 3, 4], 95) == 3.85; median 2.5
        let s = summarize(&[4.0, 1.0, 3.0, 2.0]);
        assert_eq!(s.median, 2.5);
        assert!((s.p95 - 3.85).abs() < 1e-12);
        assert_eq!((s.min, s.max, s.mean, s.n), (1.0, 4.0, 2.5, 4));
        assert!(summarize(&[]).median.is_nan());
    }

    #[test]
    fn time_it_takes_enough_samples() {
        let mut calls = 0;
        let cfg = BenchConfig {
            warmup_iters: 3,
            min_samples: 7,
            min_time: Duration::ZERO,
            max_samples: 100,
        };
        let s = time_it(cfg, || calls += 1);
        assert_eq!(s.n, 7);
        assert_eq!(calls, 10);
    }
}
