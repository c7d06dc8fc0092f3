//! Which instruction set the kernels use, detected at run time.
//!
//! `INFERENCE_LAB_ISA=scalar|avx2|avx512|avx512vnni` caps the choice, so an
//! AVX-512 machine can run and test the AVX2 path (and the portable one);
//! the tests run every path the CPU has against the scalar reference. The
//! chosen path is named in numbers.md's machine column by the benches and
//! printed by `p10_quant isa`.

use std::fmt;

/// Kernel paths, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Portable Rust: the reference every other path is tested against.
    Scalar,
    /// AVX2 + FMA + F16C: 256-bit integer dot products (`maddubs`/`madd`).
    Avx2,
    /// AVX-512 F/BW/VL: two blocks per 512-bit register, `maddubs`/`madd`.
    Avx512,
    /// AVX-512 with VNNI: the same, the multiply-adds in one `vpdpbusd`.
    Avx512Vnni,
}

impl Isa {
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Vnni => "avx512vnni",
        }
    }

    /// The path named `s` (as [`Isa::name`] writes it).
    pub fn from_name(s: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.name() == s)
    }

    /// Paths this CPU can run, narrowest first.
    pub fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                v.push(Isa::Avx2);
                if has!("avx512f") && has!("avx512bw") && has!("avx512vl") {
                    v.push(Isa::Avx512);
                    if has!("avx512vnni") {
                        v.push(Isa::Avx512Vnni);
                    }
                }
            }
        }
        v
    }

    /// The widest available path, capped by `INFERENCE_LAB_ISA`.
    pub fn detect() -> Isa {
        let best = Isa::available().into_iter().max().unwrap_or(Isa::Scalar);
        Isa::capped(best, std::env::var("INFERENCE_LAB_ISA").ok().as_deref())
    }

    /// `best` capped by a path's name (an unknown name caps nothing).
    pub fn capped(best: Isa, cap: Option<&str>) -> Isa {
        match cap.and_then(Isa::from_name) {
            Some(cap) => best.min(cap),
            None => best,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_caps_narrow() {
        for i in Isa::ALL {
            assert_eq!(Isa::from_name(i.name()), Some(i));
        }
        assert_eq!(Isa::capped(Isa::Avx512Vnni, Some("avx2")), Isa::Avx2);
        assert_eq!(Isa::capped(Isa::Avx512Vnni, Some("avx512")), Isa::Avx512);
        assert_eq!(Isa::capped(Isa::Avx2, Some("avx512vnni")), Isa::Avx2);
        assert_eq!(Isa::capped(Isa::Avx2, Some("scalar")), Isa::Scalar);
        assert_eq!(Isa::capped(Isa::Avx2, Some("bogus")), Isa::Avx2);
        assert_eq!(Isa::capped(Isa::Avx2, None), Isa::Avx2);
    }
}
