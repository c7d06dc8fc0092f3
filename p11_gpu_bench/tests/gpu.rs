//! The suite's kernels compute what they claim (a bandwidth figure from a
//! kernel that skips work is worthless). Run by `scripts/gpu_check.sh` on
//! the device machine with `--ignored`.

use p03_gpu_kernel::Gpu;
use p11_gpu_bench::memory::{Kernel, Stream};

fn gpu() -> Gpu {
    Gpu::new(0).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn stream_kernels_read_write_copy_and_triad_every_element() {
    let g = gpu();
    let st = Stream::load(&g).unwrap();
    // Not a multiple of the grid: the grid-stride tails are exercised.
    let n = 4 * 1_000_003;
    let ha: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let hb: Vec<f32> = (0..n).map(|i| (i % 5) as f32).collect();
    let hc: Vec<f32> = (0..n).map(|i| (i % 3) as f32).collect();
    let mut a = g.upload(&ha).unwrap();
    let mut b = g.upload(&hb).unwrap();
    let c = g.upload(&hc).unwrap();
    let mut partial = g.zeros(st.read_threads(n / 4)).unwrap();

    // read, 3 passes: the partial sums add up to 3 x the array's sum (exact:
    // small integers in f32).
    st.launch(Kernel::Read, &mut a, &mut b, &c, &mut partial, 3)
        .unwrap();
    let total: f64 = g
        .download(&partial)
        .unwrap()
        .iter()
        .map(|&v| f64::from(v))
        .sum();
    let want: f64 = 3.0 * ha.iter().map(|&v| f64::from(v)).sum::<f64>();
    assert_eq!(total, want);

    // copy a -> b.
    st.launch(Kernel::Copy, &mut a, &mut b, &c, &mut partial, 2)
        .unwrap();
    assert_eq!(g.download(&b).unwrap(), ha);

    // triad: a = b + 3 c (b now equals the old a).
    st.launch(Kernel::Triad, &mut a, &mut b, &c, &mut partial, 1)
        .unwrap();
    let want: Vec<f32> = ha.iter().zip(&hc).map(|(x, y)| x + 3.0 * y).collect();
    assert_eq!(g.download(&a).unwrap(), want);

    // write, 4 passes: the last pass writes 1 + 3.
    st.launch(Kernel::Write, &mut a, &mut b, &c, &mut partial, 4)
        .unwrap();
    assert!(g.download(&a).unwrap().iter().all(|&v| v == 4.0));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn arrays_that_are_not_float4_multiples_are_refused() {
    let g = gpu();
    let st = Stream::load(&g).unwrap();
    let mut a = g.zeros(10).unwrap();
    let mut b = g.zeros(10).unwrap();
    let c = g.zeros(10).unwrap();
    let mut p = g.zeros(1 << 20).unwrap();
    assert!(st
        .launch(Kernel::Copy, &mut a, &mut b, &c, &mut p, 1)
        .is_err());
}
