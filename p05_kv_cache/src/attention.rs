//! Attention of a batched, ragged step: each sequence's new queries attend
//! over that sequence's own keys and values, read from its [`KvStore`] as
//! runs of consecutive positions (one run for a contiguous cache, one per
//! block for a paged one).
//!
//! Two paths, one result:
//! - a sequence with one new token (decode) runs [`attend_row`] per head:
//!   a dot product per cached position, a softmax, a weighted sum of values;
//! - a sequence with several (a prompt or a chunk) runs [`prefill_head`] per
//!   head: S = scale Q K^T and O = softmax(S) V as matrix products (sgemm).
//!
//! [`attend_naive`] is the reference both are tested against.

use common::batch::{Batch, KvStore};
use p02_matmul_bench::{sgemm, GemmError, GemmOpts, MatMut, MatRef};
use rayon::prelude::*;

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
/// `upto`. The same arithmetic, in the same order, as p04's `attend`, so a
/// contiguous store gives bit-identical results.
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
    store.for_each_run(layer, kv_head, upto, &mut |p0, keys, _| {
        for (s, k) in keys.chunks_exact(hd).enumerate() {
            scores[p0 + s] = p02_matmul_bench::variants::dot(q, k) * scale;
        }
    });
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for sc in scores.iter_mut() {
        *sc = (*sc - max).exp();
        sum += *sc;
    }
    out.fill(0.0);
    store.for_each_run(layer, kv_head, upto, &mut |p0, _, values| {
        for (s, v) in values.chunks_exact(hd).enumerate() {
            let w = scores[p0 + s] / sum;
            for (o, &vv) in out.iter_mut().zip(v) {
                *o += w * vv;
            }
        }
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

/// One head's causal attention for n queries (rows of `q`, stride
/// n_head * head_dim) at positions p0..p0+n over positions 0..p0+n of the
/// store, as matrix products per run of positions: S[:, run] = scale Q K_run^T,
/// the causal mask and a row softmax, then O = sum over runs S[:, run] V_run.
/// Returns O (n, head_dim).
#[allow(clippy::too_many_arguments)]
pub fn prefill_head<S: KvStore + ?Sized>(
    q: &[f32],
    store: &S,
    layer: usize,
    heads: Heads,
    head: usize,
    p0: usize,
    n: usize,
    scale: f32,
) -> Result<Vec<f32>, GemmError> {
    let (nh, hd) = (heads.n_head, heads.head_dim);
    let keys_n = p0 + n;
    let one = GemmOpts {
        threads: 1,
        ..GemmOpts::default()
    };
    let qh = MatRef::new(&q[head * hd..], n, hd, nh * hd, 1)?;
    let mut s = vec![0.0f32; n * keys_n];
    let mut result = Ok(());
    store.for_each_run(layer, heads.kv_head(head), keys_n, &mut |r0, keys, _| {
        let rl = keys.len() / hd;
        let mut run = || -> Result<(), GemmError> {
            let kt = MatRef::new(keys, rl, hd, hd, 1)?.t();
            let mut c = MatMut::new(&mut s[r0..], n, rl, keys_n)?;
            sgemm(
                qh,
                kt,
                &mut c,
                GemmOpts {
                    alpha: scale,
                    ..one
                },
            )
        };
        if result.is_ok() {
            result = run();
        }
    });
    std::mem::replace(&mut result, Ok(()))?;
    for (i, row) in s.chunks_exact_mut(keys_n).enumerate() {
        let visible = p0 + i + 1; // the causal mask: keys after position p0 + i are hidden
        let max = row[..visible]
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for x in &mut row[..visible] {
            *x = (*x - max).exp();
            sum += *x;
        }
        for x in &mut row[..visible] {
            *x /= sum;
        }
        row[visible..].fill(0.0);
    }
    let mut o = vec![0.0f32; n * hd];
    let mut first = true;
    store.for_each_run(layer, heads.kv_head(head), keys_n, &mut |r0, _, values| {
        let rl = values.len() / hd;
        let mut run = || -> Result<(), GemmError> {
            let p = MatRef::new(&s[r0..], n, rl, keys_n, 1)?;
            let v = MatRef::new(values, rl, hd, hd, 1)?;
            let beta = if first { 0.0 } else { 1.0 };
            sgemm(
                p,
                v,
                &mut MatMut::row_major(&mut o, n, hd)?,
                GemmOpts { beta, ..one },
            )
        };
        if result.is_ok() {
            result = run();
        }
        first = false;
    });
    result?;
    Ok(o)
}

/// The attention of a whole step, for one layer: `q` (n_tokens, n_head *
/// head_dim), already rotated; the new K/V already written to each store.
/// Writes `att` (n_tokens, n_head * head_dim). Decode rows run in parallel
/// over rows; each prefill sequence runs its heads in parallel.
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
) -> Result<(), GemmError> {
    let (nh, hd) = (heads.n_head, heads.head_dim);
    let width = nh * hd;
    let seqs = batch.seqs();
    // Rows of one-token sequences: one task per row, its heads in turn.
    // Score rows are as long as the largest store (not the current
    // position), so a sequence's decode steps do not regrow them.
    scratch.row_seq.clear();
    let mut max_keys = 1;
    for (i, s) in seqs.iter().enumerate() {
        scratch.row_seq.extend(std::iter::repeat_n(i, s.len));
        if s.len == 1 {
            max_keys = max_keys.max(stores[i].capacity());
        }
    }
    let need = batch.n_tokens() * max_keys;
    if scratch.scores.len() < need {
        scratch.scores.resize(need, 0.0);
    }
    let row_seq = &scratch.row_seq;
    let decode_row = |row: usize, out: &mut [f32], scores: &mut [f32]| {
        let si = row_seq[row];
        let s = seqs[si];
        if s.len != 1 {
            return;
        }
        let store: &S = stores[si];
        for head in 0..nh {
            attend_row(
                &q[row * width + head * hd..][..hd],
                store,
                layer,
                heads.kv_head(head),
                s.start_pos + 1,
                scale,
                scores,
                &mut out[head * hd..(head + 1) * hd],
            );
        }
    };
    // Waking the pool costs tens of microseconds: small work stays on this
    // thread (one decode row at a short position, as p05's decode did).
    let work: usize = seqs
        .iter()
        .filter(|s| s.len == 1)
        .map(|s| (s.start_pos + 1) * width)
        .sum();
    if work < PAR_MIN_MACS {
        for (row, (out, scores)) in att
            .chunks_exact_mut(width)
            .zip(scratch.scores.chunks_exact_mut(max_keys))
            .enumerate()
        {
            decode_row(row, out, scores);
        }
    } else {
        att.par_chunks_mut(width)
            .zip(scratch.scores.par_chunks_mut(max_keys))
            .enumerate()
            .for_each(|(row, (out, scores))| decode_row(row, out, scores));
    }
    // Sequences with several new tokens: per head, two matrix products.
    for (si, s) in seqs.iter().enumerate().filter(|(_, s)| s.len > 1) {
        let store: &S = stores[si];
        let qs = &q[s.offset * width..(s.offset + s.len) * width];
        let per_head: Vec<Vec<f32>> = (0..nh)
            .into_par_iter()
            .map(|head| prefill_head(qs, store, layer, heads, head, s.start_pos, s.len, scale))
            .collect::<Result<_, _>>()?;
        for (head, oh) in per_head.iter().enumerate() {
            for i in 0..s.len {
                att[(s.offset + i) * width + head * hd..][..hd]
                    .copy_from_slice(&oh[i * hd..(i + 1) * hd]);
            }
        }
    }
    Ok(())
}
