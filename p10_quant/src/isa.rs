//! Which instruction set the kernels use, detected at run time.
//!
//! `INFERENCE_LAB_ISA=scalar|avx2` caps the choice (an AVX2 machine can run
//! and test the portable path; an AVX-512 machine, once there is an
//! AVX-512 path, the AVX2 one). The chosen path is named in numbers.md's
//! machine column by the benches and printed by `p10_quant isa`.

use std::fmt;

/// Kernel paths, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Portable Rust: the reference every other path is tested against.
    Scalar,
    /// AVX2 + FMA + F16C: 256-bit integer dot products (`maddubs`/`madd`).
    Avx2,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
        }
    }

    /// Paths this CPU can run, narrowest first.
    pub fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            v.push(Isa::Avx2);
        }
        v
    }

    /// The widest available path, capped by `INFERENCE_LAB_ISA`.
    pub fn detect() -> Isa {
        let best = Isa::available().into_iter().max().unwrap_or(Isa::Scalar);
        match std::env::var("INFERENCE_LAB_ISA").ok().as_deref() {
            Some("scalar") => Isa::Scalar,
            Some("avx2") => best.min(Isa::Avx2),
            _ => best,
        }
    }

    /// Whether this CPU can run `self`.
    pub fn is_available(self) -> bool {
        Isa::available().contains(&self)
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
