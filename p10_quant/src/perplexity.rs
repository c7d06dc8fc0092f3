//! Perplexity and KL divergence over a text, the way llama.cpp's
//! `llama-perplexity` counts them, so the two can be set side by side.
//!
//! The text's tokens are cut into chunks of `ctx` tokens. Each chunk is
//! one fresh sequence; its first half is context only, and each position i
//! of the second half (i in ctx/2 .. ctx−1) is scored on the token at i+1.
//! Per scored token, with p the base model's distribution and q the test
//! model's:
//!
//! - NLL = −log q(next token); PPL = exp(mean NLL), its error
//!   PPL · stderr(NLL) (first order);
//! - KL(p ‖ q) = Σ p · (log p − log q), mean with its standard error;
//! - top-1 agreement: argmax p = argmax q.

use anyhow::{ensure, Result};
use p05_kv_cache::llama_engine::LlamaEngine;
use p05_kv_cache::sampling::argmax;

/// Running sums of one quantity: mean and standard error of the mean.
#[derive(Clone, Copy, Debug, Default)]
pub struct Moments {
    n: u64,
    sum: f64,
    sum_sq: f64,
}

impl Moments {
    pub fn push(&mut self, x: f64) {
        self.n += 1;
        self.sum += x;
        self.sum_sq += x * x;
    }

    pub fn count(&self) -> u64 {
        self.n
    }

    pub fn mean(&self) -> f64 {
        self.sum / self.n.max(1) as f64
    }

    /// Standard error of the mean (sample variance, n − 1).
    pub fn stderr(&self) -> f64 {
        if self.n < 2 {
            return f64::NAN;
        }
        let n = self.n as f64;
        let var = (self.sum_sq - self.sum * self.sum / n) / (n - 1.0);
        (var.max(0.0) / n).sqrt()
    }
}

/// One model's scores on the text.
#[derive(Clone, Copy, Debug, Default)]
pub struct Ppl {
    pub nll: Moments,
}

impl Ppl {
    pub fn ppl(&self) -> f64 {
        self.nll.mean().exp()
    }

    /// First-order error of the PPL: PPL · stderr(NLL).
    pub fn ppl_err(&self) -> f64 {
        self.ppl() * self.nll.stderr()
    }
}

/// A test model against a base model on the same tokens.
#[derive(Clone, Copy, Debug, Default)]
pub struct Comparison {
    pub base: Ppl,
    pub test: Ppl,
    /// KL(base ‖ test) per scored token, in nats.
    pub kl: Moments,
    /// 1 where the argmaxes agree, else 0.
    pub top1: Moments,
    pub chunks: usize,
}

/// log softmax of one row of logits, in f64.
pub fn log_softmax(x: &[f32], out: &mut Vec<f64>) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
    out.clear();
    out.extend(x.iter().map(|&v| v as f64 - lse));
}

/// KL(p ‖ q) from log-probabilities.
pub fn kl(lp: &[f64], lq: &[f64]) -> f64 {
    lp.iter().zip(lq).map(|(p, q)| p.exp() * (p - q)).sum()
}

/// The logits of every position of `chunk` (a fresh sequence), (len, vocab).
pub fn chunk_logits(engine: &LlamaEngine, chunk: &[u32], out: &mut Vec<f32>) -> Result<()> {
    let vocab = engine.model.cfg.vocab_size;
    out.resize(chunk.len() * vocab, 0.0);
    let mut cache = engine.new_cache(chunk.len());
    engine.forward_all(chunk, &mut cache, out)?;
    Ok(())
}

/// How many whole chunks of `ctx` the text gives, capped by `max_chunks`.
pub fn n_chunks(tokens: usize, ctx: usize, max_chunks: Option<usize>) -> usize {
    let all = tokens / ctx.max(1);
    max_chunks.map_or(all, |m| m.min(all))
}

/// Score each of `tests` against `base` over the same chunks of `tokens`
/// (the base's logits computed once per chunk). `progress` is called
/// after each chunk with (done, total, running results).
pub fn compare(
    base: &LlamaEngine,
    tests: &[&LlamaEngine],
    tokens: &[u32],
    ctx: usize,
    max_chunks: Option<usize>,
    mut progress: impl FnMut(usize, usize, &[Comparison]),
) -> Result<Vec<Comparison>> {
    ensure!(ctx >= 4, "--ctx must be at least 4 tokens (got {ctx})");
    let vocab = base.model.cfg.vocab_size;
    for e in tests.iter().chain([&base]) {
        ensure!(
            ctx <= e.model.cfg.max_seq,
            "--ctx {ctx} is past the model's context ({})",
            e.model.cfg.max_seq
        );
        ensure!(
            e.model.cfg.vocab_size == vocab,
            "base and test vocabularies differ"
        );
    }
    let chunks = n_chunks(tokens.len(), ctx, max_chunks);
    ensure!(
        chunks > 0,
        "the text has {} tokens, fewer than one chunk of {ctx}",
        tokens.len()
    );
    let (mut lb, mut lt) = (Vec::new(), Vec::new());
    let (mut row_lp, mut pt) = (Vec::new(), Vec::new());
    // The base's log-probabilities and argmax of each scored row, computed
    // once per chunk and shared by every test model.
    let (mut pb, mut base_top) = (Vec::new(), Vec::new());
    let scored = ctx / 2..ctx - 1;
    let mut out = vec![Comparison::default(); tests.len()];
    for i in 0..chunks {
        let chunk = &tokens[i * ctx..(i + 1) * ctx];
        chunk_logits(base, chunk, &mut lb)?;
        pb.clear();
        base_top.clear();
        for pos in scored.clone() {
            let row = &lb[pos * vocab..(pos + 1) * vocab];
            log_softmax(row, &mut row_lp);
            pb.extend_from_slice(&row_lp);
            base_top.push(argmax(row));
        }
        for (test, c) in tests.iter().zip(out.iter_mut()) {
            chunk_logits(test, chunk, &mut lt)?;
            for (j, pos) in scored.clone().enumerate() {
                let next = chunk[pos + 1] as usize;
                let row = &lt[pos * vocab..(pos + 1) * vocab];
                let pbj = &pb[j * vocab..(j + 1) * vocab];
                log_softmax(row, &mut pt);
                c.base.nll.push(-pbj[next]);
                c.test.nll.push(-pt[next]);
                c.kl.push(kl(pbj, &pt));
                c.top1.push(f64::from(u8::from(base_top[j] == argmax(row))));
            }
            c.chunks = i + 1;
        }
        progress(i + 1, chunks, &out);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moments_match_the_two_pass_formulas() {
        let xs = [1.0, 2.0, 4.0, 7.0, 11.0];
        let mut m = Moments::default();
        xs.iter().for_each(|&x| m.push(x));
        let mean = xs.iter().sum::<f64>() / 5.0;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 4.0;
        assert!((m.mean() - mean).abs() < 1e-12);
        assert!((m.stderr() - (var / 5.0).sqrt()).abs() < 1e-12);
        assert!(Moments::default().stderr().is_nan());
    }

    #[test]
    fn kl_is_zero_for_equal_rows_and_positive_otherwise() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        log_softmax(&[1.0, 2.0, 3.0], &mut a);
        log_softmax(&[1.0, 2.0, 3.0], &mut b);
        assert!(kl(&a, &b).abs() < 1e-15);
        log_softmax(&[3.0, 2.0, 1.0], &mut b);
        // p = softmax(1,2,3), q its reverse: KL = Σ p (log p − log q) = 2(p3 − p1).
        let p: Vec<f64> = a.iter().map(|l| l.exp()).collect();
        assert!((kl(&a, &b) - 2.0 * (p[2] - p[0])).abs() < 1e-12);
        assert!((a.iter().map(|l| l.exp()).sum::<f64>() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn chunks_are_whole_and_capped() {
        assert_eq!(n_chunks(1000, 512, None), 1);
        assert_eq!(n_chunks(1024, 512, None), 2);
        assert_eq!(n_chunks(100_000, 512, Some(40)), 40);
        assert_eq!(n_chunks(100, 512, None), 0);
    }
}
