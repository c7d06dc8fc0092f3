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
//! prefill ──▶ decode   Accept  (24 B)  magic "P14A" status:u8 0:u8×3 tokens:u32
//!                                      meta_len:u32 meta_sum:u64  then meta (JSON)
//!                      Frame × n_layer (40 B + payload)
//!                                      magic "P14F" layer:u32 transfer_id:u64
//!                                      block_start:u32 block_count:u32
//!                                      len:u32 0:u32 checksum:u64  then len bytes
//! decode ──▶ prefill   Ack     (16 B)  magic "P14K" status:u8 0:u8×3 transfer_id:u64
//! ```
//!
//! A frame carries one layer's K and V for a run of blocks: per block, K
//! then V, per K/V head, the block's filled positions × head_dim floats
//! (the last block's empty slots are not sent). So a transfer of T
//! positions is exactly 2 · n_layer · n_kv_head · head_dim · T · 4 bytes
//! of payload. The checksum is XXH3-64 of the payload (the meta has its
//! own): a flipped bit anywhere is refused before the K/V is used.

use std::io::{Read, Write};

use p08_continuous::kv_transfer::{KvBuffer, KvDtype, KvLayout};
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

pub const HELLO_MAGIC: &[u8; 8] = b"P14KVXF1";
pub const VERSION: u16 = 1;
pub const HELLO_LEN: usize = 60;
const ACCEPT_MAGIC: &[u8; 4] = b"P14A";
pub const ACCEPT_LEN: usize = 24;
const FRAME_MAGIC: &[u8; 4] = b"P14F";
pub const FRAME_HEADER_LEN: usize = 40;
const ACK_MAGIC: &[u8; 4] = b"P14K";
pub const ACK_LEN: usize = 16;
/// The most meta bytes a peer may announce (a sequence's output tokens and
/// sampler state are a few kB).
pub const MAX_META: usize = 1 << 20;
/// The most payload one frame may carry.
pub const MAX_FRAME: usize = 256 << 20;

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
    #[error("K/V transfer: frame for layer {got} where layer {want} was due")]
    Order { got: u32, want: u32 },
    #[error("K/V transfer: {what} checksum {got:016x}, computed {want:016x}")]
    Checksum {
        what: &'static str,
        got: u64,
        want: u64,
    },
    #[error("K/V transfer: transfer id {got} where {want} was due")]
    Transfer { got: u64, want: u64 },
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

fn u32_of(v: usize, what: &'static str) -> Result<u32, ProtocolError> {
    u32::try_from(v).map_err(|_| ProtocolError::Range {
        what,
        got: v as u64,
        max: u32::MAX as u64,
    })
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let (a, b) = self.0.split_at(N);
        self.0 = b;
        a.try_into().unwrap_or([0; N])
    }
    fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
}

fn magic(got: &[u8], want: &[u8], what: &'static str) -> Result<(), ProtocolError> {
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

/// Payload floats of one layer for blocks `start..start + count` of a
/// transfer of `tokens` positions: only filled positions travel.
pub fn layer_floats(l: &KvLayout, tokens: usize, start: usize, count: usize) -> Option<usize> {
    let first = start.checked_mul(l.block_size)?;
    let end = first
        .checked_add(count.checked_mul(l.block_size)?)?
        .min(tokens);
    let positions = end.checked_sub(first.min(end))?;
    positions
        .checked_mul(2)?
        .checked_mul(l.n_kv_head)?
        .checked_mul(l.head_dim)
}

/// One layer's payload for blocks `start..start + count` of `buf`.
pub fn layer_payload(buf: &KvBuffer, layer: usize, start: usize, count: usize, out: &mut Vec<u8>) {
    let l = &buf.layout;
    out.clear();
    for b in start..(start + count).min(buf.n_blocks()) {
        let filled = (buf.tokens - b * l.block_size).min(l.block_size);
        let block = buf.block(b);
        for v in [false, true] {
            for h in 0..l.n_kv_head {
                let o = l.offset(layer, v, h, 0);
                put_floats(out, &block[o..o + filled * l.head_dim]);
            }
        }
    }
}

/// The same, one float at a time: the reference the fast path is tested
/// against.
pub fn layer_payload_naive(
    buf: &KvBuffer,
    layer: usize,
    start: usize,
    count: usize,
    out: &mut Vec<u8>,
) {
    let l = &buf.layout;
    out.clear();
    for b in start..(start + count).min(buf.n_blocks()) {
        let filled = (buf.tokens - b * l.block_size).min(l.block_size);
        for v in [false, true] {
            for h in 0..l.n_kv_head {
                for slot in 0..filled {
                    for d in 0..l.head_dim {
                        let x = buf.block(b)[l.offset(layer, v, h, slot) + d];
                        out.extend_from_slice(&x.to_le_bytes());
                    }
                }
            }
        }
    }
}

/// Floats as little-endian bytes: one copy of their memory on a
/// little-endian machine.
fn put_floats(out: &mut Vec<u8>, xs: &[f32]) {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: the view covers exactly `xs`'s memory, borrowed for the
        // call; every byte of an f32 is initialised.
        let bytes = unsafe {
            std::slice::from_raw_parts(xs.as_ptr().cast::<u8>(), std::mem::size_of_val(xs))
        };
        out.extend_from_slice(bytes);
    }
    #[cfg(not(target_endian = "little"))]
    for x in xs {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

/// Little-endian bytes into floats (`bytes.len() == 4 * dst.len()`).
fn get_floats(dst: &mut [f32], bytes: &[u8]) {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: the view covers exactly `dst`'s memory, exclusively
        // borrowed for the call; any 4 bytes are a valid f32.
        let d = unsafe {
            std::slice::from_raw_parts_mut(
                dst.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(dst),
            )
        };
        d.copy_from_slice(bytes);
    }
    #[cfg(not(target_endian = "little"))]
    for (x, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
        *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

/// Write a payload made by [`layer_payload`] into `buf` (sized for its
/// tokens beforehand; the lengths were checked against the layout).
fn fill_layer(buf: &mut KvBuffer, layer: usize, start: usize, count: usize, payload: &[u8]) {
    let l = buf.layout;
    let mut at = 0;
    for b in start..(start + count).min(buf.n_blocks()) {
        let filled = (buf.tokens - b * l.block_size).min(l.block_size);
        let block = buf.block_mut(b);
        for v in [false, true] {
            for h in 0..l.n_kv_head {
                let o = l.offset(layer, v, h, 0);
                let n = filled * l.head_dim;
                get_floats(&mut block[o..o + n], &payload[at..at + 4 * n]);
                at += 4 * n;
            }
        }
    }
}

/// The prefill side's answer: a status, and for Ok the tokens and meta.
pub fn write_accept(
    w: &mut impl Write,
    status: Status,
    tokens: usize,
    meta: &[u8],
) -> Result<(), ProtocolError> {
    let mut b = Vec::with_capacity(ACCEPT_LEN + meta.len());
    b.extend_from_slice(ACCEPT_MAGIC);
    b.extend_from_slice(&[status as u8, 0, 0, 0]);
    b.extend_from_slice(&u32_of(tokens, "tokens")?.to_le_bytes());
    b.extend_from_slice(&u32_of(meta.len(), "meta length")?.to_le_bytes());
    b.extend_from_slice(&xxh3_64(meta).to_le_bytes());
    b.extend_from_slice(meta);
    w.write_all(&b)?;
    Ok(())
}

/// Read an accept; Ok gives (tokens, meta). `max_tokens` bounds the
/// positions a peer may announce (the receiver's K/V capacity).
pub fn read_accept(
    r: &mut impl Read,
    max_tokens: usize,
) -> Result<(usize, Vec<u8>), ProtocolError> {
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
    let meta_len = rd.u32() as usize;
    let meta_sum = rd.u64();
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
    if meta_len > MAX_META {
        return Err(ProtocolError::Range {
            what: "meta length",
            got: meta_len as u64,
            max: MAX_META as u64,
        });
    }
    let mut meta = vec![0u8; meta_len];
    r.read_exact(&mut meta)?;
    let want = xxh3_64(&meta);
    if want != meta_sum {
        return Err(ProtocolError::Checksum {
            what: "meta",
            got: meta_sum,
            want,
        });
    }
    Ok((tokens, meta))
}

/// Send every layer of `buf`, one frame per layer (all its blocks).
/// `corrupt` flips one payload bit of that layer after its checksum (the
/// fault tests' corrupted frame).
pub fn write_layers(
    w: &mut impl Write,
    transfer_id: u64,
    buf: &KvBuffer,
    layers: std::ops::Range<usize>,
    corrupt: Option<usize>,
) -> Result<usize, ProtocolError> {
    let mut payload = Vec::new();
    let mut sent = 0;
    let n_blocks = buf.n_blocks();
    for layer in layers {
        layer_payload(buf, layer, 0, n_blocks, &mut payload);
        let sum = xxh3_64(&payload);
        if corrupt == Some(layer) && !payload.is_empty() {
            payload[0] ^= 1;
        }
        let mut h = Vec::with_capacity(FRAME_HEADER_LEN);
        h.extend_from_slice(FRAME_MAGIC);
        h.extend_from_slice(&u32_of(layer, "layer")?.to_le_bytes());
        h.extend_from_slice(&transfer_id.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&u32_of(n_blocks, "block count")?.to_le_bytes());
        h.extend_from_slice(&u32_of(payload.len(), "frame length")?.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&sum.to_le_bytes());
        w.write_all(&h)?;
        w.write_all(&payload)?;
        sent += payload.len();
    }
    Ok(sent)
}

/// Read layer `layer`'s frame into `buf` (allocated for its tokens
/// beforehand). Returns the payload bytes.
pub fn read_layer(
    r: &mut impl Read,
    transfer_id: u64,
    layer: usize,
    buf: &mut KvBuffer,
    scratch: &mut Vec<u8>,
) -> Result<usize, ProtocolError> {
    let mut h = [0u8; FRAME_HEADER_LEN];
    r.read_exact(&mut h)?;
    magic(&h[..4], FRAME_MAGIC, "frame")?;
    let mut rd = Reader(&h[4..]);
    let got_layer = rd.u32();
    let id = rd.u64();
    let start = rd.u32() as usize;
    let count = rd.u32() as usize;
    let len = rd.u32() as usize;
    let _ = rd.u32();
    let sum = rd.u64();
    if id != transfer_id {
        return Err(ProtocolError::Transfer {
            got: id,
            want: transfer_id,
        });
    }
    if got_layer as usize != layer {
        return Err(ProtocolError::Order {
            got: got_layer,
            want: layer as u32,
        });
    }
    let n_blocks = buf.n_blocks();
    if start != 0 || count != n_blocks {
        return Err(ProtocolError::Range {
            what: "frame block range end",
            got: start as u64 + count as u64,
            max: n_blocks as u64,
        });
    }
    let want = layer_floats(&buf.layout, buf.tokens, start, count)
        .and_then(|f| f.checked_mul(4))
        .filter(|&n| n <= MAX_FRAME)
        .ok_or(ProtocolError::Range {
            what: "frame",
            got: len as u64,
            max: MAX_FRAME as u64,
        })?;
    if len != want {
        return Err(ProtocolError::Range {
            what: "frame length",
            got: len as u64,
            max: want as u64,
        });
    }
    scratch.resize(len, 0);
    r.read_exact(scratch)?;
    let got = xxh3_64(scratch);
    if got != sum {
        return Err(ProtocolError::Checksum {
            what: "frame",
            got: sum,
            want: got,
        });
    }
    fill_layer(buf, layer, start, count, scratch);
    Ok(len)
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
