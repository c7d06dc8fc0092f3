//! A prefill worker's K/V storage with taps: for a sequence whose prompt
//! is streamed to a decode worker while it is prefilled, every layer's new
//! positions are also written to its [`Live`] transfer, at the moment the
//! forward pass stores them (before that layer's attention, while the
//! later layers are still to run). Everything else is the inner storage's.
//!
//! A prompt whose prefix was cached starts past position 0: the first
//! write of each layer then copies the cached positions from the store
//! first, so the transfer always holds every position from 0.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use common::batch::{KvRunFn, KvShape, KvStore};
use p08_continuous::kv_transfer::{KvBuffer, KvLayout, KvLease};
use p08_continuous::runner::{KvOp, KvStorage, PlannedSeq, SeqKv};
use p08_continuous::scheduler::SeqId;

use crate::live::Live;

/// Sequences being streamed, by id (shared with the worker's thread).
pub type Taps = Arc<Mutex<HashMap<SeqId, Arc<Live>>>>;

#[derive(Debug)]
pub struct TapStorage<S> {
    inner: S,
    taps: Taps,
}

impl<S> TapStorage<S> {
    pub fn new(inner: S, taps: Taps) -> TapStorage<S> {
        TapStorage { inner, taps }
    }
}

/// One sequence's store for a step, and its tap if it has one.
#[derive(Debug)]
pub struct TapStore<St> {
    inner: St,
    live: Option<Arc<Live>>,
}

impl<S: KvStorage> KvStorage for TapStorage<S> {
    type Store<'s>
        = TapStore<S::Store<'s>>
    where
        Self: 's;
    type Error = S::Error;

    fn layout(&self) -> KvLayout {
        self.inner.layout()
    }

    fn apply(&mut self, op: &KvOp) -> Result<(), S::Error> {
        self.inner.apply(op)
    }

    fn stores(&mut self, seqs: &[PlannedSeq]) -> Result<Vec<Self::Store<'_>>, S::Error> {
        let lives: Vec<Option<Arc<Live>>> = {
            let taps = self.taps.lock().unwrap_or_else(|e| e.into_inner());
            seqs.iter().map(|s| taps.get(&s.id).cloned()).collect()
        };
        let stores = self.inner.stores(seqs)?;
        Ok(stores
            .into_iter()
            .zip(lives)
            .map(|(inner, live)| TapStore { inner, live })
            .collect())
    }

    fn export(&self, id: SeqId, kv: &SeqKv, tokens: usize) -> Result<KvBuffer, S::Error> {
        self.inner.export(id, kv, tokens)
    }

    fn import(&mut self, id: SeqId, kv: &SeqKv, buf: &KvBuffer) -> Result<(), S::Error> {
        self.inner.import(id, kv, buf)
    }

    fn lend(&mut self, id: SeqId, kv: &SeqKv, tokens: usize) -> Result<Option<KvLease>, S::Error> {
        self.inner.lend(id, kv, tokens)
    }

    fn take_back(&mut self, lease: KvLease) -> Result<(), S::Error> {
        self.inner.take_back(lease)
    }
}

impl<St: KvStore> TapStore<St> {
    /// `inner`, its writes also going to `live` (if any).
    pub fn tapped(inner: St, live: Option<Arc<Live>>) -> TapStore<St> {
        TapStore { inner, live }
    }

    /// Positions `from..to` of `layer` as rows, read back from the store.
    fn backfill(&self, live: &Live, layer: usize, from: usize, to: usize) {
        let KvShape {
            n_kv_head,
            head_dim,
            ..
        } = self.inner.shape();
        let row = n_kv_head * head_dim;
        let (mut k, mut v) = (vec![0f32; (to - from) * row], vec![0f32; (to - from) * row]);
        for h in 0..n_kv_head {
            let mut put = |first: usize, keys: &[f32], values: &[f32]| {
                for (i, p) in (first..first + keys.len() / head_dim).enumerate() {
                    if p < from || p >= to {
                        continue;
                    }
                    let o = (p - from) * row + h * head_dim;
                    k[o..o + head_dim].copy_from_slice(&keys[i * head_dim..(i + 1) * head_dim]);
                    v[o..o + head_dim].copy_from_slice(&values[i * head_dim..(i + 1) * head_dim]);
                }
            };
            self.inner.for_each_run(layer, h, to, &mut put);
        }
        live.write_rows(layer, from, to - from, &k, &v);
    }
}

impl<St: KvStore> KvStore for TapStore<St> {
    fn shape(&self) -> KvShape {
        self.inner.shape()
    }

    fn len(&self) -> usize {
        self.inner.len()
    }

    fn capacity(&self) -> usize {
        self.inner.capacity()
    }

    fn write(&mut self, layer: usize, k_rows: &[f32], v_rows: &[f32], n: usize) {
        let start = self.inner.len();
        self.inner.write(layer, k_rows, v_rows, n);
        if let Some(live) = &self.live {
            let have = live.filled(layer);
            if have < start {
                self.backfill(live, layer, have, start);
            }
            live.write_rows(layer, start, n, k_rows, v_rows);
        }
    }

    fn advance(&mut self, n: usize) {
        self.inner.advance(n);
    }

    fn for_each_run(&self, layer: usize, kv_head: usize, upto: usize, f: &mut KvRunFn<'_>) {
        self.inner.for_each_run(layer, kv_head, upto, f);
    }

    fn bytes(&self) -> usize {
        self.inner.bytes()
    }
}
