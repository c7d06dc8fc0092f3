//! The collectives over threads and loopback TCP: every algorithm's sums
//! equal the reference order bit for bit on every rank; gathers,
//! broadcasts, barriers and messages arrive whole; ranks out of order,
//! dead, stuck or of another job are errors on every rank, in bounded time.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::rng::Rng;
use p13_multi_gpu::comm::{reference_sum, CommError, Communicator};
use p13_multi_gpu::frame::{Hello, PROTOCOL_VERSION};
use p13_multi_gpu::mesh::{Algorithm, Mesh, Transport};
use p13_multi_gpu::{shm, tcp, threads};

const DEADLINE: Duration = Duration::from_secs(2);

/// Run `f` on every rank at once, results in rank order.
fn on_every_rank<C: Communicator, R: Send>(comms: &[C], f: impl Fn(&C) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let joins: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    })
}

/// Values whose sum depends on the order they are added in.
fn data(rank: usize, n: usize) -> Vec<f32> {
    let mut rng = Rng::new(1000 + rank as u64);
    (0..n)
        .map(|_| {
            let u = rng.next_f32() * 2.0 - 1.0;
            u * 10f32.powi((rng.next_u64() % 9) as i32 - 4)
        })
        .collect()
}

fn check_all_reduce<C: Communicator>(comms: &[C], n: usize, what: &str) {
    let world = comms.len();
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| data(r, n)).collect();
    let mut want = vec![0.0f32; n];
    let refs: Vec<&[f32]> = inputs.iter().map(|v| v.as_slice()).collect();
    reference_sum(&refs, &mut want);
    let got = on_every_rank(comms, |c| {
        let mut buf = inputs[c.rank()].clone();
        c.all_reduce_sum(&mut buf).map(|_| buf)
    });
    for (rank, g) in got.into_iter().enumerate() {
        let g = g.unwrap_or_else(|e| panic!("{what} n {n} rank {rank}: {e}"));
        let same = g.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{what}: n {n}, world {world}, rank {rank}: not the reference sum bit for bit"
        );
    }
}

const SIZES: [usize; 8] = [0, 1, 2, 3, 7, 576, 1001, 70_000];

#[test]
fn shared_memory_sums_in_the_reference_order_across_slot_sized_pieces() {
    for world in [2, 3, 4] {
        let s = shm::group(world, DEADLINE).unwrap();
        // 300,001 values: more than one 1 MiB slot, so several rounds,
        // with a chunk boundary inside a piece.
        for n in SIZES.into_iter().chain([300_001]) {
            check_all_reduce(&s, n, "shm");
        }
    }
}

#[test]
fn every_algorithm_sums_in_the_reference_order_over_threads_and_tcp() {
    for world in [2, 3, 4] {
        for algo in [Algorithm::Direct, Algorithm::Ring, Algorithm::default()] {
            let t = threads::group(world, DEADLINE, algo);
            let c = tcp::loopback_group(world, DEADLINE, algo).unwrap();
            for n in SIZES {
                check_all_reduce(&t, n, &format!("threads {algo:?}"));
                check_all_reduce(&c, n, &format!("tcp {algo:?}"));
            }
        }
    }
}

#[test]
fn the_reference_order_is_not_rank_order_so_the_test_above_can_fail() {
    // With three ranks, element 2 is summed (x2 + x0) + x1: for these
    // inputs that differs from (x0 + x1) + x2, so a backend that summed in
    // rank order would fail the bitwise comparison.
    let (a, b, c) = ([1e8f32; 3], [1.0f32; 3], [-1e8f32; 3]);
    let mut out = [0.0f32; 3];
    reference_sum(&[&a, &b, &c], &mut out);
    let rank_order = (a[2] + b[2]) + c[2];
    assert_ne!(out[2].to_bits(), rank_order.to_bits());
}

#[test]
fn gathers_broadcasts_barriers_and_messages_arrive_whole() {
    for world in [2, 3] {
        let t = threads::group(world, DEADLINE, Algorithm::default());
        let c = tcp::loopback_group(world, DEADLINE, Algorithm::default()).unwrap();
        fn run<C: Communicator>(comms: &[C], p2p: bool) {
            let world = comms.len();
            let got = on_every_rank(comms, |c| {
                let r = c.rank();
                let mine = data(r, 5);
                let mut all = vec![0.0; 5 * world];
                c.all_gather(&mine, &mut all).unwrap();
                // A plan of 3 MiB from rank 0, then one of 0 bytes.
                let mut plan = if r == 0 {
                    vec![7u8; 3 << 20]
                } else {
                    vec![1, 2]
                };
                c.broadcast(0, &mut plan).unwrap();
                let mut empty = if r == 0 { Vec::new() } else { vec![9] };
                c.broadcast(0, &mut empty).unwrap();
                c.barrier().unwrap();
                // A pipeline: each rank sends its rank to the next.
                let mut got = Vec::new();
                if p2p && r + 1 < world {
                    c.send(r + 1, &[r as u8; 3]).unwrap();
                }
                if p2p && r > 0 {
                    c.recv(r - 1, &mut got).unwrap();
                }
                (
                    all,
                    plan.len(),
                    plan.iter().all(|&b| b == 7),
                    empty.len(),
                    got,
                )
            });
            for (r, (all, plan_len, plan_ok, empty_len, got)) in got.into_iter().enumerate() {
                let want: Vec<f32> = (0..world).flat_map(|p| data(p, 5)).collect();
                assert_eq!(all, want, "rank {r} all_gather");
                assert_eq!(
                    (plan_len, plan_ok, empty_len),
                    (3 << 20, true, 0),
                    "rank {r}"
                );
                let want_msg = if p2p && r > 0 {
                    vec![(r - 1) as u8; 3]
                } else {
                    vec![]
                };
                assert_eq!(got, want_msg, "rank {r} recv");
            }
        }
        run(&t, true);
        run(&c, true);
        run(&shm::group(world, DEADLINE).unwrap(), false);
    }
}

/// Every rank's result is an error, all within `bound`.
fn all_fail<R: std::fmt::Debug>(
    results: Vec<Result<R, CommError>>,
    t0: Instant,
    bound: Duration,
) -> Vec<CommError> {
    assert!(t0.elapsed() < bound, "took {:?}", t0.elapsed());
    results
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.err().unwrap_or_else(|| panic!("rank {r} did not fail")))
        .collect()
}

#[test]
fn a_rank_calling_collectives_out_of_order_fails_on_every_rank() {
    for algo in [Algorithm::Direct, Algorithm::Ring] {
        let t = threads::group(3, DEADLINE, algo);
        let c = tcp::loopback_group(3, DEADLINE, algo).unwrap();
        fn run<C: Communicator>(comms: &[C], what: &str) {
            let t0 = Instant::now();
            let results = on_every_rank(comms, |c| {
                let mut buf = vec![1.0f32; 100];
                // A barrier sends a frame to every rank, so each algorithm's
                // receives meet it. (A call that receives from a rank that
                // sends it nothing, such as a broadcast's non-root beside a
                // ring, can only end at the deadline: that is the test of
                // stuck ranks below.)
                if c.rank() == 2 {
                    c.barrier()
                } else {
                    c.all_reduce_sum(&mut buf)
                }
            });
            let errs = all_fail(results, t0, DEADLINE * 2);
            assert!(
                errs.iter()
                    .any(|e| matches!(e, CommError::OutOfOrder { .. })),
                "{what}: {errs:?}"
            );
            // Broken from now on, with the first error named.
            let again = comms[0].barrier().unwrap_err();
            assert!(matches!(again, CommError::Broken { .. }), "{what}: {again}");
        }
        run(&t, "threads");
        run(&c, "tcp");
    }
    fn shm_run<C: Communicator>(comms: &[C]) {
        let t0 = Instant::now();
        let results = on_every_rank(comms, |c| {
            if c.rank() == 2 {
                c.barrier()
            } else {
                c.all_reduce_sum(&mut vec![1.0f32; 100])
            }
        });
        let errs = all_fail(results, t0, DEADLINE * 2);
        assert!(
            errs.iter()
                .any(|e| matches!(e, CommError::OutOfOrder { .. })),
            "shm: {errs:?}"
        );
    }
    shm_run(&shm::group(3, DEADLINE).unwrap());
}

#[test]
fn a_dead_rank_is_an_error_on_every_other_rank_at_once() {
    for algo in [Algorithm::Direct, Algorithm::Ring] {
        let mut t = threads::group(3, Duration::from_secs(30), algo);
        let mut c = tcp::loopback_group(3, Duration::from_secs(30), algo).unwrap();
        fn run<T: Transport>(comms: &mut Vec<Mesh<T>>) {
            drop(comms.pop()); // rank 2 dies
            let t0 = Instant::now();
            let results = on_every_rank(comms, |c| c.all_reduce_sum(&mut [1.0f32; 10]));
            // Long before the 30 s deadline.
            let errs = all_fail(results, t0, Duration::from_secs(5));
            assert!(
                errs.iter()
                    .any(|e| matches!(e, CommError::PeerGone { peer: 2, .. })),
                "{errs:?}"
            );
        }
        run(&mut t);
        run(&mut c);
    }
}

#[test]
fn a_stuck_rank_is_a_timeout_within_the_deadline() {
    let deadline = Duration::from_millis(300);
    let t = threads::group(3, deadline, Algorithm::Direct);
    let c = tcp::loopback_group(3, deadline, Algorithm::Ring).unwrap();
    fn run<C: Communicator>(comms: &[C]) {
        let t0 = Instant::now();
        // Rank 2 never calls.
        let results = on_every_rank(&comms[..2], |c| c.all_reduce_sum(&mut [1.0f32; 10]));
        let errs = all_fail(results, t0, Duration::from_secs(3));
        assert!(
            errs.iter().any(|e| matches!(e, CommError::Timeout { .. })),
            "{errs:?}"
        );
    }
    run(&t);
    run(&c);
    run(&shm::group(3, deadline).unwrap());
}

#[test]
fn a_rank_of_another_job_or_layout_is_refused_at_the_handshake() {
    for (token1, layout1) in [(2u64, 9u64), (1, 8)] {
        let ls: Vec<TcpListener> = (0..2)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let addrs: Vec<_> = ls.iter().map(|l| l.local_addr().unwrap()).collect();
        let hello = |rank: u32, token, layout| Hello {
            version: PROTOCOL_VERSION,
            world: 2,
            rank,
            token,
            layout,
        };
        let results = std::thread::scope(|s| {
            let a =
                s.spawn(|| tcp::connect(&ls[0], &addrs, hello(0, 1, 9), Duration::from_secs(3)));
            let b = s.spawn(|| {
                tcp::connect(
                    &ls[1],
                    &addrs,
                    hello(1, token1, layout1),
                    Duration::from_secs(3),
                )
            });
            [a.join().unwrap().err(), b.join().unwrap().err()]
        });
        for (r, e) in results.into_iter().enumerate() {
            let e = e.unwrap_or_else(|| panic!("rank {r} joined a mismatched job"));
            assert!(matches!(e, CommError::Handshake { .. }), "rank {r}: {e}");
        }
    }
}

#[test]
fn a_rows_sums_do_not_depend_on_how_many_rows_share_the_buffer() {
    // Row 0 (576 values, a SmolLM2 hidden row) alone, and with 4 more rows:
    // its sums are the same bits (batch invariance under TP).
    let world = 3;
    let rows = |n: usize, r: usize| -> Vec<f32> {
        let mut v = data(r, 576);
        v.extend(data(r + 10, 576 * (n - 1)));
        v
    };
    fn first_row<C: Communicator>(
        comms: &[C],
        n: usize,
        rows: &(dyn Fn(usize, usize) -> Vec<f32> + Sync),
    ) -> Vec<u32> {
        let got = on_every_rank(comms, |c| {
            let mut b = rows(n, c.rank());
            c.all_reduce_sum(&mut b).unwrap();
            b
        });
        got[0][..576].iter().map(|x| x.to_bits()).collect()
    }
    for algo in [Algorithm::Direct, Algorithm::Ring] {
        let c = tcp::loopback_group(world, DEADLINE, algo).unwrap();
        assert_eq!(first_row(&c, 1, &rows), first_row(&c, 5, &rows), "{algo:?}");
    }
    let s = shm::group(world, DEADLINE).unwrap();
    assert_eq!(first_row(&s, 1, &rows), first_row(&s, 5, &rows), "shm");
}

/// A rank blocked in a collective (a follower waiting for rank 0's next
/// plan) still answers for its stats: they are not behind the call's lock.
#[test]
fn stats_answer_while_a_rank_waits() {
    for (name, comms) in [
        (
            "threads",
            boxed(threads::group(
                2,
                Duration::from_secs(10),
                Algorithm::default(),
            )),
        ),
        (
            "tcp",
            boxed(tcp::loopback_group(2, Duration::from_secs(10), Algorithm::default()).unwrap()),
        ),
        (
            "shm",
            boxed(shm::group(2, Duration::from_secs(10)).unwrap()),
        ),
    ] {
        std::thread::scope(|s| {
            let waiting = s.spawn(|| {
                let mut b = Vec::new();
                comms[1].broadcast_wait(0, &mut b, None).map(|()| b)
            });
            std::thread::sleep(Duration::from_millis(50));
            let (tx, rx) = std::sync::mpsc::channel();
            let c = &comms[1];
            s.spawn(move || tx.send(c.stats()).unwrap());
            let stats = rx
                .recv_timeout(Duration::from_secs(2))
                .unwrap_or_else(|_| panic!("{name}: stats blocked behind a waiting call"));
            let before = stats.calls;
            let mut msg = b"go".to_vec();
            comms[0].broadcast(0, &mut msg).unwrap();
            assert_eq!(waiting.join().unwrap().unwrap(), b"go", "{name}");
            assert_eq!(
                comms[1].stats().calls,
                before + 1,
                "{name}: the finished call is counted"
            );
        });
    }
}

fn boxed<C: Communicator + 'static>(v: Vec<C>) -> Vec<Box<dyn Communicator>> {
    v.into_iter()
        .map(|c| Box::new(c) as Box<dyn Communicator>)
        .collect()
}
