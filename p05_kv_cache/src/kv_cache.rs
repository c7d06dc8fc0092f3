//! A contiguous KV cache, allocated once per sequence for its maximum length.
//!
//! Per layer, K and V are (n_kv_head, max_seq, head_dim): one KV head's keys
//! are contiguous, which is what a query head of its group reads at decode.
//! Grouped-query attention stores n_kv_head heads, not n_head.

use common::batch::{KvShape, KvStore};
use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum CacheError {
    #[error("KV cache is full: {len} of {max_seq} positions used, {adding} more requested")]
    Full {
        len: usize,
        max_seq: usize,
        adding: usize,
    },
}

/// The fields are private so that `len <= max_seq` and every buffer's
/// length of `n_kv_head * max_seq * head_dim` hold for every cache safe code
/// can make; readers use [`KvCache::head`] and the [`KvStore`] methods.
#[derive(Clone, Debug)]
pub struct KvCache {
    n_layer: usize,
    n_kv_head: usize,
    head_dim: usize,
    max_seq: usize,
    /// Positions filled so far.
    len: usize,
    /// Per layer: (n_kv_head, max_seq, head_dim).
    k: Vec<Vec<f32>>,
    /// Per layer: (n_kv_head, max_seq, head_dim).
    v: Vec<Vec<f32>>,
}

impl KvCache {
    pub fn new(n_layer: usize, n_kv_head: usize, head_dim: usize, max_seq: usize) -> KvCache {
        let per = n_kv_head * max_seq * head_dim;
        KvCache {
            n_layer,
            n_kv_head,
            head_dim,
            max_seq,
            len: 0,
            k: (0..n_layer).map(|_| vec![0.0; per]).collect(),
            v: (0..n_layer).map(|_| vec![0.0; per]).collect(),
        }
    }

    /// 2 x layers x kv_heads x head_dim x max_seq x 4 bytes.
    pub fn formula_bytes(
        n_layer: usize,
        n_kv_head: usize,
        head_dim: usize,
        max_seq: usize,
    ) -> usize {
        2 * n_layer * n_kv_head * head_dim * max_seq * 4
    }

    /// Reallocate for `max_seq` positions (never fewer than `len`), copying
    /// the filled ones: how a contiguous cache grows (and why it wastes room
    /// and copies, which paged blocks avoid). Asking for less than `len`
    /// keeps `len`.
    pub fn grow(&mut self, max_seq: usize) {
        let max_seq = max_seq.max(self.len);
        if max_seq == self.max_seq {
            return;
        }
        let (hd, len, old) = (self.head_dim, self.len, self.max_seq);
        let per = self.n_kv_head * max_seq * hd;
        let relayout = |src: &Vec<f32>| {
            let mut dst = vec![0.0f32; per];
            for h in 0..self.n_kv_head {
                dst[h * max_seq * hd..][..len * hd]
                    .copy_from_slice(&src[h * old * hd..][..len * hd]);
            }
            dst
        };
        self.k = self.k.iter().map(relayout).collect();
        self.v = self.v.iter().map(relayout).collect();
        self.max_seq = max_seq;
    }

    /// Move the fill mark to `len` (at most `max_seq`). Positions below it
    /// are read as they are, zeros if never written: a rewind for reuse, or
    /// a bench timing one step at position `len` without a prefill.
    pub fn set_len(&mut self, len: usize) -> Result<(), CacheError> {
        if len > self.max_seq {
            return Err(CacheError::Full {
                len: self.len,
                max_seq: self.max_seq,
                adding: len.saturating_sub(self.len),
            });
        }
        self.len = len;
        Ok(())
    }

    /// Positions filled so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every key (then value) of `layer`: (n_kv_head, max_seq, head_dim).
    pub fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.k[layer], &self.v[layer])
    }

    /// Positions the cache can hold before it must [`grow`](Self::grow).
    pub fn max_seq(&self) -> usize {
        self.max_seq
    }

    /// Bytes actually held by the K and V buffers.
    pub fn allocated_bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|b| b.capacity() * 4).sum()
    }

    /// Error unless `adding` more positions fit.
    pub fn check_room(&self, adding: usize) -> Result<(), CacheError> {
        if self.len.saturating_add(adding) > self.max_seq {
            return Err(CacheError::Full {
                len: self.len,
                max_seq: self.max_seq,
                adding,
            });
        }
        Ok(())
    }

    /// Store K and V rows (n, n_kv_head * head_dim) of `layer` at positions len..len+n.
    ///
    /// # Panics
    /// If the rows are shorter than `n` rows or `n` positions do not fit
    /// (the step checks [`check_room`](Self::check_room) first).
    pub fn write(&mut self, layer: usize, k_rows: &[f32], v_rows: &[f32], n: usize) {
        let (hd, w) = (self.head_dim, self.n_kv_head * self.head_dim);
        assert!(
            k_rows.len() >= n * w && v_rows.len() >= n * w && self.check_room(n).is_ok(),
            "KvCache::write: {n} rows of {w} (k {}, v {}) at {} of {}",
            k_rows.len(),
            v_rows.len(),
            self.len,
            self.max_seq
        );
        for i in 0..n {
            let pos = self.len + i;
            for h in 0..self.n_kv_head {
                let dst = (h * self.max_seq + pos) * hd;
                self.k[layer][dst..dst + hd].copy_from_slice(&k_rows[i * w + h * hd..][..hd]);
                self.v[layer][dst..dst + hd].copy_from_slice(&v_rows[i * w + h * hd..][..hd]);
            }
        }
    }

    /// Keys (then values) of one layer and KV head: (max_seq, head_dim), rows 0..len valid.
    pub fn head(&self, layer: usize, kv_head: usize) -> (&[f32], &[f32]) {
        let n = self.max_seq * self.head_dim;
        (
            &self.k[layer][kv_head * n..(kv_head + 1) * n],
            &self.v[layer][kv_head * n..(kv_head + 1) * n],
        )
    }
}

impl KvStore for KvCache {
    fn shape(&self) -> KvShape {
        KvShape {
            n_layer: self.n_layer,
            n_kv_head: self.n_kv_head,
            head_dim: self.head_dim,
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn capacity(&self) -> usize {
        self.max_seq
    }

    fn write(&mut self, layer: usize, k_rows: &[f32], v_rows: &[f32], n: usize) {
        KvCache::write(self, layer, k_rows, v_rows, n);
    }

    /// Never past `max_seq`: a caller that advances without room (which
    /// `check_room` refuses first) keeps the `len <= max_seq` invariant.
    fn advance(&mut self, n: usize) {
        debug_assert!(self.len.saturating_add(n) <= self.max_seq);
        self.len = self.len.saturating_add(n).min(self.max_seq);
    }

    /// One run: a KV head's positions are contiguous.
    fn for_each_run(
        &self,
        layer: usize,
        kv_head: usize,
        upto: usize,
        f: &mut common::batch::KvRunFn<'_>,
    ) {
        let (keys, values) = self.head(layer, kv_head);
        let n = upto * self.head_dim;
        f(0, &keys[..n], &values[..n]);
    }

    fn bytes(&self) -> usize {
        self.allocated_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grow_keeps_every_filled_position_of_every_head() {
        let mut c = KvCache::new(2, 3, 4, 5);
        let w = 3 * 4;
        let rows = |base: f32| (0..3 * w).map(|i| base + i as f32).collect::<Vec<f32>>();
        for layer in 0..2 {
            c.write(
                layer,
                &rows(100.0 * layer as f32),
                &rows(-100.0 * layer as f32 - 1.0),
                3,
            );
        }
        c.len = 3;
        let before: Vec<(Vec<f32>, Vec<f32>)> = (0..2)
            .flat_map(|l| (0..3).map(move |h| (l, h)))
            .map(|(l, h)| {
                let (k, v) = c.head(l, h);
                (k[..3 * 4].to_vec(), v[..3 * 4].to_vec())
            })
            .collect();
        c.grow(11);
        assert_eq!((c.max_seq, c.len), (11, 3));
        assert_eq!(c.allocated_bytes(), KvCache::formula_bytes(2, 3, 4, 11));
        let after: Vec<(Vec<f32>, Vec<f32>)> = (0..2)
            .flat_map(|l| (0..3).map(move |h| (l, h)))
            .map(|(l, h)| {
                let (k, v) = c.head(l, h);
                (k[..3 * 4].to_vec(), v[..3 * 4].to_vec())
            })
            .collect();
        assert_eq!(before, after);
        // Shrinking below the filled length keeps the filled length.
        c.grow(1);
        assert_eq!(c.max_seq, 3);
    }

    #[test]
    fn formula_matches_allocation_and_full_is_an_error() {
        let c = KvCache::new(30, 3, 64, 2048);
        assert_eq!(c.allocated_bytes(), KvCache::formula_bytes(30, 3, 64, 2048));
        assert_eq!(KvCache::formula_bytes(30, 3, 64, 2048), 94_371_840);
        let mut c = KvCache::new(1, 1, 2, 3);
        c.write(0, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0], 2);
        c.len = 2;
        assert_eq!(&c.head(0, 0).0[..4], &[1.0, 2.0, 3.0, 4.0]);
        assert!(c.check_room(1).is_ok());
        assert_eq!(
            c.check_room(2),
            Err(CacheError::Full {
                len: 2,
                max_seq: 3,
                adding: 2
            })
        );
    }

    #[test]
    fn the_fill_mark_never_passes_the_room() {
        let mut c = KvCache::new(1, 1, 2, 4);
        assert_eq!(c.set_len(4), Ok(()));
        assert_eq!(c.len(), 4);
        assert!(matches!(c.set_len(5), Err(CacheError::Full { .. })));
        assert_eq!(c.len(), 4, "a refused set_len changes nothing");
    }

    #[test]
    #[should_panic(expected = "KvCache::write")]
    fn a_write_past_the_room_is_refused_before_any_copy() {
        let mut c = KvCache::new(1, 1, 2, 1);
        c.write(0, &[1.0; 4], &[1.0; 4], 2);
    }

    #[test]
    #[should_panic(expected = "attend_row")]
    fn attend_row_refuses_a_short_output_row() {
        let mut c = KvCache::new(1, 1, 2, 2);
        c.write(0, &[1.0; 2], &[1.0; 2], 1);
        c.set_len(1).unwrap();
        let (mut scores, mut out) = (vec![0.0; 2], vec![0.0; 1]);
        crate::attention::attend_row(&[1.0, 1.0], &c, 0, 0, 1, 1.0, &mut scores, &mut out);
    }
}
