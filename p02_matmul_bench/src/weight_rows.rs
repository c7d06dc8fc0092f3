//! GEMM with B = Wᵀ for a weight W that is never stored in f32: its rows are
//! expanded panel by panel inside the blocked loop, where the packing step
//! would copy them.
//!
//! ```text
//! per thread (its own columns of C = its own rows of W):
//!   for pc in K by kc (a multiple of the producer's block):
//!     for each nr-row sliver of W:   rows(j0, nr, pc, kc) -> scratch (nr x kc, L1)
//!                                    transpose into the packed B panel (L2/L3)
//!     for ic in M by mc: micro-kernels, as in `sgemm`
//! ```
//!
//! Project 10 runs prompt-length products of its 4-bit weights this way: each
//! weight is expanded once per call, straight into the cache-resident panel
//! the micro-kernel reads, so the only bytes that come from memory are the
//! quantised blocks (about 5 bits per weight instead of an f32 copy's 32).

use crate::gemm::{gemm_dispatch, BSrc, GemmOpts};
use crate::kernels::MicroKernel;
use crate::mat::{MatMut, MatRef};
use crate::pack::transpose_sliver;
use crate::GemmError;

/// `produce(j0, count, p0, kc, out)` writes W[j0..j0 + count, p0..p0 + kc]
/// row-major into `out` (count·kc values, every one of them).
pub type ProduceRows<'a> = dyn Fn(usize, usize, usize, usize, &mut [f32]) + Sync + 'a;

/// `produce(j0, count, p0, kc, nr, dst)` writes the packed sliver of W's
/// rows j0..j0 + count (count ≤ nr), K range p0..p0 + kc, as the
/// micro-kernel reads it: dst[p·nr + c] = W[j0 + c, p0 + p] for c < count,
/// and 0 for count ≤ c < nr (kc·nr values, every one of them). A producer
/// that can expand its format straight into this layout saves the
/// row-major scratch and the transpose [`ProduceRows`] costs.
pub type ProduceSliver<'a> = dyn Fn(usize, usize, usize, usize, usize, &mut [f32]) + Sync + 'a;

/// How W's values arrive.
#[derive(Clone, Copy)]
enum Producer<'a> {
    Rows(&'a ProduceRows<'a>),
    Slivers(&'a ProduceSliver<'a>),
}

/// A weight W (n, k) given by a producer of its rows or slivers.
pub(crate) struct WeightRows<'a> {
    n: usize,
    k_unit: usize,
    produce: Producer<'a>,
}

impl WeightRows<'_> {
    pub(crate) fn k_unit(&self) -> usize {
        self.k_unit
    }

    /// Pack slivers of W's rows j_first..j_end (one nr-row sliver at a
    /// time, the last zero-padded), K range pc..pc + kc, into `out`
    /// (whole slivers, kc·nr each) for the micro-kernel.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pack(
        &self,
        j_first: usize,
        j_end: usize,
        pc: usize,
        kc: usize,
        nr: usize,
        scratch: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let j_end = j_end.min(self.n);
        if let Producer::Rows(_) = self.produce {
            scratch.resize(nr * kc, 0.0);
        }
        for (s, dst) in out.chunks_exact_mut(kc * nr).enumerate() {
            let j0 = j_first + s * nr;
            if j0 >= j_end {
                break;
            }
            let count = nr.min(j_end - j0);
            match self.produce {
                Producer::Rows(produce) => {
                    // Rows past W's end read as zero; the others are all written.
                    scratch[count * kc..].fill(0.0);
                    produce(j0, count, pc, kc, &mut scratch[..count * kc]);
                    transpose_sliver(scratch, kc, 0, kc, nr, dst);
                }
                Producer::Slivers(produce) => produce(j0, count, pc, kc, nr, dst),
            }
        }
    }
}

/// C (M, N) = alpha · A (M, K) · Wᵀ + beta · C + bias, where W (N, K) is
/// given by `produce` (see [`ProduceRows`]) and never exists whole in f32.
///
/// `produce` is asked only for K ranges that start and end on multiples of
/// `k_unit` (so a block-quantised format expands whole blocks); `k_unit`
/// must divide K. The producer runs on up to `opts.threads` threads at
/// once, each on its own columns of C, so each value of W is asked for once
/// per call (per thread when N is too narrow to split: fewer than NR
/// columns a thread). Results match [`crate::sgemm`] on the expanded W within the same
/// bound (the same micro-kernel; K blocks may differ in size).
pub fn sgemm_weight_rows(
    a: MatRef,
    n: usize,
    k_unit: usize,
    produce: &ProduceRows<'_>,
    c: &mut MatMut,
    opts: GemmOpts,
) -> Result<(), GemmError> {
    weight_gemm(a, n, k_unit, Producer::Rows(produce), c, opts)
}

/// [`sgemm_weight_rows`] with W given by a producer of packed slivers (see
/// [`ProduceSliver`]): the same loop, with no transpose.
pub fn sgemm_weight_slivers(
    a: MatRef,
    n: usize,
    k_unit: usize,
    produce: &ProduceSliver<'_>,
    c: &mut MatMut,
    opts: GemmOpts,
) -> Result<(), GemmError> {
    weight_gemm(a, n, k_unit, Producer::Slivers(produce), c, opts)
}

fn weight_gemm(
    a: MatRef,
    n: usize,
    k_unit: usize,
    produce: Producer<'_>,
    c: &mut MatMut,
    opts: GemmOpts,
) -> Result<(), GemmError> {
    let k = a.cols;
    if k_unit == 0 || !k.is_multiple_of(k_unit) {
        return Err(GemmError::KUnit { k, k_unit });
    }
    crate::gemm::check_args(&a, (k, n), c, opts.bias)?;
    let w = WeightRows { n, k_unit, produce };
    gemm_dispatch(
        opts.alpha,
        &a,
        BSrc::Rows(&w),
        n,
        opts.beta,
        c,
        MicroKernel::best(),
        opts.threads,
    );
    crate::gemm::add_bias(c, opts.bias);
    Ok(())
}
