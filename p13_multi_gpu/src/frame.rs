//! What travels between ranks: a 20-byte frame header before every payload,
//! and a 32-byte hello each side of a new link sends first.
//!
//! ```text
//! frame   op u8 | 0 0 0 | seq u64 | len u64 | payload (len bytes)      little-endian
//! hello   "ILCM" | version u16 | 0 0 | world u32 | rank u32 | job token u64 | layout hash u64
//! ```
//!
//! A receiver knows which operation, which number and (except for a
//! broadcast or a point-to-point message) how many bytes it waits for, so
//! a header that says anything else is refused before its payload is read.

use crate::comm::{CommError, Op};

pub const HEADER_BYTES: usize = 20;
pub const HELLO_BYTES: usize = 32;
pub const MAGIC: [u8; 4] = *b"ILCM";
/// Bumped whenever the frame or hello layout changes.
pub const PROTOCOL_VERSION: u16 = 1;
/// The largest payload a rank accepts (a length read from a socket is
/// checked against it before anything is allocated).
pub const MAX_PAYLOAD: u64 = 1 << 31;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub op: u8,
    pub seq: u64,
    pub len: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0] = self.op;
        b[4..12].copy_from_slice(&self.seq.to_le_bytes());
        b[12..20].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HEADER_BYTES]) -> Header {
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        Header {
            op: b[0],
            seq: u64_at(4),
            len: u64_at(12),
        }
    }
}

/// A frame to send: its header and payload, to one peer.
#[derive(Clone, Copy, Debug)]
pub struct Outgoing<'a> {
    pub peer: usize,
    pub op: Op,
    pub seq: u64,
    pub payload: &'a [u8],
}

/// A frame to receive from one peer: the operation and number it must
/// carry, its exact length if known, and where its payload goes.
#[derive(Debug)]
pub struct Expected<'a> {
    pub peer: usize,
    pub op: Op,
    pub seq: u64,
    pub len: Option<u64>,
    pub into: &'a mut Vec<u8>,
}

impl Expected<'_> {
    /// Accept `h` or say why not (out of order, wrong or oversized length).
    pub fn check(&self, rank: usize, h: &Header) -> Result<(), CommError> {
        if h.op != self.op as u8 || h.seq != self.seq {
            let got = match Op::from_u8(h.op) {
                Some(op) => format!("{op:?} #{}", h.seq),
                None => format!("an unknown operation {} #{}", h.op, h.seq),
            };
            return Err(CommError::OutOfOrder {
                rank,
                peer: self.peer,
                op: self.op,
                seq: self.seq,
                got,
            });
        }
        let want = self.len.unwrap_or(MAX_PAYLOAD);
        if (self.len.is_some() && h.len != want) || h.len > MAX_PAYLOAD {
            return Err(CommError::Length {
                rank,
                peer: self.peer,
                op: self.op,
                seq: self.seq,
                got: h.len,
                want,
            });
        }
        Ok(())
    }
}

/// What each side of a new link says first. Both sides send theirs and
/// check the other's: a different protocol version, job token, world
/// size or model/shard layout is refused on both ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub version: u16,
    pub world: u32,
    pub rank: u32,
    /// Chosen by whoever starts the job, so ranks of two jobs on one host
    /// never join each other.
    pub token: u64,
    /// A hash of the model file and the shard layout the rank loaded.
    pub layout: u64,
}

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_BYTES] {
        let mut b = [0u8; HELLO_BYTES];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[8..12].copy_from_slice(&self.world.to_le_bytes());
        b[12..16].copy_from_slice(&self.rank.to_le_bytes());
        b[16..24].copy_from_slice(&self.token.to_le_bytes());
        b[24..32].copy_from_slice(&self.layout.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HELLO_BYTES], peer: &str) -> Result<Hello, CommError> {
        if b[0..4] != MAGIC {
            return Err(CommError::Handshake {
                peer: peer.to_string(),
                reason: format!("not a rank of this program (magic {:02x?})", &b[0..4]),
            });
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        Ok(Hello {
            version: u16::from_le_bytes([b[4], b[5]]),
            world: u32_at(8),
            rank: u32_at(12),
            token: u64_at(16),
            layout: u64_at(24),
        })
    }

    /// Whether `other` may join `self`'s job (its rank is checked by the
    /// caller, who knows which rank it expects).
    pub fn agree(&self, other: &Hello, peer: &str) -> Result<(), CommError> {
        let refuse = |reason: String| {
            Err(CommError::Handshake {
                peer: peer.to_string(),
                reason,
            })
        };
        if other.version != self.version {
            return refuse(format!(
                "protocol version {} here, {} there",
                self.version, other.version
            ));
        }
        if other.token != self.token {
            return refuse("a different job token: that rank belongs to another job".into());
        }
        if other.world != self.world {
            return refuse(format!(
                "world size {} here, {} there",
                self.world, other.world
            ));
        }
        if other.layout != self.layout {
            return refuse(format!(
                "model/shard layout hash {:016x} here, {:016x} there: the ranks loaded different models or splits",
                self.layout, other.layout
            ));
        }
        if other.rank >= self.world {
            return refuse(format!("rank {} in a world of {}", other.rank, self.world));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_hellos_round_trip() {
        let h = Header {
            op: Op::AllReduce as u8,
            seq: 7,
            len: 2304,
        };
        assert_eq!(Header::decode(&h.encode()), h);
        let hello = Hello {
            version: PROTOCOL_VERSION,
            world: 3,
            rank: 2,
            token: 0xdead_beef,
            layout: 42,
        };
        assert_eq!(Hello::decode(&hello.encode(), "x").unwrap(), hello);
        let mut bad = hello.encode();
        bad[0] = b'X';
        assert!(Hello::decode(&bad, "x").is_err());
    }

    #[test]
    fn a_frame_of_another_collective_or_length_is_refused() {
        let mut buf = Vec::new();
        let e = Expected {
            peer: 1,
            op: Op::AllReduce,
            seq: 3,
            len: Some(8),
            into: &mut buf,
        };
        let ok = Header {
            op: Op::AllReduce as u8,
            seq: 3,
            len: 8,
        };
        assert!(e.check(0, &ok).is_ok());
        let other = Header {
            op: Op::Broadcast as u8,
            ..ok
        };
        assert!(matches!(
            e.check(0, &other),
            Err(CommError::OutOfOrder { .. })
        ));
        assert!(matches!(
            e.check(0, &Header { seq: 4, ..ok }),
            Err(CommError::OutOfOrder { .. })
        ));
        assert!(matches!(
            e.check(0, &Header { len: 9, ..ok }),
            Err(CommError::Length { .. })
        ));
        let any = Expected { len: None, ..e };
        assert!(matches!(
            any.check(
                0,
                &Header {
                    len: MAX_PAYLOAD + 1,
                    ..ok
                }
            ),
            Err(CommError::Length { .. })
        ));
    }

    #[test]
    fn hellos_of_another_job_world_or_layout_disagree() {
        let a = Hello {
            version: PROTOCOL_VERSION,
            world: 3,
            rank: 0,
            token: 1,
            layout: 9,
        };
        assert!(a.agree(&Hello { rank: 1, ..a }, "p").is_ok());
        for b in [
            Hello { token: 2, ..a },
            Hello { world: 2, ..a },
            Hello { layout: 8, ..a },
            Hello { version: 2, ..a },
            Hello { rank: 3, ..a },
        ] {
            assert!(a.agree(&b, "p").is_err(), "{b:?}");
        }
    }
}
