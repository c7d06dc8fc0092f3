//! The K/V transfer protocol's encodings: a hello round-trips and each
//! mismatch is named; layers cross exactly with only filled positions on
//! the wire, whole or run by run as a streamed prefill sends them; a
//! flipped bit, a run out of order, a wrong transfer, a length the layout
//! does not allow, an early trailer, a refusal and a truncated stream are
//! each refused; frames land in lent blocks as in one buffer; a sender's
//! abort reaches the puller with its reason.

use p08_continuous::kv_transfer::{KvBuffer, KvDtype, KvLayout, KvLease};
use p14_distributed::frames::*;
use p14_distributed::live::Live;
use p14_distributed::protocol::*;

fn layout() -> KvLayout {
    KvLayout {
        n_layer: 3,
        n_kv_head: 2,
        head_start: 0,
        head_dim: 4,
        block_size: 4,
        dtype: KvDtype::F32,
    }
}

fn buffer(tokens: usize) -> KvBuffer {
    let mut b = KvBuffer::zeros(layout(), tokens);
    let l = layout();
    for blk in 0..b.n_blocks() {
        let filled = (tokens - blk * l.block_size).min(l.block_size);
        for layer in 0..l.n_layer {
            for v in [false, true] {
                for h in 0..l.n_kv_head {
                    let o = l.offset(layer, v, h, 0);
                    for (i, x) in b.block_mut(blk)[o..o + filled * l.head_dim]
                        .iter_mut()
                        .enumerate()
                    {
                        *x = (blk * 1000 + layer * 100 + h * 10 + i) as f32 + v as u8 as f32 * 0.5;
                    }
                }
            }
        }
    }
    b
}

#[test]
fn a_hello_round_trips_and_each_mismatch_is_named() {
    let h = Hello {
        version: VERSION,
        layout: layout(),
        model_id: 7,
        transfer_id: 99,
        prompt_hash: prompt_hash(&[1, 2, 3]),
    };
    let d = Hello::decode(&h.encode().unwrap()).unwrap();
    assert_eq!(d, h);
    assert_eq!(d.check(7, &layout(), prompt_hash(&[1, 2, 3])), Status::Ok);
    assert_eq!(d.check(8, &layout(), h.prompt_hash), Status::Model);
    let other = KvLayout {
        block_size: 16,
        ..layout()
    };
    assert_eq!(d.check(7, &other, h.prompt_hash), Status::Layout);
    assert_eq!(d.check(7, &layout(), prompt_hash(&[1, 2])), Status::Prompt);
    let old = Hello { version: 0, ..h };
    assert_eq!(old.check(7, &layout(), h.prompt_hash), Status::Version);
    let mut bytes = h.encode().unwrap();
    bytes[0] = b'X';
    assert!(matches!(
        Hello::decode(&bytes),
        Err(ProtocolError::Magic { .. })
    ));
}

/// Read frames and the trailer of one transfer into a buffer of `tokens`.
fn read_all(r: &mut &[u8], tokens: usize) -> Result<(KvBuffer, Vec<u8>, usize), ProtocolError> {
    let mut dst = KvBuffer::zeros(layout(), tokens);
    let (mut filled, mut scratch, mut bytes) = (vec![0; 3], Vec::new(), 0);
    loop {
        match read_next(r, 5, &mut dst, &mut filled, &mut scratch)? {
            Next::Frame { bytes: n, .. } => bytes += n,
            Next::Heartbeat => {}
            Next::Trailer(meta) => return Ok((dst, meta, bytes)),
        }
    }
}

#[test]
fn layers_cross_exactly_and_only_filled_positions_travel() {
    for tokens in [1, 4, 5, 11] {
        let src = buffer(tokens);
        let mut wire = Vec::new();
        write_accept(&mut wire, Status::Ok, tokens).unwrap();
        let sent = write_layers(&mut wire, 5, &src, 0..3, None).unwrap();
        write_trailer(&mut wire, b"{}").unwrap();
        let l = layout();
        assert_eq!(sent, 2 * l.n_layer * l.n_kv_head * l.head_dim * tokens * 4);
        let mut r = &wire[..];
        assert_eq!(read_accept(&mut r, 64).unwrap(), tokens);
        let (dst, meta, bytes) = read_all(&mut r, tokens).unwrap();
        assert!(r.is_empty());
        assert_eq!((&meta[..], bytes), (&b"{}"[..], sent));
        assert_eq!(dst, src, "{tokens} tokens");
    }
}

/// Rows (n, n_kv_head * head_dim) of K and V of positions `p0..p1` of one
/// layer, as a forward pass writes them.
fn rows(b: &KvBuffer, layer: usize, p0: usize, p1: usize) -> (Vec<f32>, Vec<f32>) {
    let l = b.layout;
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for p in p0..p1 {
        for h in 0..l.n_kv_head {
            for (val, out) in [(false, &mut k), (true, &mut v)] {
                let o = l.offset(layer, val, h, p % l.block_size);
                out.extend_from_slice(&b.block(p / l.block_size)[o..o + l.head_dim]);
            }
        }
    }
    (k, v)
}

#[test]
fn a_streamed_prompt_crosses_run_by_run_with_layers_interleaved() {
    // Chunks of 5 and 6 positions (not block-aligned), layers interleaved
    // as a chunked prefill writes them; a recomputed run written twice.
    let (tokens, src) = (11, buffer(11));
    let live = Live::new(layout(), tokens);
    let mut wire = Vec::new();
    let mut sent = vec![0; 3];
    let mut payload = Vec::new();
    for (p0, p1) in [(0, 5), (5, 11)] {
        for layer in 0..3 {
            let (k, v) = rows(&src, layer, p0, p1);
            live.write_rows(layer, p0, p1 - p0, &k, &v);
            live.write_rows(layer, p0, p1 - p0, &k, &v);
            let (runs, end) = live.next(&sent, std::time::Duration::ZERO);
            assert_eq!((runs, end), (vec![(layer, p0, p1)], None));
            live.with_kv(|kv| layer_payload(kv, layer, p0, p1, &mut payload));
            let h = frame_header(5, layer, (p0, p1), &mut payload, false).unwrap();
            wire.extend_from_slice(&h);
            wire.extend_from_slice(&payload);
            sent[layer] = p1;
        }
    }
    write_trailer(&mut wire, b"meta").unwrap();
    let (dst, meta, bytes) = read_all(&mut &wire[..], tokens).unwrap();
    assert_eq!(dst, src);
    assert_eq!(meta, b"meta");
    let l = layout();
    assert_eq!(bytes, 2 * l.n_layer * l.n_kv_head * l.head_dim * tokens * 4);
    // A run that skips ahead of what is held is not taken.
    let live = Live::new(layout(), tokens);
    let (k, v) = rows(&src, 0, 5, 11);
    live.write_rows(0, 5, 6, &k, &v);
    assert_eq!(live.filled(0), 0);
}

#[test]
fn a_run_out_of_order_or_an_early_trailer_is_refused() {
    let src = buffer(11);
    let mut p = Vec::new();
    // Layer 0 from position 5 where 0 was due.
    let mut wire = Vec::new();
    write_frame(&mut wire, 5, &src, 0, (5, 11), false, &mut p).unwrap();
    let e = read_all(&mut &wire[..], 11).unwrap_err();
    assert!(
        matches!(
            e,
            ProtocolError::Order {
                layer: 0,
                got: 5,
                want: 0
            }
        ),
        "{e}"
    );
    // The trailer before layer 2 is complete.
    let mut wire = Vec::new();
    write_layers(&mut wire, 5, &src, 0..2, None).unwrap();
    write_trailer(&mut wire, b"{}").unwrap();
    let e = read_all(&mut &wire[..], 11).unwrap_err();
    assert!(
        matches!(
            e,
            ProtocolError::Order {
                layer: 2,
                got: 0,
                want: 11
            }
        ),
        "{e}"
    );
    // Past the end; a layer the layout does not have.
    let mut wire = Vec::new();
    write_frame(&mut wire, 5, &src, 0, (0, 11), false, &mut p).unwrap();
    let e = read_all(&mut &wire[..], 10).unwrap_err();
    assert!(matches!(e, ProtocolError::Range { .. }), "{e}");
    let mut wire = Vec::new();
    write_frame(&mut wire, 5, &src, 0, (0, 11), false, &mut p).unwrap();
    wire[4..8].copy_from_slice(&7u32.to_le_bytes());
    let e = read_all(&mut &wire[..], 11).unwrap_err();
    assert!(
        matches!(
            e,
            ProtocolError::Range {
                what: "frame layer",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn a_flipped_bit_a_wrong_transfer_or_a_huge_length_is_refused() {
    let src = buffer(6);
    let mut wire = Vec::new();
    write_layers(&mut wire, 5, &src, 0..3, Some(1)).unwrap();
    let mut dst = KvBuffer::zeros(layout(), 6);
    let (mut filled, mut s) = (vec![0; 3], Vec::new());
    let mut r = &wire[..];
    read_next(&mut r, 5, &mut dst, &mut filled, &mut s).unwrap();
    let e = read_next(&mut r, 5, &mut dst, &mut filled, &mut s).unwrap_err();
    assert!(
        matches!(e, ProtocolError::Checksum { what: "frame", .. }),
        "{e}"
    );
    // Another transfer's frame.
    let mut filled = vec![0; 3];
    let e = read_next(&mut &wire[..], 6, &mut dst, &mut filled, &mut s).unwrap_err();
    assert!(matches!(e, ProtocolError::Transfer { .. }), "{e}");
    // A length the layout does not allow is refused before reading.
    let mut bad = wire.clone();
    bad[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
    let e = read_next(&mut &bad[..], 5, &mut dst, &mut filled, &mut s).unwrap_err();
    assert!(
        matches!(
            e,
            ProtocolError::Range {
                what: "frame length",
                ..
            }
        ),
        "{e}"
    );
    // More tokens than the receiver holds; a refusal status.
    let mut wire = Vec::new();
    write_accept(&mut wire, Status::Ok, 1000).unwrap();
    let e = read_accept(&mut &wire[..], 64).unwrap_err();
    assert!(
        matches!(e, ProtocolError::Range { what: "tokens", .. }),
        "{e}"
    );
    let mut wire = Vec::new();
    write_accept(&mut wire, Status::Layout, 0).unwrap();
    let e = read_accept(&mut &wire[..], 64).unwrap_err();
    assert!(matches!(e, ProtocolError::Refused(Status::Layout)), "{e}");
    // A truncated stream is an I/O error, not a hang or a panic.
    let e = read_accept(&mut &wire[..10], 64).unwrap_err();
    assert!(matches!(e, ProtocolError::Io(_)), "{e}");
    let e = read_all(&mut &b"P14F"[..], 6).unwrap_err();
    assert!(matches!(e, ProtocolError::Io(_)), "{e}");
}

#[test]
fn the_bulk_payload_equals_the_float_by_float_reference() {
    for tokens in [1, 4, 7, 16] {
        let b = buffer(tokens);
        for layer in 0..3 {
            let (mut fast, mut naive) = (Vec::new(), Vec::new());
            for (p0, p1) in [
                (0, tokens),
                (tokens / 3, tokens),
                (1.min(tokens - 1), tokens),
            ] {
                layer_payload(&b, layer, p0, p1, &mut fast);
                layer_payload_naive(&b, layer, p0, p1, &mut naive);
                assert_eq!(fast, naive, "{tokens} tokens, layer {layer}, {p0}..{p1}");
            }
        }
    }
}

#[test]
fn a_frame_read_in_place_equals_its_payload_copied_in() {
    // The vectored read (straight into the blocks) against the copying
    // reference, for runs that start and end inside blocks.
    for tokens in [1, 7, 16, 23] {
        let src = buffer(tokens);
        for (p0, p1) in [(0, tokens), (tokens / 2, tokens), (0, tokens.div_ceil(3))] {
            if p0 >= p1 {
                continue;
            }
            let mut p = Vec::new();
            let mut wire = Vec::new();
            write_frame(&mut wire, 5, &src, 1, (p0, p1), false, &mut p).unwrap();
            let mut got = KvBuffer::zeros(layout(), tokens);
            let mut filled = vec![0, p0, 0];
            let (mut s, mut r) = (Vec::new(), &wire[..]);
            read_next(&mut r, 5, &mut got, &mut filled, &mut s).unwrap();
            let mut want = KvBuffer::zeros(layout(), tokens);
            layer_payload_naive(&src, 1, p0, p1, &mut p);
            fill_layer(&mut want, 1, p0, p1, &p);
            assert_eq!(got, want, "{tokens} tokens, {p0}..{p1}");
            assert_eq!(filled[1], p1);
        }
    }
}

#[test]
fn frames_land_in_lent_blocks_as_in_one_buffer() {
    // A decode worker reads straight into blocks lent by its storage: one
    // allocation per block, in table order, whatever their ids.
    for tokens in [1, 4, 9, 23] {
        let src = buffer(tokens);
        let mut wire = Vec::new();
        write_layers(&mut wire, 5, &src, 0..3, None).unwrap();
        write_trailer(&mut wire, b"{}").unwrap();
        let l = layout();
        let n = tokens.div_ceil(l.block_size);
        let mut lease = KvLease {
            layout: l,
            tokens,
            blocks: (0..n)
                .map(|i| {
                    (
                        (n - i) as u32 * 7,
                        vec![0.0f32; l.block_floats()].into_boxed_slice(),
                    )
                })
                .collect(),
        };
        let (mut filled, mut scratch, mut r) = (vec![0; 3], Vec::new(), &wire[..]);
        loop {
            match read_next(&mut r, 5, &mut lease, &mut filled, &mut scratch).unwrap() {
                Next::Trailer(_) => break,
                _ => continue,
            }
        }
        for (i, (_, mem)) in lease.blocks.iter().enumerate() {
            assert_eq!(&mem[..], src.block(i), "{tokens} tokens, block {i}");
        }
        // Too few blocks for the frames' positions: refused, not a panic.
        let mut short = KvLease {
            layout: l,
            tokens,
            blocks: Vec::new(),
        };
        let e = read_next(&mut &wire[..], 5, &mut short, &mut [0; 3], &mut scratch);
        assert!(matches!(e, Err(ProtocolError::Range { .. })), "{e:?}");
    }
}

#[test]
fn an_abort_says_why_and_a_huge_reason_is_refused() {
    let mut wire = Vec::new();
    write_heartbeat(&mut wire).unwrap();
    write_abort(&mut wire, "the prefill was dropped").unwrap();
    let mut dst = KvBuffer::zeros(layout(), 4);
    let (mut filled, mut s, mut r) = (vec![0; 3], Vec::new(), &wire[..]);
    assert!(matches!(
        read_next(&mut r, 5, &mut dst, &mut filled, &mut s),
        Ok(Next::Heartbeat)
    ));
    let e = read_next(&mut r, 5, &mut dst, &mut filled, &mut s).unwrap_err();
    assert!(
        matches!(&e, ProtocolError::Aborted(w) if w == "the prefill was dropped"),
        "{e:?}"
    );
    // A reason is cut to its limit on a character boundary.
    let mut wire = Vec::new();
    write_abort(&mut wire, &"é".repeat(MAX_REASON)).unwrap();
    let e = read_next(&mut &wire[..], 5, &mut dst, &mut filled, &mut s).unwrap_err();
    assert!(
        matches!(&e, ProtocolError::Aborted(w) if w.len() == MAX_REASON),
        "{e:?}"
    );
    // A length past the limit is refused before anything is allocated.
    let mut bad = b"P14X".to_vec();
    bad.extend_from_slice(&u32::MAX.to_le_bytes());
    let e = read_next(&mut &bad[..], 5, &mut dst, &mut filled, &mut s).unwrap_err();
    assert!(
        matches!(
            e,
            ProtocolError::Range {
                what: "abort reason length",
                ..
            }
        ),
        "{e:?}"
    );
}

/// A K/V server on loopback (model id 7, a 10 s lease), and its address.
fn kv_server() -> (std::sync::Arc<p14_distributed::kv_server::KvServer>, String) {
    use p14_distributed::kv_server::{Faults, KvServer};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = KvServer::start(
        listener,
        addr.clone(),
        7,
        layout(),
        std::time::Duration::from_secs(10),
        Faults::default(),
    );
    (server, addr)
}

#[test]
fn a_failed_live_transfer_reaches_its_puller_as_the_senders_reason() {
    use p14_distributed::wire::TransferHandle;
    let (server, addr) = kv_server();
    let prompt = [1, 2, 3, 4, 5];
    let (id, live) = server.open_live(prompt.len(), prompt_hash(&prompt));
    let handle = TransferHandle {
        kv_addr: addr,
        transfer_id: id,
        prompt_hash: prompt_hash(&prompt),
        tokens: prompt.len(),
        lease_ms: 10_000,
    };
    let failer = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(200));
        live.fail("the prefill ran out of memory".into());
    });
    let mut dst = KvBuffer::zeros(layout(), prompt.len());
    let e =
        p14_distributed::kv_client::pull(&handle, &mut dst, 7, std::time::Duration::from_secs(5))
            .unwrap_err();
    failer.join().unwrap();
    assert!(
        matches!(&e, ProtocolError::Aborted(w) if w == "the prefill ran out of memory"),
        "{e:?}"
    );
}

#[test]
fn a_storm_of_connections_is_bounded_and_the_server_serves_after_it() {
    use p14_distributed::kv_server::MAX_CONNECTIONS;
    use std::io::Read;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};
    let (server, addr) = kv_server();
    let until = |what: &str, ok: &dyn Fn() -> bool| {
        let t0 = Instant::now();
        while !ok() {
            assert!(t0.elapsed() < Duration::from_secs(5), "{what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    // Silent peers: each holds a connection (and its thread) until its
    // read deadline.
    let idle: Vec<_> = (0..MAX_CONNECTIONS)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    until("every silent peer counted", &|| {
        server.stats.connections.load(Ordering::SeqCst) == MAX_CONNECTIONS
    });
    // One more is closed at once: no thread, no wait.
    let mut extra = std::net::TcpStream::connect(&addr).unwrap();
    extra
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut b = [0u8; 1];
    assert_eq!(extra.read(&mut b).unwrap_or(0), 0, "closed, not served");
    assert_eq!(server.stats.turned_away.load(Ordering::SeqCst), 1);
    // The storm gone, their threads end and a pull is served again.
    drop(idle);
    until("every silent peer's thread ended", &|| {
        server.stats.connections.load(Ordering::SeqCst) == 0
    });
    let prompt = [1, 2, 3];
    let hash = prompt_hash(&prompt);
    let id = server.hold(buffer(prompt.len()), hash, Vec::new());
    let handle = p14_distributed::wire::TransferHandle {
        kv_addr: addr,
        transfer_id: id,
        prompt_hash: hash,
        tokens: prompt.len(),
        lease_ms: 10_000,
    };
    let mut dst = KvBuffer::zeros(layout(), prompt.len());
    p14_distributed::kv_client::pull(&handle, &mut dst, 7, Duration::from_secs(5))
        .expect("served after the storm");
}
