//! The frames of a transfer, and the trailer after them.
//!
//! A frame carries one layer's K and V for a run of positions
//! `pos_start..pos_start + pos_count`: per block the run touches, K then
//! V, per K/V head, that block's positions of the run × head_dim floats.
//! A held buffer goes as one frame per layer (every position); a prompt
//! still being prefilled goes as its layers are written, several frames
//! per layer (one per prefill chunk), layers interleaved. Per layer the
//! runs must arrive in order and touching (0.., then where the last one
//! ended): every position of every layer exactly once, so a transfer of
//! T positions is exactly 2 · n_layer · n_kv_head · head_dim · T · 4
//! bytes of payload. The checksum is XXH3-64 of the payload.
//!
//! The trailer comes last, once every layer is complete: the sequence's
//! meta (its sampled tokens and sampler state, JSON) with its own
//! checksum. It comes last because a prompt streamed while it is
//! prefilled has no first token until its last layer is done.
//!
//! ```text
//! Frame    (40 B + payload)  magic "P14F" layer:u32 transfer_id:u64
//!                            pos_start:u32 pos_count:u32 len:u32 0:u32
//!                            checksum:u64  then len bytes
//! Trailer  (16 B + meta)     magic "P14M" meta_len:u32 meta_sum:u64
//!                            then meta_len bytes
//! Heartbeat (4 B)            magic "P14H"
//! Abort    (8 B + reason)    magic "P14X" reason_len:u32 then reason
//!                            (UTF-8, at most 4 KiB): the sender gives up
//! ```

use std::io::{IoSlice, IoSliceMut, Read, Write};

use p08_continuous::kv_transfer::{KvBlocksMut, KvBuffer, KvLayout};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use crate::protocol::{magic, u32_of, ProtocolError, Reader, MAX_META};

const FRAME_MAGIC: &[u8; 4] = b"P14F";
pub const FRAME_HEADER_LEN: usize = 40;
const TRAILER_MAGIC: &[u8; 4] = b"P14M";
/// Sent alone, every second, while a prefill still running has nothing
/// new: the receiver's deadline counts from the last word it heard.
const HEARTBEAT_MAGIC: &[u8; 4] = b"P14H";
pub const TRAILER_LEN: usize = 16;
/// Sent instead of the rest of a transfer the sender cannot finish (a
/// streamed prefill that failed): the receiver's error says why, not
/// only that the connection closed.
const ABORT_MAGIC: &[u8; 4] = b"P14X";
/// The longest reason an abort carries.
pub const MAX_REASON: usize = 4096;
/// The most payload one frame may carry.
pub const MAX_FRAME: usize = 256 << 20;

/// Payload floats of one layer for `count` positions.
pub fn frame_floats(l: &KvLayout, count: usize) -> Option<usize> {
    count
        .checked_mul(2)?
        .checked_mul(l.n_kv_head)?
        .checked_mul(l.head_dim)
}

/// The blocks positions `p0..p1` touch, each with its slots in the run:
/// (block, first slot, slots).
fn runs(l: &KvLayout, p0: usize, p1: usize) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    let bs = l.block_size.max(1);
    (p0 / bs..p1.div_ceil(bs)).map(move |b| {
        let lo = p0.max(b * bs);
        let hi = p1.min((b + 1) * bs);
        (b, lo - b * bs, hi - lo)
    })
}

/// One layer's payload for positions `p0..p1` of `buf`.
pub fn layer_payload(buf: &KvBuffer, layer: usize, p0: usize, p1: usize, out: &mut Vec<u8>) {
    let l = &buf.layout;
    out.clear();
    for (b, slot, n) in runs(l, p0, p1) {
        let block = buf.block(b);
        for v in [false, true] {
            for h in 0..l.n_kv_head {
                let o = l.offset(layer, v, h, slot);
                put_floats(out, &block[o..o + n * l.head_dim]);
            }
        }
    }
}

/// The same, one float at a time: the reference the fast path is tested
/// against.
pub fn layer_payload_naive(buf: &KvBuffer, layer: usize, p0: usize, p1: usize, out: &mut Vec<u8>) {
    let l = &buf.layout;
    out.clear();
    let bs = l.block_size;
    for b in 0..buf.n_blocks() {
        for v in [false, true] {
            for h in 0..l.n_kv_head {
                for slot in 0..bs {
                    let p = b * bs + slot;
                    if p < p0 || p >= p1 {
                        continue;
                    }
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

/// The payload of positions `p0..p1` of `layer` as it lies in blocks:
/// (block, offset in the block, floats), one per block touched, K/V and
/// head, in payload order. Blocks only grow, and offsets within a block
/// only grow, so they can be carved out of the blocks in one pass.
fn payload_spans(l: &KvLayout, layer: usize, p0: usize, p1: usize) -> Vec<(usize, usize, usize)> {
    let mut spans = Vec::new();
    for (b, slot, n) in runs(l, p0, p1) {
        for v in [false, true] {
            for h in 0..l.n_kv_head {
                spans.push((b, l.offset(layer, v, h, slot), n * l.head_dim));
            }
        }
    }
    spans
}

/// A float slice's memory as bytes (the wire is little-endian, as this
/// machine is: the frame paths below are for little-endian machines; the
/// others take [`layer_payload`]'s copy).
#[cfg(target_endian = "little")]
fn as_bytes(xs: &[f32]) -> &[u8] {
    // SAFETY: the view covers exactly `xs`'s memory, borrowed as long as
    // `xs`; every byte of an f32 is initialised.
    unsafe { std::slice::from_raw_parts(xs.as_ptr().cast::<u8>(), std::mem::size_of_val(xs)) }
}

#[cfg(target_endian = "little")]
fn as_bytes_mut(xs: &mut [f32]) -> &mut [u8] {
    // SAFETY: as above, exclusively borrowed; any 4 bytes are a valid f32.
    unsafe {
        std::slice::from_raw_parts_mut(xs.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(xs))
    }
}

/// The most slices one vectored call takes (Linux's IOV_MAX).
const IOV_MAX: usize = 1024;

/// Fill every slice of `bufs` from `r`, vectored: the kernel copies
/// straight into them (a `BufReader` with nothing buffered passes a large
/// vectored read through).
fn read_exact_vectored(r: &mut impl Read, mut bufs: &mut [IoSliceMut<'_>]) -> std::io::Result<()> {
    while !bufs.is_empty() {
        let k = bufs.len().min(IOV_MAX);
        match r.read_vectored(&mut bufs[..k]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => IoSliceMut::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_all_vectored(w: &mut impl Write, mut bufs: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    while !bufs.is_empty() {
        let k = bufs.len().min(IOV_MAX);
        match w.write_vectored(&bufs[..k]) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Write a payload made by [`layer_payload`] into `buf` (the lengths were
/// checked against the layout): the copying path, and the reference the
/// vectored read is tested against.
pub fn fill_layer(buf: &mut impl KvBlocksMut, layer: usize, p0: usize, p1: usize, payload: &[u8]) {
    let l = *buf.layout();
    let mut blocks = buf.blocks_mut();
    let mut at = 0;
    for (b, slot, n) in runs(&l, p0, p1) {
        let block = &mut *blocks[b];
        for v in [false, true] {
            for h in 0..l.n_kv_head {
                let o = l.offset(layer, v, h, slot);
                let f = n * l.head_dim;
                get_floats(&mut block[o..o + f], &payload[at..at + 4 * f]);
                at += 4 * f;
            }
        }
    }
}

/// The header of a frame of positions `p0..p1` of `layer` whose payload
/// (made by [`layer_payload`]) is `payload`; `corrupt` then flips one
/// payload bit (the fault tests' corrupted frame).
pub fn frame_header(
    transfer_id: u64,
    layer: usize,
    span: (usize, usize),
    payload: &mut [u8],
    corrupt: bool,
) -> Result<Vec<u8>, ProtocolError> {
    let sum = xxh3_64(payload);
    if corrupt && !payload.is_empty() {
        payload[0] ^= 1;
    }
    header(transfer_id, layer, span, payload.len(), sum)
}

fn header(
    transfer_id: u64,
    layer: usize,
    (p0, p1): (usize, usize),
    len: usize,
    sum: u64,
) -> Result<Vec<u8>, ProtocolError> {
    let mut h = Vec::with_capacity(FRAME_HEADER_LEN);
    h.extend_from_slice(FRAME_MAGIC);
    h.extend_from_slice(&u32_of(layer, "layer")?.to_le_bytes());
    h.extend_from_slice(&transfer_id.to_le_bytes());
    h.extend_from_slice(&u32_of(p0, "frame start")?.to_le_bytes());
    h.extend_from_slice(&u32_of(p1 - p0, "frame positions")?.to_le_bytes());
    h.extend_from_slice(&u32_of(len, "frame length")?.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&sum.to_le_bytes());
    Ok(h)
}

/// Send positions `p0..p1` of `layer` of `buf` as one frame. Returns the
/// payload bytes. The payload goes from `buf`'s memory to the socket in
/// vectored writes (hashed in place first: no copy of ours); `payload`
/// is the copy the corrupting fault, and big-endian machines, build.
pub fn write_frame(
    w: &mut impl Write,
    transfer_id: u64,
    buf: &KvBuffer,
    layer: usize,
    span: (usize, usize),
    corrupt: bool,
    payload: &mut Vec<u8>,
) -> Result<usize, ProtocolError> {
    #[cfg(target_endian = "little")]
    if !corrupt {
        let spans = payload_spans(&buf.layout, layer, span.0, span.1);
        let parts: Vec<&[u8]> = spans
            .iter()
            .map(|&(b, o, n)| as_bytes(&buf.block(b)[o..o + n]))
            .collect();
        let mut hasher = Xxh3::new();
        for p in &parts {
            hasher.update(p);
        }
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let h = header(transfer_id, layer, span, len, hasher.digest())?;
        w.write_all(&h)?;
        let mut io: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
        write_all_vectored(w, &mut io)?;
        return Ok(len);
    }
    layer_payload(buf, layer, span.0, span.1, payload);
    let h = frame_header(transfer_id, layer, span, payload, corrupt)?;
    w.write_all(&h)?;
    w.write_all(payload)?;
    Ok(payload.len())
}

/// Every position of `layers` of a held buffer, one frame per layer;
/// `corrupt`: that layer's frame has a flipped bit.
pub fn write_layers(
    w: &mut impl Write,
    transfer_id: u64,
    buf: &KvBuffer,
    layers: std::ops::Range<usize>,
    corrupt: Option<usize>,
) -> Result<usize, ProtocolError> {
    let mut payload = Vec::new();
    let mut sent = 0;
    for layer in layers {
        let bad = corrupt == Some(layer);
        let span = (0, buf.tokens);
        sent += write_frame(w, transfer_id, buf, layer, span, bad, &mut payload)?;
    }
    Ok(sent)
}

pub fn write_trailer(w: &mut impl Write, meta: &[u8]) -> Result<(), ProtocolError> {
    let mut b = Vec::with_capacity(TRAILER_LEN + meta.len());
    b.extend_from_slice(TRAILER_MAGIC);
    b.extend_from_slice(&u32_of(meta.len(), "meta length")?.to_le_bytes());
    b.extend_from_slice(&xxh3_64(meta).to_le_bytes());
    b.extend_from_slice(meta);
    w.write_all(&b)?;
    Ok(())
}

/// What [`read_next`] read.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// A frame of `layer`: `bytes` of payload, now in the buffer.
    Frame { layer: usize, bytes: usize },
    /// The trailer: the transfer is complete; its meta.
    Trailer(Vec<u8>),
    /// Nothing new yet: the sender is alive.
    Heartbeat,
}

pub fn write_heartbeat(w: &mut impl Write) -> std::io::Result<()> {
    w.write_all(HEARTBEAT_MAGIC)
}

/// Give up a transfer mid-way, saying why (cut to [`MAX_REASON`] bytes
/// on a character boundary).
pub fn write_abort(w: &mut impl Write, why: &str) -> std::io::Result<()> {
    let mut end = why.len().min(MAX_REASON);
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    w.write_all(ABORT_MAGIC)?;
    w.write_all(&(end as u32).to_le_bytes())?;
    w.write_all(&why.as_bytes()[..end])
}

fn read_abort(r: &mut impl Read) -> ProtocolError {
    let mut b = [0u8; 4];
    if let Err(e) = r.read_exact(&mut b) {
        return e.into();
    }
    let n = u32::from_le_bytes(b) as usize;
    if n > MAX_REASON {
        return ProtocolError::Range {
            what: "abort reason length",
            got: n as u64,
            max: MAX_REASON as u64,
        };
    }
    let mut why = vec![0u8; n];
    if let Err(e) = r.read_exact(&mut why) {
        return e.into();
    }
    ProtocolError::Aborted(String::from_utf8_lossy(&why).into_owned())
}

/// Read the next frame into `buf` (sized for its tokens beforehand) or
/// the trailer. `filled[layer]` is how many positions of each layer have
/// arrived: a frame must start there; the trailer must find every layer
/// complete.
pub fn read_next(
    r: &mut impl Read,
    transfer_id: u64,
    buf: &mut impl KvBlocksMut,
    filled: &mut [usize],
    scratch: &mut Vec<u8>,
) -> Result<Next, ProtocolError> {
    let mut m = [0u8; 4];
    r.read_exact(&mut m)?;
    if &m == TRAILER_MAGIC {
        return read_trailer(r, buf.tokens(), filled).map(Next::Trailer);
    }
    if &m == HEARTBEAT_MAGIC {
        return Ok(Next::Heartbeat);
    }
    if &m == ABORT_MAGIC {
        return Err(read_abort(r));
    }
    magic(&m, FRAME_MAGIC, "frame")?;
    let mut h = [0u8; FRAME_HEADER_LEN - 4];
    r.read_exact(&mut h)?;
    let mut rd = Reader(&h);
    let layer = rd.u32() as usize;
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
    let (layout, tokens) = (*buf.layout(), buf.tokens());
    let n_layer = layout.n_layer;
    let Some(done) = filled.get(layer).copied() else {
        return Err(ProtocolError::Range {
            what: "frame layer",
            got: layer as u64,
            max: n_layer.saturating_sub(1) as u64,
        });
    };
    if start != done {
        return Err(ProtocolError::Order {
            layer: layer as u32,
            got: start as u64,
            want: done as u64,
        });
    }
    let end = start
        .checked_add(count)
        .filter(|&e| count > 0 && e <= tokens);
    let Some(end) = end else {
        return Err(ProtocolError::Range {
            what: "frame positions end",
            got: start as u64 + count as u64,
            max: tokens as u64,
        });
    };
    let want = frame_floats(&layout, count)
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
    let got = read_payload(r, buf, layer, (start, end), len, scratch)?;
    if got != sum {
        return Err(ProtocolError::Checksum {
            what: "frame",
            got: sum,
            want: got,
        });
    }
    filled[layer] = end;
    Ok(Next::Frame { layer, bytes: len })
}

/// Read a frame's payload (`len` bytes, checked) into its place in `buf`;
/// its XXH3. On a little-endian machine the kernel copies it straight into
/// the blocks (vectored) and it is hashed there; otherwise through
/// `scratch`. A bad checksum leaves garbage in those positions, which the
/// caller then refuses whole.
fn read_payload(
    r: &mut impl Read,
    buf: &mut impl KvBlocksMut,
    layer: usize,
    (p0, p1): (usize, usize),
    len: usize,
    scratch: &mut Vec<u8>,
) -> Result<u64, ProtocolError> {
    #[cfg(target_endian = "little")]
    {
        let spans_layout = *buf.layout();
        let spans = payload_spans(&spans_layout, layer, p0, p1);
        debug_assert_eq!(spans.iter().map(|s| s.2 * 4).sum::<usize>(), len);
        let mut blocks = buf.blocks_mut();
        let n_blocks = blocks.len() as u64;
        let buf_floats = spans_layout.block_floats();
        let mut parts: Vec<&mut [u8]> = Vec::with_capacity(spans.len());
        // (block, what is left of it, where that starts)
        let mut cur: Option<(usize, &mut [f32], usize)> = None;
        for (b, o, n) in spans {
            let (rest, at) = match cur.take() {
                Some((cb, rest, at)) if cb == b => (rest, at),
                _ => {
                    let bf = buf_floats;
                    let blk = blocks
                        .get_mut(b)
                        .map(std::mem::take)
                        .filter(|x| x.len() == bf);
                    (
                        blk.ok_or(ProtocolError::Range {
                            what: "frame block (the receiver's whole blocks)",
                            got: b as u64,
                            max: n_blocks.saturating_sub(1),
                        })?,
                        0,
                    )
                }
            };
            let (_, tail) = rest.split_at_mut(o - at);
            let (part, tail) = tail.split_at_mut(n);
            parts.push(as_bytes_mut(part));
            cur = Some((b, tail, o + n));
        }
        let mut io: Vec<IoSliceMut<'_>> = parts.iter_mut().map(|p| IoSliceMut::new(p)).collect();
        read_exact_vectored(r, &mut io)?;
        let mut hasher = Xxh3::new();
        for p in &parts {
            hasher.update(p);
        }
        let _ = scratch;
        Ok(hasher.digest())
    }
    #[cfg(not(target_endian = "little"))]
    {
        scratch.resize(len, 0);
        r.read_exact(scratch)?;
        let got = xxh3_64(scratch);
        fill_layer(buf, layer, p0, p1, scratch);
        Ok(got)
    }
}

fn read_trailer(
    r: &mut impl Read,
    tokens: usize,
    filled: &[usize],
) -> Result<Vec<u8>, ProtocolError> {
    if let Some((layer, &got)) = filled.iter().enumerate().find(|(_, &f)| f != tokens) {
        return Err(ProtocolError::Order {
            layer: layer as u32,
            got: got as u64,
            want: tokens as u64,
        });
    }
    let mut b = [0u8; TRAILER_LEN - 4];
    r.read_exact(&mut b)?;
    let mut rd = Reader(&b);
    let meta_len = rd.u32() as usize;
    let meta_sum = rd.u64();
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
    Ok(meta)
}
