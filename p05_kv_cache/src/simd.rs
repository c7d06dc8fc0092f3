//! The attention's two inner loops on SIMD where the CPU has AVX2 and FMA
//! (checked once at run time; `INFERENCE_LAB_ISA=scalar` keeps the
//! portable loops), beside the portable versions they replace. Each call
//! is one fixed sequence of operations for its length, so a row's
//! attention does not depend on anything but its own inputs.

use std::sync::OnceLock;

fn simd() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let capped = std::env::var("INFERENCE_LAB_ISA").is_ok_and(|v| v == "scalar");
        #[cfg(target_arch = "x86_64")]
        {
            !capped && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = capped;
            false
        }
    })
}

/// Σ a[i]·b[i] over the shorter of the two.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: the CPU has AVX2 and FMA (checked by `simd`).
        return unsafe { avx2::dot(a, b) };
    }
    p02_matmul_bench::variants::dot(a, b)
}

/// out[i] += w·v[i] over the shorter of the two.
pub fn axpy(w: f32, v: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: as in `dot`.
        return unsafe { avx2::axpy(w, v, out) };
    }
    axpy_ref(w, v, out)
}

/// The portable reference of [`axpy`].
pub fn axpy_ref(w: f32, v: &[f32], out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(v) {
        *o += w * x;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Four 8-lane accumulators, then one fixed reduction; a scalar tail.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let mut acc = [_mm256_setzero_ps(); 4];
        let whole = n / 32 * 32;
        for i in (0..whole).step_by(32) {
            for (j, a_j) in acc.iter_mut().enumerate() {
                // SAFETY: i + 8j + 8 ≤ whole ≤ n: inside both slices.
                let (x, y) = unsafe {
                    (
                        _mm256_loadu_ps(a.as_ptr().add(i + 8 * j)),
                        _mm256_loadu_ps(b.as_ptr().add(i + 8 * j)),
                    )
                };
                *a_j = _mm256_fmadd_ps(x, y, *a_j);
            }
        }
        let mut v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut i = whole;
        while i + 8 <= n {
            // SAFETY: i + 8 ≤ n.
            let (x, y) = unsafe {
                (
                    _mm256_loadu_ps(a.as_ptr().add(i)),
                    _mm256_loadu_ps(b.as_ptr().add(i)),
                )
            };
            v = _mm256_fmadd_ps(x, y, v);
            i += 8;
        }
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let mut sum = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
        for k in i..n {
            sum = a[k].mul_add(b[k], sum);
        }
        sum
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(w: f32, v: &[f32], out: &mut [f32]) {
        let n = v.len().min(out.len());
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 ≤ n: inside both slices.
            unsafe {
                let o = _mm256_loadu_ps(out.as_ptr().add(i));
                let x = _mm256_loadu_ps(v.as_ptr().add(i));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_fmadd_ps(wv, x, o));
            }
            i += 8;
        }
        for k in i..n {
            out[k] = w.mul_add(v[k], out[k]);
        }
    }
}

/// Runs a split on rayon's pool: the default for engines whose products do
/// not bring threads of their own.
#[derive(Clone, Copy, Debug, Default)]
pub struct RayonRanges;

impl common::par::ForRanges for RayonRanges {
    fn threads(&self) -> usize {
        rayon::current_num_threads()
    }

    fn for_ranges(&self, n: usize, parts: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        use rayon::prelude::*;
        if parts <= 1 || n < 2 {
            return f(0..n);
        }
        (0..parts)
            .into_par_iter()
            .for_each(|i| f(common::par::part(n, parts, i)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_loops_match_the_portable_ones_on_ragged_lengths() {
        let a = common::testdata::uniform(131, 1);
        let b = common::testdata::uniform(131, 2);
        for n in [0usize, 1, 7, 8, 9, 31, 32, 33, 64, 100, 131] {
            let (x, y) = (&a[..n], &b[..n]);
            let exact: f64 = x
                .iter()
                .zip(y)
                .map(|(p, q)| f64::from(*p) * f64::from(*q))
                .sum();
            let bound = 1e-6 * x.iter().zip(y).map(|(p, q)| (p * q).abs()).sum::<f32>() + 1e-7;
            assert!(
                (f64::from(dot(x, y)) - exact).abs() <= f64::from(bound),
                "dot {n}"
            );
            let (mut o1, mut o2) = (b[..n].to_vec(), b[..n].to_vec());
            axpy(0.37, x, &mut o1);
            axpy_ref(0.37, x, &mut o2);
            for (k, (p, q)) in o1.iter().zip(&o2).enumerate() {
                assert!(
                    (p - q).abs() <= 1e-6 * (p.abs() + 1.0),
                    "axpy {n} [{k}]: {p} vs {q}"
                );
            }
        }
    }
}
