//! Disaggregated serving gives what one engine gives: every token, its
//! text, its log-probability and its top alternatives, bit for bit
//! (the serving core is batch-invariant, so which worker and which
//! neighbours a sequence had change nothing), on native and f32 weights,
//! with one and with two workers of each role. Every transfer moves
//! exactly 2 · L · n_kv · head_dim · T · 4 bytes, and nothing stays held.
//! The same when the K/V streams layer by layer while the prompt is
//! prefilled (its second round hits the prefill worker's prefix cache, so
//! the cached positions are sent from its blocks). Pulls land in the
//! decode worker's own reserved blocks; the same when they land in a
//! buffer (`--land-in buffer`) and when the decode worker is so short of
//! blocks that some must.

mod support;

use common::engine::Engine;
use p14_distributed::registry::Role;
use p14_distributed::wire::LoadFailurePolicy;
use support::*;

/// Where the decode workers' pulls are to have landed.
#[derive(Clone, Copy, PartialEq)]
enum Lands {
    /// Every one in its reserved blocks (blocks are plenty).
    Blocks,
    /// Every one in a buffer (`--land-in buffer`).
    Buffer,
    /// Blocks are short: a pull may find none free and land in a buffer.
    Short,
}

fn check(weights: &str, prefill: usize, decode: usize) {
    check_with(weights, prefill, decode, false, &[], Lands::Blocks)
}

fn check_with(
    weights: &str,
    prefill: usize,
    decode: usize,
    layerwise: bool,
    decode_args: &[&str],
    lands: Lands,
) {
    let none: &[&str] = &[];
    let p = vec![none; prefill];
    let d = vec![decode_args; decode];
    let rig = rig_with(weights, 1, &p, &d, LoadFailurePolicy::Fail, layerwise);
    let one = colocated(weights);
    let mut want_bytes = 0;
    // Sequential first, then all at once (they share the workers' steps).
    let reqs: Vec<_> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, t)| request(i, t, 12))
        .collect();
    for r in &reqs {
        let want = collect(&one, r.clone());
        let got = rig.run(r.clone());
        assert_eq!(tokens(&want), 12);
        assert_eq!(got, want, "{weights} {prefill}P{decode}D: {:?}", r.prompt);
        want_bytes += kv_bytes(prompt_tokens(&got));
    }
    // Counters, summed over the workers of a role once they are idle.
    let stats = |role: Role, key: &str| -> u64 {
        let idle = match role {
            Role::Prefill => "transfers_held",
            Role::Decode => "running",
        };
        rig.workers
            .iter()
            .filter(|w| w.role == role)
            .map(|w| wait_stat(&rig, w, idle, 0)[key].as_u64().unwrap_or(0))
            .sum()
    };
    // Then all at once, repeated (at most 5 rounds) where the shortage
    // path must be taken: which pulls find no free block depends on
    // timing, so a round may not find the worker short.
    let max_rounds = if lands == Lands::Short { 5 } else { 1 };
    let mut rounds = 0;
    while rounds < max_rounds {
        let streams: Vec<_> = reqs
            .iter()
            .map(|r| rig.proxy.submit(r.clone()).expect("submitted"))
            .collect();
        for (r, rx) in reqs.iter().zip(streams) {
            let got = drain(rx);
            assert_eq!(got, collect(&one, r.clone()), "concurrent: {:?}", r.prompt);
            want_bytes += kv_bytes(prompt_tokens(&got));
        }
        rounds += 1;
        if lands != Lands::Short
            || stats(Role::Decode, "imported_in_blocks") < stats(Role::Decode, "imported")
        {
            break;
        }
    }
    let pulls = ((1 + rounds) * reqs.len()) as u64;
    assert_eq!(stats(Role::Prefill, "transfer_bytes_sent"), want_bytes);
    assert_eq!(
        rig.proxy
            .stats
            .kv_bytes
            .load(std::sync::atomic::Ordering::SeqCst),
        want_bytes
    );
    assert_eq!(stats(Role::Prefill, "transfers_acked"), pulls);
    assert_eq!(
        stats(Role::Prefill, "transfers_held"),
        0,
        "held after every ack"
    );
    assert_eq!(stats(Role::Decode, "imported"), pulls);
    let in_blocks = stats(Role::Decode, "imported_in_blocks");
    eprintln!(
        "{in_blocks} of {pulls} pulls landed in reserved blocks ({rounds} concurrent rounds)"
    );
    match lands {
        Lands::Blocks => assert_eq!(in_blocks, pulls),
        Lands::Buffer => assert_eq!(in_blocks, 0),
        Lands::Short => assert!(
            in_blocks < pulls,
            "no pull found the decode worker short of blocks in {rounds} rounds"
        ),
    }
    assert_eq!(stats(Role::Decode, "recomputed"), 0);
    nothing_held(&rig);
}

#[test]
fn native_1p1d_equals_one_engine_bit_for_bit() {
    check("native", 1, 1);
}

#[test]
fn native_2p2d_equals_one_engine_bit_for_bit() {
    check("native", 2, 2);
}

#[test]
fn f32_1p1d_equals_one_engine_bit_for_bit() {
    check("f32", 1, 1);
}

#[test]
fn native_1p1d_streamed_layer_by_layer_equals_one_engine_bit_for_bit() {
    check_with("native", 1, 1, true, &[], Lands::Blocks);
}

#[test]
fn native_1p1d_landing_in_a_buffer_equals_one_engine_bit_for_bit() {
    // The copying import: frames into a kept buffer, copied into blocks
    // on the model thread.
    check_with(
        "native",
        1,
        1,
        false,
        &["--land-in", "buffer"],
        Lands::Buffer,
    );
}

#[test]
fn native_1p1d_short_of_decode_blocks_equals_one_engine_bit_for_bit() {
    // Four blocks of 16 and one running sequence on the decode worker:
    // the concurrent round's reservations wait for the running slot
    // holding their blocks, a pull that finds none free lands in a
    // buffer and waits for room; nothing changes.
    check_with(
        "native",
        1,
        1,
        false,
        &["--kv-cache-mib", "3", "--max-num-seqs", "1"],
        Lands::Short,
    );
}
