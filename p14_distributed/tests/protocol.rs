//! The K/V transfer protocol's encodings: a hello round-trips and each
//! mismatch is named; layers cross exactly with only filled positions on
//! the wire; a flipped bit, a wrong layer or transfer, a length the layout
//! does not allow, a refusal and a truncated stream are each refused.

use p08_continuous::kv_transfer::{KvBuffer, KvDtype, KvLayout};
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

#[test]
fn layers_cross_exactly_and_only_filled_positions_travel() {
    for tokens in [1, 4, 5, 11] {
        let src = buffer(tokens);
        let mut wire = Vec::new();
        write_accept(&mut wire, Status::Ok, tokens, b"{}").unwrap();
        let sent = write_layers(&mut wire, 5, &src, 0..3, None).unwrap();
        let l = layout();
        assert_eq!(sent, 2 * l.n_layer * l.n_kv_head * l.head_dim * tokens * 4);
        let mut r = &wire[..];
        let (t, meta) = read_accept(&mut r, 64).unwrap();
        assert_eq!((t, &meta[..]), (tokens, &b"{}"[..]));
        let mut dst = KvBuffer::zeros(layout(), t);
        let mut scratch = Vec::new();
        for layer in 0..3 {
            read_layer(&mut r, 5, layer, &mut dst, &mut scratch).unwrap();
        }
        assert!(r.is_empty());
        assert_eq!(dst, src, "{tokens} tokens");
    }
}

#[test]
fn a_flipped_bit_a_wrong_layer_or_a_huge_length_is_refused() {
    let src = buffer(6);
    let mut wire = Vec::new();
    write_layers(&mut wire, 5, &src, 0..3, Some(1)).unwrap();
    let mut r = &wire[..];
    let mut dst = KvBuffer::zeros(layout(), 6);
    let mut s = Vec::new();
    read_layer(&mut r, 5, 0, &mut dst, &mut s).unwrap();
    let e = read_layer(&mut r, 5, 1, &mut dst, &mut s).unwrap_err();
    assert!(
        matches!(e, ProtocolError::Checksum { what: "frame", .. }),
        "{e}"
    );
    // Layer 2 where 0 was due; another transfer's frame.
    let mut r = &wire[..];
    let e = read_layer(&mut r, 5, 2, &mut dst, &mut s).unwrap_err();
    assert!(matches!(e, ProtocolError::Order { got: 0, want: 2 }), "{e}");
    let mut r = &wire[..];
    let e = read_layer(&mut r, 6, 0, &mut dst, &mut s).unwrap_err();
    assert!(matches!(e, ProtocolError::Transfer { .. }), "{e}");
    // A length the layout does not allow is refused before reading.
    let mut bad = wire.clone();
    bad[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut r = &bad[..];
    let e = read_layer(&mut r, 5, 0, &mut dst, &mut s).unwrap_err();
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
    write_accept(&mut wire, Status::Ok, 1000, b"").unwrap();
    let e = read_accept(&mut &wire[..], 64).unwrap_err();
    assert!(
        matches!(e, ProtocolError::Range { what: "tokens", .. }),
        "{e}"
    );
    let mut wire = Vec::new();
    write_accept(&mut wire, Status::Layout, 0, b"").unwrap();
    let e = read_accept(&mut &wire[..], 64).unwrap_err();
    assert!(matches!(e, ProtocolError::Refused(Status::Layout)), "{e}");
    // A truncated stream is an I/O error, not a hang or a panic.
    let e = read_accept(&mut &wire[..10], 64).unwrap_err();
    assert!(matches!(e, ProtocolError::Io(_)), "{e}");
}

#[test]
fn the_bulk_payload_equals_the_float_by_float_reference() {
    for tokens in [1, 4, 7, 16] {
        let b = buffer(tokens);
        for layer in 0..3 {
            let (mut fast, mut naive) = (Vec::new(), Vec::new());
            layer_payload(&b, layer, 0, b.n_blocks(), &mut fast);
            layer_payload_naive(&b, layer, 0, b.n_blocks(), &mut naive);
            assert_eq!(fast, naive, "{tokens} tokens, layer {layer}");
        }
    }
}
