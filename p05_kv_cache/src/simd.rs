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

/// out[p] = scale · q · keys[p] for every key p of a run (keys: out.len()
/// rows of q.len()).
pub fn scores(q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd() && q.len().is_multiple_of(8) {
        // SAFETY: the CPU has AVX2 and FMA (checked by `simd`).
        return unsafe { avx2::scores(q, keys, scale, out) };
    }
    scores_ref(q, keys, scale, out)
}

pub fn scores_ref(q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
    for (o, k) in out.iter_mut().zip(keys.chunks_exact(q.len().max(1))) {
        *o = p02_matmul_bench::variants::dot(q, k) * scale;
    }
}

/// x[i] = exp(x[i] − max) in place; returns Σ x[i] (the softmax's
/// denominator), summed in one fixed order.
pub fn exp_sum(x: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: the CPU has AVX2 and FMA (checked by `simd`).
        return unsafe { avx2::exp_sum(x, max) };
    }
    exp_sum_ref(x, max)
}

pub fn exp_sum_ref(x: &mut [f32], max: f32) -> f32 {
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    sum
}

/// out += Σ_p w[p] · values[p] (values: w.len() rows of out.len()).
pub fn weighted_sum(w: &[f32], values: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd() && out.len().is_multiple_of(8) {
        // SAFETY: the CPU has AVX2 and FMA (checked by `simd`).
        return unsafe { avx2::weighted_sum(w, values, out) };
    }
    for (&wp, v) in w.iter().zip(values.chunks_exact(out.len().max(1))) {
        axpy_ref(wp, v, out);
    }
}

/// out[i] += w·v[i]: the portable weighted sum's step.
pub fn axpy_ref(w: f32, v: &[f32], out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(v) {
        *o += w * x;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// One key's score sum: one 8-lane accumulator over q's 8-float chunks,
    /// its lanes added as ((0+1)+(2+3)) + ((4+5)+(6+7)): bit for bit what
    /// `scores` gives a key inside a block of 8, so a key's score does not
    /// depend on where its run starts.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn dot1(q: &[f32], k: &[f32]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for c in (0..q.len().min(k.len()) / 8 * 8).step_by(8) {
            // SAFETY: c + 8 ≤ both lengths.
            let (x, y) = unsafe {
                (
                    _mm256_loadu_ps(q.as_ptr().add(c)),
                    _mm256_loadu_ps(k.as_ptr().add(c)),
                )
            };
            acc = _mm256_fmadd_ps(x, y, acc);
        }
        let h = _mm256_hadd_ps(acc, acc);
        let h = _mm256_hadd_ps(h, h);
        _mm_cvtss_f32(_mm_add_ss(
            _mm256_castps256_ps128(h),
            _mm256_extractf128_ps::<1>(h),
        ))
    }

    /// Eight 8-lane sums → one vector of the eight totals, in one fixed order.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn sum8(a: [__m256; 8]) -> __m256 {
        let t0 = _mm256_hadd_ps(a[0], a[1]);
        let t1 = _mm256_hadd_ps(a[2], a[3]);
        let t2 = _mm256_hadd_ps(a[4], a[5]);
        let t3 = _mm256_hadd_ps(a[6], a[7]);
        let u0 = _mm256_hadd_ps(t0, t1);
        let u1 = _mm256_hadd_ps(t2, t3);
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(u0, u1),
            _mm256_permute2f128_ps::<0x31>(u0, u1),
        )
    }

    /// Keys in blocks of 8: eight dot products side by side, reduced
    /// together; a last partial block key by key. q.len() is a multiple of 8.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scores(q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
        let hd = q.len();
        let n = out.len().min(keys.len() / hd.max(1));
        let sc = _mm256_set1_ps(scale);
        let whole = n / 8 * 8;
        for p0 in (0..whole).step_by(8) {
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in (0..hd).step_by(8) {
                // SAFETY: c + 8 ≤ hd: inside q.
                let qc = unsafe { _mm256_loadu_ps(q.as_ptr().add(c)) };
                for (j, a) in acc.iter_mut().enumerate() {
                    // SAFETY: key p0 + j < n is inside keys; c + 8 ≤ hd.
                    let k = unsafe { _mm256_loadu_ps(keys.as_ptr().add((p0 + j) * hd + c)) };
                    *a = _mm256_fmadd_ps(qc, k, *a);
                }
            }
            // SAFETY: p0 + 8 ≤ whole ≤ out.len().
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(p0), _mm256_mul_ps(sum8(acc), sc)) };
        }
        for p in whole..n {
            out[p] = dot1(q, &keys[p * hd..(p + 1) * hd]) * scale;
        }
    }

    /// exp(x) for x ≤ 0 (Cephes' expf: x = n·ln 2 + r, a degree-5
    /// polynomial for e^r, times 2^n), relative error about 2e-7; below
    /// −87.3 it gives 0.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.3));
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.3));
        let n = _mm256_floor_ps(_mm256_fmadd_ps(
            x,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
            _mm256_set1_ps(0.5),
        ));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut y = _mm256_set1_ps(1.987_569_1e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            0.166_666_65,
            0.5,
        ] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
        }
        let y = _mm256_fmadd_ps(
            y,
            _mm256_mul_ps(r, r),
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_sum(x: &mut [f32], max: f32) -> f32 {
        let m = _mm256_set1_ps(max);
        let mut acc = _mm256_setzero_ps();
        let whole = x.len() / 8 * 8;
        for i in (0..whole).step_by(8) {
            // SAFETY: i + 8 ≤ whole ≤ x.len().
            unsafe {
                let v = exp8(_mm256_sub_ps(_mm256_loadu_ps(x.as_ptr().add(i)), m));
                _mm256_storeu_ps(x.as_mut_ptr().add(i), v);
                acc = _mm256_add_ps(acc, v);
            }
        }
        let mut tail = [f32::NEG_INFINITY; 8];
        tail[..x.len() - whole].copy_from_slice(&x[whole..]);
        // SAFETY: `tail` is 8 floats.
        let v = exp8(_mm256_sub_ps(unsafe { _mm256_loadu_ps(tail.as_ptr()) }, m));
        // SAFETY: as above.
        unsafe { _mm256_storeu_ps(tail.as_mut_ptr(), v) };
        let n = x.len() - whole;
        x[whole..].copy_from_slice(&tail[..n]);
        let s = _mm256_add_ps(acc, v); // the padding lanes are exp(−inf) = 0
        let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// out (a multiple of 8 long) += Σ_p w[p] · values[p], out's 64-float
    /// chunks held in registers across the keys.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn weighted_sum(w: &[f32], values: &[f32], out: &mut [f32]) {
        let hd = out.len();
        let n = w.len().min(values.len() / hd.max(1));
        for c0 in (0..hd).step_by(64) {
            let lanes = (hd - c0).min(64) / 8;
            let mut acc = [_mm256_setzero_ps(); 8];
            for (j, a) in acc.iter_mut().enumerate().take(lanes) {
                // SAFETY: c0 + 8j + 8 ≤ hd.
                *a = unsafe { _mm256_loadu_ps(out.as_ptr().add(c0 + 8 * j)) };
            }
            for (p, &wp) in w.iter().enumerate().take(n) {
                let wv = _mm256_set1_ps(wp);
                for (j, a) in acc.iter_mut().enumerate().take(lanes) {
                    // SAFETY: value row p < n is inside values; c0 + 8j + 8 ≤ hd.
                    let v = unsafe { _mm256_loadu_ps(values.as_ptr().add(p * hd + c0 + 8 * j)) };
                    *a = _mm256_fmadd_ps(wv, v, *a);
                }
            }
            for (j, a) in acc.iter().enumerate().take(lanes) {
                // SAFETY: as above.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(c0 + 8 * j), *a) };
            }
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
    fn run_loops_match_the_portable_ones() {
        let hd = 64;
        for n in [0usize, 1, 7, 8, 9, 16, 17, 33] {
            let q = common::testdata::uniform(hd, 3);
            let keys = common::testdata::uniform(n * hd, 4);
            let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
            scores(&q, &keys, 0.125, &mut a);
            scores_ref(&q, &keys, 0.125, &mut b);
            for (x, y) in a.iter().zip(&b) {
                assert!(
                    (x - y).abs() <= 1e-5 * (x.abs() + 1.0),
                    "scores {n}: {x} vs {y}"
                );
            }
            let max = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let (mut ea, mut eb) = (b.clone(), b.clone());
            let (sa, sb) = (exp_sum(&mut ea, max), exp_sum_ref(&mut eb, max));
            assert!(
                (sa - sb).abs() <= 1e-5 * sb.abs().max(1.0),
                "exp sum {n}: {sa} vs {sb}"
            );
            for (x, y) in ea.iter().zip(&eb) {
                assert!(
                    (x - y).abs() <= 1e-6 * y.abs().max(1e-30),
                    "exp {n}: {x} vs {y}"
                );
            }
            let vals = common::testdata::uniform(n * hd, 5);
            let (mut oa, mut ob) = (vec![0.5f32; hd], vec![0.5f32; hd]);
            weighted_sum(&ea, &vals, &mut oa);
            for (wp, v) in eb.iter().zip(vals.chunks_exact(hd)) {
                axpy_ref(*wp, v, &mut ob);
            }
            for (x, y) in oa.iter().zip(&ob) {
                assert!(
                    (x - y).abs() <= 1e-5 * (y.abs() + 1.0),
                    "weighted sum {n}: {x} vs {y}"
                );
            }
        }
        // Far below the max: exp is 0, not a wrapped-around exponent.
        let mut x = vec![0.0f32, -200.0, -90.0, -1e30, -87.0, -20.0, -1.0, -0.5, -3.0];
        let s = exp_sum(&mut x, 0.0);
        assert_eq!(&x[1..4], &[0.0, 0.0, 0.0]);
        assert!((x[4] - (-87.0f32).exp()).abs() <= 1e-6 * (-87.0f32).exp());
        assert!((s - x.iter().sum::<f32>()).abs() < 1e-6);
    }

    #[test]
    fn a_keys_score_is_the_same_bits_wherever_its_run_starts() {
        let hd = 64;
        let q = common::testdata::uniform(hd, 3);
        let keys = common::testdata::uniform(19 * hd, 4);
        let mut whole = vec![0.0; 19];
        scores(&q, &keys, 0.3, &mut whole);
        for split in 1..19 {
            let mut parts = vec![0.0; 19];
            scores(&q, &keys[..split * hd], 0.3, &mut parts[..split]);
            scores(&q, &keys[split * hd..], 0.3, &mut parts[split..]);
            assert_eq!(parts, whole, "split at {split}");
        }
    }
}
