//! Leader election through an etcd lease, and fencing by the leader key's
//! creation revision (etcd's `concurrency.Election`, by hand).
//!
//! ```text
//! campaign:  grant a lease (TTL t); txn { if create_revision(leader) == 0
//!              then put leader = me (with the lease) }
//!            won: my fence = the revision of that txn (the key's creation)
//!            lost: try again every t/4 (the key goes when its lease does)
//! lead:      keep the lease alive every t/4; a failed renewal = not leader
//! act:       every write is txn { if create_revision(leader) == my fence
//!              then the write }
//! ```
//!
//! A leader paused past its TTL (a stop signal, a long GC, a partition)
//! wakes up believing it leads; its next write is refused by etcd itself,
//! because the leader key is now another's, created at a later revision.
//! The controller does not need a correct clock or a timely renewal to be
//! safe; only to be live.

use std::time::Duration;

use p14_distributed::etcd::{Compare, Etcd, EtcdError, Op};

use crate::state::LEADER;

/// Proof of leadership: the leader key's creation revision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fence {
    pub lease: i64,
    pub revision: i64,
}

#[derive(Debug)]
pub struct Candidate {
    pub id: String,
    pub ttl_s: i64,
    etcd: Etcd,
    lease: Option<i64>,
    fence: Option<Fence>,
}

impl Candidate {
    pub fn new(etcd: Etcd, id: &str, ttl_s: i64) -> Candidate {
        Candidate {
            id: id.to_string(),
            ttl_s,
            etcd,
            lease: None,
            fence: None,
        }
    }

    /// How often to renew or retry.
    pub fn tick(&self) -> Duration {
        Duration::from_millis((self.ttl_s.max(1) as u64 * 1000) / 4)
    }

    pub fn fence(&self) -> Option<Fence> {
        self.fence
    }

    /// One step: renew if leading, else try to become leader. The fence
    /// while this candidate leads.
    pub async fn step(&mut self) -> Result<Option<Fence>, EtcdError> {
        if let Some(f) = self.fence {
            match self.etcd.keep_alive(f.lease).await {
                Ok(_) => return Ok(Some(f)),
                Err(e) => {
                    self.fence = None;
                    self.lease = None;
                    if !matches!(e, EtcdError::LeaseExpired(_)) {
                        return Err(e);
                    }
                }
            }
        }
        let lease = match self.lease {
            Some(l) if self.etcd.keep_alive(l).await.is_ok() => l,
            _ => {
                let l = self.etcd.grant(self.ttl_s).await?;
                self.lease = Some(l);
                l
            }
        };
        let put = Op::Put {
            key: LEADER.into(),
            value: self.id.as_bytes().to_vec(),
            lease: Some(lease),
        };
        let (won, revision) = self
            .etcd
            .txn(&[Compare::CreateRevision(LEADER.into(), 0)], &[put])
            .await?;
        if won {
            self.fence = Some(Fence { lease, revision });
        } else if let Some(kv) = self.etcd.get(LEADER).await? {
            // Lost, or won by an earlier attempt of this same txn whose
            // answer did not arrive in time (the client retried it on
            // another member): the key on our lease is ours.
            if kv.lease == lease {
                self.fence = Some(Fence {
                    lease,
                    revision: kv.create_revision,
                });
            }
        }
        Ok(self.fence)
    }

    /// Step down: revoke the lease, so a standby takes over at once.
    pub async fn resign(&mut self) {
        if let Some(l) = self.lease.take() {
            let _ = self.etcd.revoke(l).await;
        }
        self.fence = None;
    }
}

/// Do `ops` only while `fence` holds: whether they were done.
pub async fn fenced(etcd: &Etcd, fence: Fence, ops: &[Op]) -> Result<bool, EtcdError> {
    fenced_if(etcd, fence, &[], ops).await
}

/// As [`fenced`], with further conditions.
pub async fn fenced_if(
    etcd: &Etcd,
    fence: Fence,
    extra: &[Compare],
    ops: &[Op],
) -> Result<bool, EtcdError> {
    let mut c = vec![Compare::CreateRevision(LEADER.into(), fence.revision)];
    c.extend_from_slice(extra);
    Ok(etcd.txn(&c, ops).await?.0)
}
