//! A small seeded random generator: the same seed gives the same draws, on
//! every machine (sampling in p05, arrival times in the load generator).

/// SplitMix64's increment (2^64 / φ, odd).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64: a small, well-mixed generator; the same seed gives the same draws.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The generator of `seed` after `draws` draws of [`Rng::next_u64`]
    /// (SplitMix64's state is a counter, so this is one multiply): how a
    /// sequence continues its random stream on another engine.
    pub fn at(seed: u64, draws: u64) -> Rng {
        Rng(seed.wrapping_add(draws.wrapping_mul(GOLDEN)))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [0, 1), 24 bits (every value exactly representable).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in 0..n (n > 0; 0 for n = 0), by multiply-shift.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

impl Rng {
    /// Exponentially distributed with the given rate (Poisson inter-arrival times).
    pub fn next_exp(&mut self, rate: f64) -> f64 {
        -(1.0 - self.next_f64()).ln() / rate
    }
}
