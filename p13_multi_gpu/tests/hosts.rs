//! Ranks on simulated hosts (a network namespace each, joined by the
//! wire): the collectives give the reference sum across them, and the
//! link's delay and bandwidth cap are what each message pays. Needs root
//! (network namespaces, TUN devices) and iproute2; without them it fails
//! with the reason.

use std::time::{Duration, Instant};

use p13_multi_gpu::comm::reference_sum;
use p13_multi_gpu::hosts::{Hosts, Link};
use p13_multi_gpu::{Algorithm, Communicator};

fn hosts(n: usize) -> Hosts {
    Hosts::new(n).unwrap_or_else(|e| {
        panic!("cannot make {n} simulated hosts: {e}\n(run the tests as root, with iproute2 installed: apt-get install iproute2)")
    })
}

/// Median seconds of `reps` all-reduces of `n` floats on every rank.
fn all_reduce_median<C: Communicator>(comms: &[C], n: usize, reps: usize) -> f64 {
    let mut times: Vec<f64> = std::thread::scope(|s| {
        let joins: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let mut buf = vec![1.0f32; n];
                    let mut t = Vec::new();
                    for _ in 0..reps {
                        let t0 = Instant::now();
                        c.all_reduce_sum(&mut buf).expect("all-reduce");
                        t.push(t0.elapsed().as_secs_f64());
                    }
                    t
                })
            })
            .collect();
        joins.into_iter().next().map(|j| j.join().unwrap()).unwrap()
    });
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

#[test]
fn all_reduce_across_hosts_is_the_reference_sum() {
    let h = hosts(3);
    let comms = h
        .tcp_group(Duration::from_secs(30), Algorithm::default())
        .unwrap();
    for n in [1usize, 577, 70_001, 300_001] {
        let inputs: Vec<Vec<f32>> = (0..3)
            .map(|r| {
                (0..n)
                    .map(|i| ((i * 7 + r * 13) % 101) as f32 * 0.37 - 17.0 + 1e-3 * r as f32)
                    .collect()
            })
            .collect();
        let mut want = vec![0.0f32; n];
        let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
        reference_sum(&refs, &mut want);
        let got: Vec<Vec<f32>> = std::thread::scope(|s| {
            let joins: Vec<_> = comms
                .iter()
                .zip(&inputs)
                .map(|(c, x)| {
                    s.spawn(move || {
                        let mut b = x.clone();
                        c.all_reduce_sum(&mut b).map(|()| b)
                    })
                })
                .collect();
            joins
                .into_iter()
                .map(|j| j.join().unwrap().unwrap())
                .collect()
        });
        for (r, g) in got.iter().enumerate() {
            assert!(
                g.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "rank {r}, {n} values: not the reference sum"
            );
        }
    }
    let (carried, _) = h.wire_counts();
    assert!(carried > 0, "no packet went over the wire");
}

#[test]
fn the_link_delay_and_cap_are_paid() {
    let h = hosts(3);
    let comms = h
        .tcp_group(Duration::from_secs(30), Algorithm::default())
        .unwrap();
    let base = all_reduce_median(&comms, 1, 15);
    h.set_link(Link {
        delay: Duration::from_millis(2),
        rate_mbit: None,
    })
    .unwrap();
    let delayed = all_reduce_median(&comms, 1, 15);
    // One round of messages: every rank sends to every other at once and
    // waits for theirs, so it pays one one-way delay (more on a
    // retransmit, never less).
    assert!(
        delayed >= 0.002 && delayed < 0.002 + base + 0.003,
        "a 4-byte all-reduce took {:.3} ms with a 2 ms link (and {:.3} ms with none)",
        delayed * 1e3,
        base * 1e3
    );
    // 1 MiB through the ring: each rank sends 2 (W - 1) / W of it, 0.7 MB,
    // which at 50 Mbit/s takes at least 112 ms.
    h.set_link(Link {
        delay: Duration::ZERO,
        rate_mbit: Some(50),
    })
    .unwrap();
    let capped = all_reduce_median(&comms, 1 << 18, 3);
    let floor = 2.0 * 2.0 / 3.0 * (1 << 20) as f64 * 8.0 / 50e6;
    assert!(
        capped >= 0.9 * floor && capped < 3.0 * floor,
        "a 1 MiB all-reduce took {:.1} ms at 50 Mbit/s, the cap alone gives {:.1} ms",
        capped * 1e3,
        floor * 1e3
    );
}
