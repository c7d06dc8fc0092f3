//! The decode worker's imports, on its model thread.
//!
//! A pull thread first asks for blocks ([`Job::Reserve`]): the core
//! allocates the prompt's positions and lends their memory out
//! ([`EngineCore::reserve_import`](p08_continuous::EngineCore)), and the
//! frames land in them while this thread keeps stepping. The filled lease
//! comes back with the sequence's meta ([`Job::Import`]); the blocks go
//! home (pointers moved, nothing copied) and the sequence is admitted as
//! running when a slot is free. When no blocks are free at the request,
//! the pull fills a kept buffer instead and the sequence is imported from
//! it (one copy into blocks here) once there is room.

use std::sync::atomic::Ordering;
use std::sync::mpsc as std_mpsc;

use p05_kv_cache::sampling::SamplerState;
use p08_continuous::handoff::{HandoffError, SeqExport};
use p08_continuous::kv_transfer::{KvBuffer, KvLease};
use p08_continuous::scheduler::SeqId;
use tokio::sync::mpsc;

use super::{Client, Job, Thread};
use crate::wire::{WireEvent, WirePrepared, WireToken};
use common::batch::BatchModel;

/// Where a pull's K/V landed.
#[derive(Debug)]
pub enum Landed {
    /// The sequence's own reserved blocks, lent to the pull.
    Blocks { id: SeqId, lease: KvLease },
    /// A kept buffer (no blocks were free when the pull began).
    Buffer(KvBuffer),
}

/// A pull thread's hold on its lent blocks: given back to the model
/// thread when dropped unused (the pull failed, or the request ended in
/// its first token; also if the thread unwinds), so none is lost.
#[derive(Debug)]
pub struct Reserved {
    pub id: SeqId,
    lease: Option<KvLease>,
    jobs: std_mpsc::Sender<Job>,
}

impl Reserved {
    /// Ask the model thread for blocks for `prompt`'s positions; None when
    /// it has none free now, lends none, or does not answer in `wait`.
    pub fn ask(
        jobs: &std_mpsc::Sender<Job>,
        prompt: &[u32],
        max_len: usize,
        wait: std::time::Duration,
    ) -> Option<Reserved> {
        let (tx, rx) = std_mpsc::sync_channel(1);
        let job = Job::Reserve {
            prompt: prompt.to_vec(),
            max_len,
            reply: tx,
        };
        jobs.send(job).ok()?;
        let (id, lease) = rx.recv_timeout(wait).ok()??;
        Some(Reserved {
            id,
            lease: Some(lease),
            jobs: jobs.clone(),
        })
    }

    pub fn lease_mut(&mut self) -> Option<&mut KvLease> {
        self.lease.as_mut()
    }

    /// The filled blocks, for [`Job::Import`].
    pub fn landed(mut self) -> Option<Landed> {
        let lease = self.lease.take()?;
        Some(Landed::Blocks { id: self.id, lease })
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            let _ = self.jobs.send(Job::Release { id: self.id, lease });
        }
    }
}

/// A pulled sequence waiting for a running slot (and, from a buffer, for
/// blocks).
#[derive(Debug)]
pub(super) struct Pending {
    prep: WirePrepared,
    /// Its K/V: a buffer to import, or none (already in reserved blocks).
    state: SeqExport,
    reserved: Option<SeqId>,
    /// The pull's payload bytes and seconds.
    bytes: usize,
    pull_s: f64,
    first: Option<WireToken>,
    events: mpsc::UnboundedSender<WireEvent>,
}

impl<M: BatchModel> Thread<'_, M> {
    /// [`Job::Reserve`]: lend blocks to the asking pull thread, or answer
    /// None (it then pulls into a buffer).
    pub(super) fn reserve(
        &mut self,
        prompt: &[u32],
        max_len: usize,
        reply: std_mpsc::SyncSender<Option<(SeqId, KvLease)>>,
    ) {
        let id = self.id();
        let lease = match self.core.reserve_import(id, prompt, max_len) {
            Ok(lease) => lease,
            Err(HandoffError::Busy(_)) => None,
            Err(e) => {
                eprintln!("worker: no blocks reserved ({e}); the pull fills a buffer");
                None
            }
        };
        let Some(lease) = lease else {
            let _ = reply.send(None);
            return;
        };
        if let Err(e) = reply.try_send(Some((id, lease))) {
            // The pull stopped waiting: nothing will fill them.
            let (std_mpsc::TrySendError::Full(back) | std_mpsc::TrySendError::Disconnected(back)) =
                e;
            if let Some((id, lease)) = back {
                self.release(id, Some(lease));
            }
        }
    }

    /// Give up reservation `id`: its blocks home (if `lease` brings them)
    /// and free.
    pub(super) fn release(&mut self, id: SeqId, lease: Option<KvLease>) {
        if let Some(lease) = lease {
            if let Err(e) = self.core.take_back(id, lease) {
                eprintln!("worker: taking back the blocks of {id}: {e}");
            }
        }
        self.core.cancel_import(id);
    }

    /// [`Job::Import`]: the pulled sequence waits for its slot; lent blocks
    /// come home first.
    pub(super) fn land(&mut self, job: Job) {
        let Job::Import {
            prep,
            kv,
            meta,
            bytes,
            pull_s,
            first,
            events,
        } = job
        else {
            return;
        };
        let (kv, reserved) = match kv {
            Landed::Buffer(buf) => (buf, None),
            Landed::Blocks { id, lease } => {
                let layout = lease.layout;
                if let Err(e) = self.core.take_back(id, lease) {
                    eprintln!("worker: taking back the blocks of {id} ({e}); recomputing");
                    self.core.cancel_import(id);
                    let skip = meta.output.len() - first.is_some() as usize;
                    return self.intake(Job::Recompute { prep, skip, events });
                }
                (KvBuffer::zeros(layout, 0), Some(id))
            }
        };
        let state = SeqExport {
            prompt: prep.prompt.clone(),
            output: meta.output,
            params: prep.params(),
            sampler: SamplerState {
                seed: meta.sampler_seed,
                draws: meta.sampler_draws,
            },
            salt: prep.salt.clone(),
            kv,
        };
        self.pending.push_back(Pending {
            prep,
            state,
            reserved,
            bytes,
            pull_s,
            first,
            events,
        });
    }

    /// Admit what waits, in order, as far as room allows (after every step).
    pub(super) fn retry_pending(&mut self) {
        for _ in 0..self.pending.len() {
            let Some(p) = self.pending.pop_front() else {
                break;
            };
            if p.events.is_closed() {
                match p.reserved {
                    Some(id) => self.core.cancel_import(id),
                    None => self.pool.give(p.state.kv),
                }
                continue;
            }
            let client = Client::Stream {
                events: p.events.clone(),
                skip: 0,
            };
            let done = match p.reserved {
                Some(id) => self.core.import_reserved(id, &p.state, client),
                None => {
                    let id = self.id();
                    self.core.import(id, &p.state, client)
                }
            };
            match done {
                Ok(()) => {
                    self.load.imported.fetch_add(1, Ordering::SeqCst);
                    if p.reserved.is_some() {
                        self.load.imported_in_blocks.fetch_add(1, Ordering::SeqCst);
                    }
                    let _ = p.events.send(WireEvent::Admitted {
                        recomputed: false,
                        kv_bytes: p.bytes,
                        pull_s: p.pull_s,
                    });
                    if let Some(t) = p.first {
                        let _ = p.events.send(WireEvent::Token(t));
                    }
                    if p.reserved.is_none() {
                        self.pool.give(p.state.kv);
                    }
                }
                Err((HandoffError::Busy(_), _)) => self.pending.push_back(p),
                Err((e, _)) => {
                    // The K/V passed the handshake, so this is a bug or a
                    // sequence that cannot continue here: recompute it.
                    eprintln!("worker: import refused ({e}); recomputing");
                    if let Some(id) = p.reserved {
                        self.core.cancel_import(id);
                    }
                    self.intake(Job::Recompute {
                        skip: p.state.output.len() - p.first.is_some() as usize,
                        prep: p.prep,
                        events: p.events,
                    });
                }
            }
        }
    }
}
