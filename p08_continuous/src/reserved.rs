//! Imports whose K/V lands straight in the blocks that will hold it.
//!
//! [`EngineCore::import`] takes a filled buffer and copies it into freshly
//! allocated blocks on the model thread. A receiver that knows the
//! prompt's length before the first byte arrives can do better (Project
//! 14's decode worker; vLLM's and Mooncake's receivers do the same):
//!
//! ```text
//! model thread                      receiving thread
//! reserve_import(id, prompt)  ──►   KvLease (the blocks' memory, moved out)
//!   ... steps run on the other      frames land in the lease's blocks
//!       blocks meanwhile ...
//! take_back(id, lease)        ◄──   the lease, filled
//! import_reserved(id, state)        (or cancel_import(id) on a failed load)
//! ```
//!
//! While the blocks are lent the pool counts them as used by `id`, no step
//! can name them (the scheduler does not know `id` yet, and the storage
//! refuses an empty slot), so nothing reads memory the receiver writes.

use p05_kv_cache::generate::Sequence;

use crate::core::{EngineCore, SeqData};
use crate::handoff::{HandoffError, SeqExport};
use crate::kv_backend::KvBackend;
use crate::kv_transfer::KvLease;
use crate::runner::{ModelRunner, SeqKv};
use crate::scheduler::SeqId;

/// A reserved import: its computed positions, and whether its blocks are
/// out (lent) or home.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reservation {
    pub tokens: usize,
    pub lent: bool,
}

impl<B: KvBackend, R: ModelRunner, C> EngineCore<'_, B, R, C> {
    /// Allocate `id`'s K/V for the `prompt` positions that will arrive
    /// computed (room for one more, as an import), of a sequence of at
    /// most `max_len` positions, and lend the blocks out to be filled.
    /// None (nothing held): this runner lends nothing; import a buffer.
    /// Busy: no free blocks now.
    pub fn reserve_import(
        &mut self,
        id: SeqId,
        prompt: &[u32],
        max_len: usize,
    ) -> Result<Option<KvLease>, HandoffError> {
        if self.is_held(id) || self.reserved.contains_key(&id) {
            return Err(HandoffError::Duplicate(id));
        }
        self.check_fits(id, max_len.max(prompt.len() + 1))?;
        if !self.kv.admit_computed(id, prompt, max_len) {
            return Err(HandoffError::Busy(id));
        }
        let lent = self.flush_ops().and_then(|()| {
            let kv = self.kv.seq_kv(id).ok_or(HandoffError::Busy(id))?;
            Ok(self.runner.lend_kv(id, &kv, prompt.len())?)
        });
        match lent {
            Ok(Some(lease)) => {
                let r = Reservation {
                    tokens: prompt.len(),
                    lent: true,
                };
                self.reserved.insert(id, r);
                Ok(Some(lease))
            }
            Ok(None) => {
                self.kv.free(id);
                Ok(None)
            }
            Err(e) => {
                self.kv.free(id);
                Err(e)
            }
        }
    }

    /// `id`'s blocks come home with what was written into them.
    pub fn take_back(&mut self, id: SeqId, lease: KvLease) -> Result<(), HandoffError> {
        let r = self.reserved.get(&id).copied();
        let Some(r) = r.filter(|r| r.lent && r.tokens == lease.tokens) else {
            return Err(HandoffError::Unknown(id));
        };
        self.runner.take_back_kv(lease)?;
        self.reserved.insert(id, Reservation { lent: false, ..r });
        Ok(())
    }

    /// Give up a reservation (the load failed, or its client left): its
    /// blocks go back to the pool. Blocks still lent (their lease was
    /// lost) get fresh zeroed memory first, so the storage stays whole.
    pub fn cancel_import(&mut self, id: SeqId) {
        let Some(r) = self.reserved.remove(&id) else {
            return;
        };
        if r.lent {
            if let Some(SeqKv::Blocks(table)) = self.kv.seq_kv(id) {
                let layout = self.runner.layout();
                let n = r.tokens.div_ceil(layout.block_size.max(1)).min(table.len());
                let blocks = table[..n]
                    .iter()
                    .map(|&b| (b, vec![0.0f32; layout.block_floats()].into_boxed_slice()))
                    .collect();
                let lease = KvLease {
                    layout,
                    tokens: r.tokens,
                    blocks,
                };
                if let Err(e) = self.runner.take_back_kv(lease) {
                    eprintln!("core: restoring lost blocks of {id}: {e}");
                }
            }
        }
        self.kv.free(id);
    }

    /// Run reserved sequence `id` (its blocks home and filled) from its
    /// next decode step, as [`EngineCore::import`] would; `state.kv` is
    /// not read. Busy: no running slot now (the reservation stays; try
    /// again). Any other refusal: the reservation stays for the caller to
    /// cancel.
    pub fn import_reserved(
        &mut self,
        id: SeqId,
        state: &SeqExport,
        client: C,
    ) -> Result<(), (HandoffError, C)> {
        match self.check_reserved(id, state) {
            Ok((seq, max_len)) => {
                let n = seq.history().len();
                self.kv.commit(id, seq.history(), &state.salt, n - 1);
                let data = SeqData::new(seq, state.salt.clone(), client);
                match self.scheduler.add_running(id, n, n - 1, max_len, data) {
                    Ok(()) => {
                        self.reserved.remove(&id);
                        Ok(())
                    }
                    Err(data) => Err((HandoffError::Busy(id), data.client)),
                }
            }
            Err(e) => Err((e, client)),
        }
    }

    fn check_reserved(
        &self,
        id: SeqId,
        state: &SeqExport,
    ) -> Result<(Sequence, usize), HandoffError> {
        let Some(r) = self.reserved.get(&id).copied() else {
            return Err(HandoffError::Unknown(id));
        };
        if r.lent {
            return Err(HandoffError::NotCaughtUp(id));
        }
        let (seq, max_len, computed) = self.resume_state(id, state)?;
        if computed != r.tokens {
            return Err(HandoffError::Tokens {
                got: r.tokens,
                want: computed,
            });
        }
        if !self.scheduler.has_running_room() {
            return Err(HandoffError::Busy(id));
        }
        Ok((seq, max_len))
    }

    /// Reservations held (their blocks count as used).
    pub fn num_reserved(&self) -> usize {
        self.reserved.len()
    }
}
