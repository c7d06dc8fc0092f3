//! Run-to-run spread: the same measurement repeated as independent runs
//! (each with its own warm-up), and how far their medians disagree. A
//! characterisation is only as good as its repeatability; the suite asks
//! for under 3%.

use serde::Serialize;

/// The spread of one measurement over runs.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct Spread {
    pub name: String,
    /// Each run's median (the measurement's own unit).
    pub runs: Vec<f64>,
    /// (max - min) / median of the runs.
    pub range_over_median: f64,
    /// Sample standard deviation / mean.
    pub cv: f64,
}

impl Spread {
    pub fn of(name: impl Into<String>, runs: Vec<f64>) -> Self {
        let n = runs.len() as f64;
        let mut s = runs.clone();
        s.sort_by(f64::total_cmp);
        let median = common::stats::percentile_sorted(&s, 50.0);
        let (lo, hi) = (
            s.first().copied().unwrap_or(f64::NAN),
            s.last().copied().unwrap_or(f64::NAN),
        );
        let mean = runs.iter().sum::<f64>() / n;
        let var = if runs.len() > 1 {
            runs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
        } else {
            0.0
        };
        Self {
            name: name.into(),
            runs,
            range_over_median: (hi - lo) / median,
            cv: var.sqrt() / mean,
        }
    }

    /// Within the suite's 3% ask.
    pub fn ok(&self) -> bool {
        self.range_over_median < 0.03
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_is_range_over_median_and_cv() {
        let s = Spread::of("x", vec![100.0, 101.0, 99.0, 100.0, 102.0]);
        assert!((s.range_over_median - 0.03).abs() < 1e-12);
        assert!(!s.ok());
        // mean 100.4, sample sd sqrt(5.2 / 4)
        assert!((s.cv - (1.3f64).sqrt() / 100.4).abs() < 1e-12);
        let t = Spread::of("y", vec![1.0, 1.01, 1.0]);
        assert!(t.ok());
        assert_eq!(Spread::of("z", vec![5.0]).cv, 0.0);
    }
}
