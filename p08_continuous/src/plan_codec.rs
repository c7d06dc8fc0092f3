//! A compact binary encoding of [`StepPlan`]: what rank 0 broadcasts to
//! tensor-parallel ranks (Project 13) and ships to workers (Project 14).
//! Little-endian, no padding; every count is checked against the bytes
//! left before anything is allocated, so a short, long or hostile frame is
//! an error, never a panic or a huge allocation.
//!
//! ```text
//! plan  = "ILSP" version:u16 0:u16 step:u64
//!         n_ops:u32 op*  n_seqs:u32 seq*
//! op    = 0:u8 src:u32 dst:u32         copy block
//!       | 1:u8 parent:u64 child:u64    fork
//!       | 2:u8 id:u64                  free
//! seq   = id:u64 start:u32 flags:u8    (bit 0: logits, bit 1: paged)
//!         n_tokens:u32 token:u32*
//!         paged: n_blocks:u32 block:u32*   contiguous: capacity:u32
//! ```
//!
//! A decode step of 16 sequences at 512 positions (blocks of 16) is
//! 16 × (21 + 4 + 4 + 32 × 4) + 24 = 2.5 kB.

use thiserror::Error;

use crate::runner::{KvOp, PlannedSeq, SeqKv, StepPlan};

const MAGIC: &[u8; 4] = b"ILSP";
pub const VERSION: u16 = 1;

#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum PlanCodecError {
    #[error("not a step plan (magic {0:02x?})")]
    Magic([u8; 4]),
    #[error("step plan version {got}; this build reads {VERSION}")]
    Version { got: u16 },
    #[error("step plan ends at byte {at} inside {what}")]
    Truncated { at: usize, what: &'static str },
    #[error(
        "step plan: {what} count {count} at byte {at} is more than the {left} bytes left hold"
    )]
    Count {
        what: &'static str,
        count: usize,
        at: usize,
        left: usize,
    },
    #[error("step plan: unknown K/V op tag {tag} at byte {at}")]
    OpTag { tag: u8, at: usize },
    #[error("step plan: unknown flags {flags:#04x} at byte {at}")]
    Flags { flags: u8, at: usize },
    #[error("step plan: {0} bytes after its end")]
    Trailing(usize),
    #[error("step plan: {what} = {value} does not fit in 32 bits")]
    TooLarge { what: &'static str, value: usize },
}

impl StepPlan {
    /// Append the plan's encoding to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), PlanCodecError> {
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.step.to_le_bytes());
        put_len(out, self.ops.len(), "ops")?;
        for op in &self.ops {
            match *op {
                KvOp::CopyBlock { src, dst } => {
                    out.push(0);
                    out.extend_from_slice(&src.to_le_bytes());
                    out.extend_from_slice(&dst.to_le_bytes());
                }
                KvOp::Fork { parent, child } => {
                    out.push(1);
                    out.extend_from_slice(&parent.to_le_bytes());
                    out.extend_from_slice(&child.to_le_bytes());
                }
                KvOp::Free { id } => {
                    out.push(2);
                    out.extend_from_slice(&id.to_le_bytes());
                }
            }
        }
        put_len(out, self.seqs.len(), "seqs")?;
        for s in &self.seqs {
            out.extend_from_slice(&s.id.to_le_bytes());
            put_len(out, s.start, "start")?;
            let paged = matches!(s.kv, SeqKv::Blocks(_));
            out.push(u8::from(s.logits) | (u8::from(paged) << 1));
            put_len(out, s.tokens.len(), "tokens")?;
            for t in &s.tokens {
                out.extend_from_slice(&t.to_le_bytes());
            }
            match &s.kv {
                SeqKv::Blocks(b) => {
                    put_len(out, b.len(), "blocks")?;
                    for id in b {
                        out.extend_from_slice(&id.to_le_bytes());
                    }
                }
                SeqKv::Slot { capacity } => put_len(out, *capacity, "capacity")?,
            }
        }
        Ok(())
    }

    pub fn encode(&self) -> Result<Vec<u8>, PlanCodecError> {
        let mut out = Vec::with_capacity(64 + 64 * self.seqs.len());
        self.encode_into(&mut out)?;
        Ok(out)
    }

    /// Read a plan; the whole of `bytes` must be one plan.
    pub fn decode(bytes: &[u8]) -> Result<StepPlan, PlanCodecError> {
        let mut r = Reader { bytes, at: 0 };
        let magic: [u8; 4] = r.array("magic")?;
        if &magic != MAGIC {
            return Err(PlanCodecError::Magic(magic));
        }
        let version = u16::from_le_bytes(r.array("version")?);
        if version != VERSION {
            return Err(PlanCodecError::Version { got: version });
        }
        let _reserved: [u8; 2] = r.array("header")?;
        let step = r.u64("step")?;
        // The smallest op is 9 bytes, the smallest sequence 21.
        let n_ops = r.count("ops", 9)?;
        let mut ops = Vec::with_capacity(n_ops);
        for _ in 0..n_ops {
            let at = r.at;
            ops.push(match r.u8("op")? {
                0 => KvOp::CopyBlock {
                    src: r.u32("op")?,
                    dst: r.u32("op")?,
                },
                1 => KvOp::Fork {
                    parent: r.u64("op")?,
                    child: r.u64("op")?,
                },
                2 => KvOp::Free { id: r.u64("op")? },
                tag => return Err(PlanCodecError::OpTag { tag, at }),
            });
        }
        let n_seqs = r.count("seqs", 21)?;
        let mut seqs = Vec::with_capacity(n_seqs);
        for _ in 0..n_seqs {
            let id = r.u64("seq")?;
            let start = r.u32("seq")? as usize;
            let at = r.at;
            let flags = r.u8("seq")?;
            if flags & !0b11 != 0 {
                return Err(PlanCodecError::Flags { flags, at });
            }
            let n = r.count("tokens", 4)?;
            let tokens = (0..n).map(|_| r.u32("tokens")).collect::<Result<_, _>>()?;
            let kv = if flags & 0b10 != 0 {
                let n = r.count("blocks", 4)?;
                SeqKv::Blocks((0..n).map(|_| r.u32("blocks")).collect::<Result<_, _>>()?)
            } else {
                SeqKv::Slot {
                    capacity: r.u32("capacity")? as usize,
                }
            };
            seqs.push(PlannedSeq {
                id,
                start,
                tokens,
                kv,
                logits: flags & 1 != 0,
            });
        }
        if r.at != bytes.len() {
            return Err(PlanCodecError::Trailing(bytes.len() - r.at));
        }
        Ok(StepPlan { step, ops, seqs })
    }
}

fn put_len(out: &mut Vec<u8>, n: usize, what: &'static str) -> Result<(), PlanCodecError> {
    let v = u32::try_from(n).map_err(|_| PlanCodecError::TooLarge { what, value: n })?;
    out.extend_from_slice(&v.to_le_bytes());
    Ok(())
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], PlanCodecError> {
        let end = self.at.checked_add(N);
        let slice = end
            .and_then(|e| self.bytes.get(self.at..e))
            .ok_or(PlanCodecError::Truncated { at: self.at, what })?;
        self.at += N;
        let mut a = [0u8; N];
        a.copy_from_slice(slice);
        Ok(a)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, PlanCodecError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, PlanCodecError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, PlanCodecError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items of at least `min_size` bytes each, refused when the
    /// bytes left cannot hold them.
    fn count(&mut self, what: &'static str, min_size: usize) -> Result<usize, PlanCodecError> {
        let at = self.at;
        let count = self.u32(what)? as usize;
        let left = self.bytes.len() - self.at;
        if count.checked_mul(min_size).is_none_or(|n| n > left) {
            return Err(PlanCodecError::Count {
                what,
                count,
                at,
                left,
            });
        }
        Ok(count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> StepPlan {
        StepPlan {
            step: 41,
            ops: vec![
                KvOp::CopyBlock { src: 3, dst: 9 },
                KvOp::Fork {
                    parent: 1,
                    child: 2,
                },
                KvOp::Free { id: u64::MAX },
            ],
            seqs: vec![
                PlannedSeq {
                    id: 7,
                    start: 130,
                    tokens: vec![5],
                    kv: SeqKv::Blocks((0..9).collect()),
                    logits: true,
                },
                PlannedSeq {
                    id: 8,
                    start: 0,
                    tokens: (0..40).collect(),
                    kv: SeqKv::Slot { capacity: 48 },
                    logits: false,
                },
            ],
        }
    }

    #[test]
    fn a_plan_round_trips() {
        let p = plan();
        let bytes = p.encode().unwrap();
        assert_eq!(StepPlan::decode(&bytes).unwrap(), p);
        let empty = StepPlan::default();
        assert_eq!(StepPlan::decode(&empty.encode().unwrap()).unwrap(), empty);
    }

    #[test]
    fn every_truncation_and_trailing_byte_is_an_error() {
        let bytes = plan().encode().unwrap();
        for n in 0..bytes.len() {
            assert!(StepPlan::decode(&bytes[..n]).is_err(), "cut at {n}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(StepPlan::decode(&long), Err(PlanCodecError::Trailing(1)));
    }

    #[test]
    fn a_hostile_count_is_refused_before_any_allocation() {
        let mut bytes = plan().encode().unwrap();
        // The op count sits after magic, version, reserved and step.
        bytes[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            StepPlan::decode(&bytes),
            Err(PlanCodecError::Count { what: "ops", .. })
        ));
        let mut bad = plan().encode().unwrap();
        bad[0] = b'X';
        assert!(matches!(
            StepPlan::decode(&bad),
            Err(PlanCodecError::Magic(_))
        ));
        let mut tag = plan().encode().unwrap();
        tag[20] = 7;
        assert!(matches!(
            StepPlan::decode(&tag),
            Err(PlanCodecError::OpTag { tag: 7, at: 20 })
        ));
    }
}
