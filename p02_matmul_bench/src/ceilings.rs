//! Ceilings, measured here rather than looked up: peak FMA throughput
//! (independent FMA chains, 1 and N threads) and memory bandwidth (read-only,
//! copy, triad) at working sets past L2 and past L3. The roofline uses these.

use std::time::Instant;

/// Peak f32 FLOP/s of this core's widest FMA, per thread count.
pub fn peak_gflops(threads: usize) -> (f64, &'static str) {
    let iters = 20_000_000usize;
    let per_thread = |_: usize| -> (f64, &'static str) { fma_loop(iters) };
    // Warm up (clocks, pool).
    per_thread(0);
    let mut best = 0.0f64;
    let mut name = "";
    for _ in 0..3 {
        let t = Instant::now();
        // Plain OS threads, one chain set each (not the rayon pool: this
        // measures the cores, not the scheduler).
        let flops: f64 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|i| s.spawn(move || per_thread(i).0))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
        });
        let gf = flops / t.elapsed().as_secs_f64() / 1e9;
        if gf > best {
            best = gf;
            name = fma_loop(1).1;
        }
    }
    (best, name)
}

/// Run `iters` rounds of 12 independent FMA chains; returns (FLOPs done, ISA).
fn fma_loop(iters: usize) -> (f64, &'static str) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: avx512f detected.
            let s = unsafe { x86::fma512(iters) };
            std::hint::black_box(s);
            return ((iters * 12 * 16 * 2) as f64, "avx512f");
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: avx2+fma detected.
            let s = unsafe { x86::fma256(iters) };
            std::hint::black_box(s);
            return ((iters * 12 * 8 * 2) as f64, "avx2+fma");
        }
    }
    let mut acc = [1.0f32; 12];
    let x = std::hint::black_box(0.999_99f32);
    for _ in 0..iters / 16 {
        for a in acc.iter_mut() {
            *a = a.mul_add(x, 1e-7);
        }
    }
    std::hint::black_box(acc);
    ((iters / 16 * 12 * 2) as f64, "scalar")
}

/// Memory bandwidth results in GB/s (1e9 bytes/s).
#[derive(Clone, Debug)]
pub struct Bandwidth {
    pub kind: &'static str,
    pub bytes_per_array: usize,
    pub threads: usize,
    pub gbs: f64,
}

/// Read-only, copy and triad bandwidth at `bytes_per_array`, on `threads` OS
/// threads, each streaming its share of the arrays several times (at least
/// 256 MB of traffic per timing, so thread start-up is amortised); best of
/// `reps` (STREAM's convention). Bytes are counted as STREAM does: 1 array
/// per pass for read, 2 for copy, 3 for triad.
pub fn bandwidth(bytes_per_array: usize, threads: usize, reps: usize) -> Vec<Bandwidth> {
    let threads = threads.max(1);
    let n = (bytes_per_array / 4).max(threads);
    let a: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let mut b = vec![0.0f32; n];
    let mut c = vec![1.0f32; n];
    let chunk = n.div_ceil(threads);
    let passes = (256usize << 20).div_ceil(n * 4).max(1);
    // Time `f(thread index)` run on every thread at once.
    fn on_threads(threads: usize, reps: usize, f: &(dyn Fn(usize) + Sync)) -> f64 {
        (0..=reps)
            .map(|_| {
                let t = Instant::now();
                std::thread::scope(|s| {
                    for i in 0..threads {
                        s.spawn(move || f(i));
                    }
                });
                t.elapsed().as_secs_f64()
            })
            .skip(1) // the first run warms pages and caches
            .fold(f64::INFINITY, f64::min)
    }
    let part = |v: &[f32], i: usize| -> std::ops::Range<usize> {
        (i * chunk).min(v.len())..((i + 1) * chunk).min(v.len())
    };
    let t_read = on_threads(threads, reps, &|i| {
        let x = &a[part(&a, i)];
        for _ in 0..passes {
            std::hint::black_box(sum_read(std::hint::black_box(x)));
        }
    });
    let bp = SyncPtr(b.as_mut_ptr());
    let cp = SyncPtr(c.as_mut_ptr());
    let t_copy = on_threads(threads, reps, &|i| {
        let r = part(&a, i);
        // SAFETY: each thread writes its own disjoint range of b.
        let d = unsafe { std::slice::from_raw_parts_mut(bp.get().add(r.start), r.len()) };
        for _ in 0..passes {
            d.copy_from_slice(std::hint::black_box(&a[r.clone()]));
        }
    });
    let t_triad = on_threads(threads, reps, &|i| {
        let r = part(&a, i);
        // SAFETY: each thread writes its own disjoint range of c; b is only read
        // (its copy phase has finished).
        let (d, y) = unsafe {
            (
                std::slice::from_raw_parts_mut(cp.get().add(r.start), r.len()),
                std::slice::from_raw_parts(bp.get().add(r.start), r.len()),
            )
        };
        for _ in 0..passes {
            for ((d, &x), &y) in d.iter_mut().zip(&a[r.clone()]).zip(y) {
                *d = x + 3.0 * y;
            }
            std::hint::black_box(&d);
        }
    });
    std::hint::black_box((&b, &c));
    let gb = (n * 4 * passes) as f64 / 1e9;
    vec![
        Bandwidth {
            kind: "read",
            bytes_per_array,
            threads,
            gbs: gb / t_read,
        },
        Bandwidth {
            kind: "copy",
            bytes_per_array,
            threads,
            gbs: 2.0 * gb / t_copy,
        },
        Bandwidth {
            kind: "triad",
            bytes_per_array,
            threads,
            gbs: 3.0 * gb / t_triad,
        },
    ]
}

/// Read-only bandwidth (GB/s) of a `bytes`-sized working set on `threads`
/// threads: the ceiling for a GEMV whose weights are that size.
pub fn read_bandwidth(bytes: usize, threads: usize) -> f64 {
    bandwidth(bytes, threads, 3)[0].gbs
}

struct SyncPtr(*mut f32);
// SAFETY: threads write disjoint ranges only.
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    fn get(&self) -> *mut f32 {
        self.0
    }
}

/// Sum with 4 vector accumulators (enough loads in flight to saturate memory).
fn sum_read(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: avx2 detected.
        return unsafe { x86::sum256(x) };
    }
    let mut acc = [0.0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    macro_rules! fma_chains {
        ($name:ident, $feat:literal, $set1:ident, $fmadd:ident, $add:ident, $V:ty) => {
            /// 12 independent chains: acc_i = acc_i * x + y.
            ///
            /// # Safety
            /// CPU supports the feature.
            #[target_feature(enable = $feat)]
            pub unsafe fn $name(iters: usize) -> $V {
                let x = $set1(std::hint::black_box(0.999_99));
                let y = $set1(std::hint::black_box(1e-7));
                let mut a: [$V; 12] = [$set1(1.0); 12];
                for _ in 0..iters {
                    for v in a.iter_mut() {
                        *v = $fmadd(*v, x, y);
                    }
                }
                let mut s = a[0];
                for v in &a[1..] {
                    s = $add(s, *v);
                }
                s
            }
        };
    }
    fma_chains!(
        fma256,
        "avx2,fma",
        _mm256_set1_ps,
        _mm256_fmadd_ps,
        _mm256_add_ps,
        __m256
    );
    fma_chains!(
        fma512,
        "avx512f",
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        _mm512_add_ps,
        __m512
    );

    /// # Safety
    /// CPU supports avx2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn sum256(x: &[f32]) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY: i + 32 <= len on every load.
        unsafe {
            while i + 32 <= x.len() {
                for (q, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_add_ps(*a, _mm256_loadu_ps(x.as_ptr().add(i + 8 * q)));
                }
                i += 32;
            }
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut lanes = [0.0f32; 8];
        // SAFETY: lanes holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), s) };
        lanes.iter().sum::<f32>() + x[i..].iter().sum::<f32>()
    }
}
