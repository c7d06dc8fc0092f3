//! The machine's integer multiply-add peak on a kernel path: the inner
//! step of that path's tile kernel (`vpdpbusd` on VNNI; `maddubs` then an
//! i16 add on AVX-512 and AVX2), on 12 independent chains so latency is
//! hidden, as many as the loop can issue. What the tile kernels' rate is
//! compared with: the share of it they reach is the share of their
//! instructions that are the multiply-adds themselves.

use std::time::Instant;

use crate::isa::Isa;
use crate::pool::Pool;

/// Multiply-adds (u8 × i8) per second on `isa`'s step, summed over
/// `threads` of the global pool, measured for about `secs`. None for the
/// portable path (it has no such instruction).
pub fn int_macs_per_s(isa: Isa, threads: usize, secs: f64) -> Option<f64> {
    if isa == Isa::Scalar || !isa.is_available() {
        return None;
    }
    // Calibrate one thread's rounds for `secs`.
    let mut rounds = 1_000usize;
    loop {
        let t = Instant::now();
        run(isa, rounds);
        let s = t.elapsed().as_secs_f64();
        if s > secs / 4.0 {
            rounds = ((rounds as f64) * secs / s) as usize + 1;
            break;
        }
        rounds *= 4;
    }
    let pool = Pool::global();
    let threads = threads.clamp(1, pool.threads());
    let t = Instant::now();
    pool.for_ranges(threads, threads, &|r| {
        for _ in r {
            run(isa, rounds);
        }
    });
    let s = t.elapsed().as_secs_f64();
    Some((threads * rounds * MACS_PER_ROUND[isa as usize]) as f64 / s)
}

/// Multiply-adds one round of `run` does on each path: 12 registers of
/// 64 (512-bit) or 32 (256-bit) byte pairs, 8 times.
const MACS_PER_ROUND: [usize; 4] = [0, 12 * 8 * 32, 12 * 8 * 64, 12 * 8 * 64];

fn run(isa: Isa, rounds: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `int_macs_per_s` checked that the CPU has `isa`.
        let v = unsafe {
            match isa {
                Isa::Avx512Vnni => x86::vnni(rounds),
                Isa::Avx512 => x86::avx512(rounds),
                Isa::Avx2 => x86::avx2(rounds),
                Isa::Scalar => 0,
            }
        };
        std::hint::black_box(v);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (isa, rounds);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::hint::black_box;

    /// 12 independent accumulators, 8 steps a round (no closures: they
    /// would not inherit the function's target features).
    macro_rules! body {
        ($rounds:expr, $zero:expr, $a:expr, $b:expr, |$x:ident, $p:ident, $q:ident| $step:expr) => {{
            let ($p, $q) = (black_box($a), black_box($b));
            let mut acc = [$zero; 12];
            for _ in 0..$rounds {
                for _ in 0..8 {
                    for $x in acc.iter_mut() {
                        *$x = $step;
                    }
                }
            }
            black_box(acc);
            0i64
        }};
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn vnni(rounds: usize) -> i64 {
        body!(
            rounds,
            _mm512_setzero_si512(),
            _mm512_set1_epi8(3),
            _mm512_set1_epi8(-2),
            |x, a, b| _mm512_dpbusd_epi32(*x, a, b)
        )
    }

    // On the maddubs paths the accumulator feeds the multiply (so nothing
    // can be hoisted out of the loop); 12 chains hide its latency.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub unsafe fn avx512(rounds: usize) -> i64 {
        body!(
            rounds,
            _mm512_set1_epi8(1),
            _mm512_set1_epi8(3),
            _mm512_set1_epi8(-2),
            |x, a, b| _mm512_add_epi16(b, _mm512_maddubs_epi16(a, *x))
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn avx2(rounds: usize) -> i64 {
        body!(
            rounds,
            _mm256_set1_epi8(1),
            _mm256_set1_epi8(3),
            _mm256_set1_epi8(-2),
            |x, a, b| _mm256_add_epi16(b, _mm256_maddubs_epi16(a, *x))
        )
    }
}
