//! Deterministic pseudo-random data for tests and benchmarks (xorshift64),
//! so no test depends on a random-number crate or on the run.

/// `n` values uniform in [-1, 1), the same for the same `seed`.
pub fn uniform(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
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
