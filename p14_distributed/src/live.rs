//! A transfer whose K/V is still being computed. The prefill worker's
//! forward pass writes each layer's new positions into it as it stores
//! them ([`crate::tap`]); the K/V server's sender streams what is new to
//! the decode worker, layer by layer, while the later layers compute; the
//! trailer follows when the first token is sampled.
//!
//! ```text
//!   model thread:  layer 0 ── layer 1 ── … ── layer 29 ── sample ── finish(meta)
//!                     │          │                │                    │
//!   sender:           └─ frame 0 └─ frame 1 …     └─ frame 29          └─ trailer
//! ```

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use p08_continuous::kv_transfer::{KvBuffer, KvLayout};

/// How a live transfer ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    /// The prompt is done: its meta (first token, sampler state).
    Done(Vec<u8>),
    /// The prefill failed or was dropped: why.
    Failed(String),
}

#[derive(Debug)]
struct State {
    kv: KvBuffer,
    /// Positions of each layer written so far (always from 0, touching).
    filled: Vec<usize>,
    end: Option<End>,
}

#[derive(Debug)]
pub struct Live {
    state: Mutex<State>,
    cv: Condvar,
    pub tokens: usize,
}

impl Live {
    /// Room for `tokens` positions of `layout`.
    pub fn new(layout: KvLayout, tokens: usize) -> Live {
        Live {
            state: Mutex::new(State {
                kv: KvBuffer::zeros(layout, tokens),
                filled: vec![0; layout.n_layer],
                end: None,
            }),
            cv: Condvar::new(),
            tokens,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn bytes(&self) -> usize {
        self.lock().kv.data.len() * 4
    }

    /// Positions of `layer` written so far.
    pub fn filled(&self, layer: usize) -> usize {
        self.lock().filled.get(layer).copied().unwrap_or(0)
    }

    /// Store positions `start..start + n` of `layer`: `k_rows` and
    /// `v_rows` are each (n, n_kv_head * head_dim), the layout the forward
    /// pass writes. Positions already held are skipped (a recompute writes
    /// the same values again); a run that does not touch what is held is
    /// ignored (the caller writes what comes before it first).
    pub fn write_rows(&self, layer: usize, start: usize, n: usize, k_rows: &[f32], v_rows: &[f32]) {
        let mut s = self.lock();
        let State { kv, filled, .. } = &mut *s;
        let Some(have) = filled.get(layer).copied() else {
            return;
        };
        let end = (start + n).min(self.tokens);
        if start > have || end <= have {
            return;
        }
        let l = kv.layout;
        let (hd, row) = (l.head_dim, l.n_kv_head * l.head_dim);
        let bs = l.block_size.max(1);
        for p in have..end {
            let r = (p - start) * row;
            let block = kv.block_mut(p / bs);
            for h in 0..l.n_kv_head {
                for (v, rows) in [(false, k_rows), (true, v_rows)] {
                    let o = l.offset(layer, v, h, p % bs);
                    block[o..o + hd].copy_from_slice(&rows[r + h * hd..r + (h + 1) * hd]);
                }
            }
        }
        filled[layer] = end;
        drop(s);
        self.cv.notify_all();
    }

    pub fn finish(&self, meta: Vec<u8>) {
        self.end(End::Done(meta));
    }

    pub fn fail(&self, why: String) {
        self.end(End::Failed(why));
    }

    fn end(&self, e: End) {
        self.lock().end.get_or_insert(e);
        self.cv.notify_all();
    }

    pub fn ended(&self) -> bool {
        self.lock().end.is_some()
    }

    /// Wait (at most `wait`) until some layer has positions past `sent`, or
    /// the transfer ended; then the new runs (layer, from, to) and how it
    /// ended, if it did.
    pub fn next(
        &self,
        sent: &[usize],
        wait: Duration,
    ) -> (Vec<(usize, usize, usize)>, Option<End>) {
        let fresh = |s: &State| {
            s.filled
                .iter()
                .zip(sent)
                .enumerate()
                .filter(|(_, (f, s))| f > s)
                .map(|(l, (&f, &s))| (l, s, f))
                .collect::<Vec<_>>()
        };
        let s = self.lock();
        let (s, _) = self
            .cv
            .wait_timeout_while(s, wait, |s| fresh(s).is_empty() && s.end.is_none())
            .unwrap_or_else(|e| e.into_inner());
        (fresh(&s), s.end.clone())
    }

    /// `f` on the buffer (under the lock: keep it short).
    pub fn with_kv<T>(&self, f: impl FnOnce(&KvBuffer) -> T) -> T {
        f(&self.lock().kv)
    }
}
