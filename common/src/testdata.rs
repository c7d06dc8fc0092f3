//! Deterministic pseudo-random data for tests and benchmarks, drawn from
//! the workspace's one generator ([`crate::rng::Rng`], SplitMix64), so no
//! test depends on a random-number crate or on the run.

use crate::rng::Rng;

/// `n` values uniform in [-1, 1), the same for the same `seed`.
pub fn uniform(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.next_f32() * 2.0 - 1.0).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn deterministic_and_in_range() {
        let a = super::uniform(1000, 7);
        assert_eq!(a, super::uniform(1000, 7));
        assert_ne!(a, super::uniform(1000, 8));
        assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
        let mean = a.iter().sum::<f32>() / 1000.0;
        assert!(mean.abs() < 0.1, "mean {mean}");
    }
}
