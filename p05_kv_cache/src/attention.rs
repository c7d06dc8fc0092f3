//! Attention of a batched, ragged step: each sequence's new queries attend
//! over that sequence's own keys and values, read from its [`KvStore`] as
//! runs of consecutive positions (one run for a contiguous cache, one per
//! block for a paged one).
//!
//! One path for every query row, a decode token or a prompt chunk's:
//! [`attend_row`] per head, a dot product per visible position, a softmax,
//! a weighted sum of values. A prompt's rows could run as two matrix
//! products per head (S = scale Q Kᵀ, O = softmax(S) V), faster for long
//! prompts, but their sums would then depend on how the prompt was chunked
//! (one row or many per product), and a token's result must not: a
//! sequence's outputs are the same whatever shares its steps.
//!
//! [`attend_naive`] is the reference it is tested against.

use common::batch::{Batch, KvStore};
use common::par::ForRanges;
use p02_matmul_bench::GemmError;

/// Below this many multiply-adds (over all decode rows) the decode rows'
/// attention stays on the calling thread (p02's threshold for one row).
const PAR_MIN_MACS: usize = p02_matmul_bench::gemm::PAR_MIN_MACS_M1;

/// Model geometry the attention needs.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
}

impl Heads {
    /// The KV head a query head reads (grouped-query attention).
    pub fn kv_head(&self, head: usize) -> usize {
        // A zero KV-head count (never from a validated config) reads as
        // one group rather than dividing by zero.
        head / self.n_head.checked_div(self.n_kv_head).unwrap_or(1).max(1)
    }
}

/// Per-step buffers of the attention, grown to the step's size and kept.
#[derive(Debug, Default)]
pub struct AttentionScratch {
    /// (n_tokens,) the sequence each token row belongs to.
    row_seq: Vec<usize>,
    /// (n_tokens, max_keys) one score row per decode row.
    scores: Vec<f32>,
}

/// One query row against positions `0..upto` of `store`'s (layer, kv_head):
/// softmax(scale q k^T) v into `out` (head_dim). `scores` has room for
/// `upto`. p04's `attend`'s steps, a run of keys at a time, on SIMD where
/// the CPU has it (`simd.rs`): the scores, exp and the weighted sum.
///
/// # Panics
/// If `out` is not `q.len()` long, `scores` is shorter than `upto`, or
/// `upto` exceeds the positions the store has room for: a caller's bug, checked up
/// front so that no length mismatch is silently truncated by a zip.
#[allow(clippy::too_many_arguments)]
pub fn attend_row<S: KvStore + ?Sized>(
    q: &[f32],
    store: &S,
    layer: usize,
    kv_head: usize,
    upto: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hd = q.len();
    assert!(
        out.len() == hd && scores.len() >= upto && upto <= store.capacity() && hd == store.shape().head_dim,
        "attend_row: q and out must be head_dim ({}; q {hd}, out {}), scores hold upto ({upto}, have {}), \
         upto within the store's room for {} positions",
        store.shape().head_dim,
        out.len(),
        scores.len(),
        store.capacity()
    );
    let scores = &mut scores[..upto];
    // 1. scores = scale · q · k for every visible key, a run at a time.
    store.for_each_run(layer, kv_head, upto, &mut |p0, keys, _| {
        let run = keys.len() / hd;
        crate::simd::scores(q, keys, scale, &mut scores[p0..p0 + run]);
    });
    // 2. softmax: exp(s − max), normalised.
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let inv = 1.0 / crate::simd::exp_sum(scores, max);
    scores.iter_mut().for_each(|w| *w *= inv);
    // 3. out = Σ weight · v, a run at a time.
    out.fill(0.0);
    store.for_each_run(layer, kv_head, upto, &mut |p0, _, values| {
        let run = values.len() / hd;
        crate::simd::weighted_sum(&scores[p0..p0 + run], values, out);
    });
}

/// The reference: f64, one position at a time, no runs shortcut.
pub fn attend_naive<S: KvStore + ?Sized>(
    q: &[f32],
    store: &S,
    layer: usize,
    kv_head: usize,
    upto: usize,
    scale: f32,
) -> Vec<f32> {
    let hd = q.len();
    let mut keys = Vec::new();
    let mut values = Vec::new();
    store.for_each_run(layer, kv_head, upto, &mut |_, k, v| {
        keys.extend_from_slice(k);
        values.extend_from_slice(v);
    });
    let s: Vec<f64> = keys
        .chunks_exact(hd)
        .map(|k| q.iter().zip(k).map(|(a, b)| f64::from(a * b)).sum::<f64>() * f64::from(scale))
        .collect();
    let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
    let z: f64 = w.iter().sum();
    let mut out = vec![0.0f64; hd];
    for (wi, v) in w.iter().zip(values.chunks_exact(hd)) {
        for (o, &vv) in out.iter_mut().zip(v) {
            *o += wi / z * f64::from(vv);
        }
    }
    out.into_iter().map(|x| x as f32).collect()
}

/// The attention of a whole step, for one layer: `q` (n_tokens, n_head *
/// head_dim), already rotated; the new K/V already written to each store.
/// Writes `att` (n_tokens, n_head * head_dim).
///
/// Every row, a decode token or one of a prompt chunk's, is one query
/// through [`attend_row`] over its causal prefix (positions 0..=its own),
/// so a token's attention is the same arithmetic however its prompt was
/// chunked and whatever else shares the step (batch invariance). Rows run
/// in parallel when the step's work is large enough.
#[allow(clippy::too_many_arguments)]
pub fn attention_step<S: KvStore>(
    q: &[f32],
    batch: &Batch,
    stores: &[&mut S],
    layer: usize,
    heads: Heads,
    scale: f32,
    scratch: &mut AttentionScratch,
    att: &mut [f32],
    par: &dyn ForRanges,
) -> Result<(), GemmError> {
    let (nh, hd) = (heads.n_head, heads.head_dim);
    let width = nh * hd;
    let seqs = batch.seqs();
    // Each row's sequence; score rows are as long as the largest store (not
    // the current position), so a sequence's decode steps do not regrow them.
    scratch.row_seq.clear();
    let mut max_keys = 1;
    for (i, s) in seqs.iter().enumerate() {
        scratch.row_seq.extend(std::iter::repeat_n(i, s.len));
        max_keys = max_keys.max(stores[i].capacity());
    }
    let need = batch.n_tokens() * max_keys;
    if scratch.scores.len() < need {
        scratch.scores.resize(need, 0.0);
    }
    let row_seq = &scratch.row_seq;
    let one_row = |row: usize, out: &mut [f32], scores: &mut [f32]| {
        let si = row_seq[row];
        let s = seqs[si];
        let store: &S = stores[si];
        // The row's own position is start_pos + (row − offset): it sees
        // every position up to and including it.
        let upto = s.start_pos + (row - s.offset) + 1;
        for head in 0..nh {
            attend_row(
                &q[row * width + head * hd..][..hd],
                store,
                layer,
                heads.kv_head(head),
                upto,
                scale,
                scores,
                &mut out[head * hd..(head + 1) * hd],
            );
        }
    };
    // Waking the threads costs tens of microseconds: small work stays on
    // this thread (one decode row at a short position, as p05's decode did).
    let work: usize = seqs
        .iter()
        .map(|s| s.len * (s.start_pos + s.len.div_ceil(2)) * width)
        .sum();
    let parts = if work < PAR_MIN_MACS {
        1
    } else {
        par.threads()
    };
    let rows = RowsOut {
        att: att.as_mut_ptr(),
        scores: scratch.scores.as_mut_ptr(),
    };
    assert!(
        att.len() >= batch.n_tokens() * width,
        "attention_step: att is short"
    );
    par.for_ranges(batch.n_tokens(), parts, &|range| {
        let rows = &rows; // the whole struct (Sync), not its raw fields
        for row in range {
            // SAFETY: row < n_tokens; att holds n_tokens rows of width and
            // scores n_tokens rows of max_keys (both checked above); each
            // row belongs to one range, so no two threads touch the same
            // row, and both buffers outlive `for_ranges`.
            let (out, scores) = unsafe {
                (
                    std::slice::from_raw_parts_mut(rows.att.add(row * width), width),
                    std::slice::from_raw_parts_mut(rows.scores.add(row * max_keys), max_keys),
                )
            };
            one_row(row, out, scores);
        }
    });
    Ok(())
}

/// The output and score rows of a step, shared by the threads that each
/// write their own rows of them.
struct RowsOut {
    att: *mut f32,
    scores: *mut f32,
}
// SAFETY: used only as described at the writes in `attention_step`.
unsafe impl Sync for RowsOut {}
