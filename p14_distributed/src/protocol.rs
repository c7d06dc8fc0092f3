//! The K/V transfer protocol: how a decode worker pulls a prompt's K/V
//! from the prefill worker that computed it, over one TCP connection.
//! Little-endian, fixed headers, every length checked against what the
//! layout allows before anything is allocated or read (a short, long,
//! corrupted or hostile peer is an error, never a panic or a huge buffer).
//!
//! ```text
//! decode ──▶ prefill   Hello   (60 B)  magic "P14KVXF1" version:u16 dtype:u8 0:u8
//!                                      n_layer:u32 n_kv_head:u32 head_start:u32
//!                                      head_dim:u32 block_size:u32 0:u32
//!                                      model_id:u64 transfer_id:u64 prompt_hash:u64
//! prefill ──▶ decode   Accept  (12 B)  magic "P14A" status:u8 0:u8×3 tokens:u32
//!                      Frame × ≥ n_layer, then the Trailer (see [`crate::frames`])
//! decode ──▶ prefill   Ack     (16 B)  magic "P14K" status:u8 0:u8×3 transfer_id:u64
//! ```
//!
//! The accept announces the positions before any frame, so the receiver
//! sizes its buffer first; the frames carry the K/V, layer by layer and
//! run by run of positions ([`crate::frames`]); the trailer carries the
//! sequence's sampled tokens and sampler state, last, because a prompt
//! streamed while it is being prefilled has no first token before its last
//! layer is done.

use std::io::{Read, Write};

use p08_continuous::kv_transfer::{KvDtype, KvLayout};
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

pub const HELLO_MAGIC: &[u8; 8] = b"P14KVXF1";
pub const VERSION: u16 = 2;
pub const HELLO_LEN: usize = 60;
const ACCEPT_MAGIC: &[u8; 4] = b"P14A";
pub const ACCEPT_LEN: usize = 12;
const ACK_MAGIC: &[u8; 4] = b"P14K";
pub const ACK_LEN: usize = 16;
/// The most meta bytes a peer may announce (a sequence's output tokens and
/// sampler state are a few kB).
pub const MAX_META: usize = 1 << 20;

/// What a decode worker asks for, and what it can hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub version: u16,
    pub layout: KvLayout,
    /// Model file and weight format: K/V of one is garbage to another.
    pub model_id: u64,
    pub transfer_id: u64,
    /// XXH3 of the prompt's token ids (the transfer's K/V is for them).
    pub prompt_hash: u64,
}

/// The prefill worker's answer to a hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok = 0,
    /// No such transfer: acknowledged already, its lease expired, or never.
    Unknown = 1,
    Version = 2,
    Model = 3,
    Layout = 4,
    Prompt = 5,
    /// The receiver found a bad checksum or frame (in an ack).
    Corrupt = 6,
}

impl Status {
    fn from_u8(b: u8) -> Option<Status> {
        Some(match b {
            0 => Status::Ok,
            1 => Status::Unknown,
            2 => Status::Version,
            3 => Status::Model,
            4 => Status::Layout,
            5 => Status::Prompt,
            6 => Status::Corrupt,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Unknown => "unknown transfer (acknowledged, expired, or never made)",
            Status::Version => "protocol version mismatch",
            Status::Model => "model mismatch",
            Status::Layout => "K/V layout mismatch",
            Status::Prompt => "prompt hash mismatch",
            Status::Corrupt => "corrupted frame",
        }
    }
}

#[derive(Debug, Error)]
pub enum ProtocolError {
    #[error("K/V transfer: {0}")]
    Io(#[from] std::io::Error),
    #[error("K/V transfer: bad magic {got:02x?} in {what}")]
    Magic { what: &'static str, got: Vec<u8> },
    #[error("K/V transfer: unknown {what} value {value}")]
    Field { what: &'static str, value: u64 },
    #[error("K/V transfer refused by the peer: {}", .0.as_str())]
    Refused(Status),
    #[error("K/V transfer: {what} {got} out of range (at most {max})")]
    Range {
        what: &'static str,
        got: u64,
        max: u64,
    },
    #[error("K/V transfer: layer {layer} at position {got} where position {want} was due")]
    Order { layer: u32, got: u64, want: u64 },
    #[error("K/V transfer: {what} checksum {got:016x}, computed {want:016x}")]
    Checksum {
        what: &'static str,
        got: u64,
        want: u64,
    },
    #[error("K/V transfer: transfer id {got} where {want} was due")]
    Transfer { got: u64, want: u64 },
    #[error("K/V transfer aborted by the sender: {0}")]
    Aborted(String),
}

/// XXH3 of a prompt's token ids, little-endian.
pub fn prompt_hash(tokens: &[u32]) -> u64 {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    xxh3_64(&bytes)
}

fn dtype_code(d: KvDtype) -> u8 {
    match d {
        KvDtype::F32 => 1,
    }
}

pub(crate) fn u32_of(v: usize, what: &'static str) -> Result<u32, ProtocolError> {
    u32::try_from(v).map_err(|_| ProtocolError::Range {
        what,
        got: v as u64,
        max: u32::MAX as u64,
    })
}

pub(crate) struct Reader<'a>(pub(crate) &'a [u8]);

impl Reader<'_> {
    pub(crate) fn take<const N: usize>(&mut self) -> [u8; N] {
        let (a, b) = self.0.split_at(N);
        self.0 = b;
        a.try_into().unwrap_or([0; N])
    }
    pub(crate) fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    pub(crate) fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }
    pub(crate) fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
    pub(crate) fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
}

pub(crate) fn magic(got: &[u8], want: &[u8], what: &'static str) -> Result<(), ProtocolError> {
    if got != want {
        return Err(ProtocolError::Magic {
            what,
            got: got.to_vec(),
        });
    }
    Ok(())
}

impl Hello {
    pub fn encode(&self) -> Result<[u8; HELLO_LEN], ProtocolError> {
        let l = &self.layout;
        let mut b = Vec::with_capacity(HELLO_LEN);
        b.extend_from_slice(HELLO_MAGIC);
        b.extend_from_slice(&self.version.to_le_bytes());
        b.push(dtype_code(l.dtype));
        b.push(0);
        for (v, what) in [
            (l.n_layer, "n_layer"),
            (l.n_kv_head, "n_kv_head"),
            (l.head_start, "head_start"),
            (l.head_dim, "head_dim"),
            (l.block_size, "block_size"),
        ] {
            b.extend_from_slice(&u32_of(v, what)?.to_le_bytes());
        }
        b.extend_from_slice(&0u32.to_le_bytes());
        for v in [self.model_id, self.transfer_id, self.prompt_hash] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        let mut out = [0u8; HELLO_LEN];
        out.copy_from_slice(&b); // the layout above is HELLO_LEN bytes (tested)
        Ok(out)
    }

    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, ProtocolError> {
        magic(&b[..8], HELLO_MAGIC, "hello")?;
        let mut r = Reader(&b[8..]);
        let version = r.u16();
        let dtype = match r.u8() {
            1 => KvDtype::F32,
            v => {
                return Err(ProtocolError::Field {
                    what: "dtype",
                    value: v as u64,
                })
            }
        };
        let _ = r.u8();
        let mut dims = [0usize; 5];
        for d in &mut dims {
            *d = r.u32() as usize;
        }
        let _ = r.u32();
        let layout = KvLayout {
            n_layer: dims[0],
            n_kv_head: dims[1],
            head_start: dims[2],
            head_dim: dims[3],
            block_size: dims[4],
            dtype,
        };
        Ok(Hello {
            version,
            layout,
            model_id: r.u64(),
            transfer_id: r.u64(),
            prompt_hash: r.u64(),
        })
    }

    /// Why a prefill worker holding `ours` for `model_id` refuses this
    /// hello, or Ok.
    pub fn check(&self, model_id: u64, ours: &KvLayout, prompt_hash: u64) -> Status {
        if self.version != VERSION {
            Status::Version
        } else if self.model_id != model_id {
            Status::Model
        } else if self.layout != *ours {
            Status::Layout
        } else if self.prompt_hash != prompt_hash {
            Status::Prompt
        } else {
            Status::Ok
        }
    }
}

/// The prefill side's answer: a status, and for Ok the positions.
pub fn write_accept(
    w: &mut impl Write,
    status: Status,
    tokens: usize,
) -> Result<(), ProtocolError> {
    let mut b = Vec::with_capacity(ACCEPT_LEN);
    b.extend_from_slice(ACCEPT_MAGIC);
    b.extend_from_slice(&[status as u8, 0, 0, 0]);
    b.extend_from_slice(&u32_of(tokens, "tokens")?.to_le_bytes());
    w.write_all(&b)?;
    Ok(())
}

/// Read an accept; Ok gives the positions. `max_tokens` bounds what a
/// peer may announce (the receiver's K/V capacity).
pub fn read_accept(r: &mut impl Read, max_tokens: usize) -> Result<usize, ProtocolError> {
    let mut b = [0u8; ACCEPT_LEN];
    r.read_exact(&mut b)?;
    magic(&b[..4], ACCEPT_MAGIC, "accept")?;
    let mut rd = Reader(&b[4..]);
    let status = rd.u8();
    let status = Status::from_u8(status).ok_or(ProtocolError::Field {
        what: "status",
        value: status as u64,
    })?;
    let _ = rd.take::<3>();
    let tokens = rd.u32() as usize;
    if status != Status::Ok {
        return Err(ProtocolError::Refused(status));
    }
    if tokens == 0 || tokens > max_tokens {
        return Err(ProtocolError::Range {
            what: "tokens",
            got: tokens as u64,
            max: max_tokens as u64,
        });
    }
    Ok(tokens)
}

pub fn write_ack(w: &mut impl Write, transfer_id: u64, status: Status) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(ACK_LEN);
    b.extend_from_slice(ACK_MAGIC);
    b.extend_from_slice(&[status as u8, 0, 0, 0]);
    b.extend_from_slice(&transfer_id.to_le_bytes());
    w.write_all(&b)
}

pub fn read_ack(r: &mut impl Read, transfer_id: u64) -> Result<Status, ProtocolError> {
    let mut b = [0u8; ACK_LEN];
    r.read_exact(&mut b)?;
    magic(&b[..4], ACK_MAGIC, "ack")?;
    let mut rd = Reader(&b[4..]);
    let s = rd.u8();
    let status = Status::from_u8(s).ok_or(ProtocolError::Field {
        what: "ack status",
        value: s as u64,
    })?;
    let _ = rd.take::<3>();
    let id = rd.u64();
    if id != transfer_id {
        return Err(ProtocolError::Transfer {
            got: id,
            want: transfer_id,
        });
    }
    Ok(status)
}
