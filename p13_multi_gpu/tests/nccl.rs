//! The NCCL backend. On a machine without a GPU (or without NCCL) making
//! one is an error that says what is missing, never cudarc's panic; on
//! the GPU machine (`scripts/gpu_check.sh`) a world of one runs every call
//! (NCCL refuses two ranks on one GPU).

use std::time::Duration;

use p13_multi_gpu::nccl::NcclComm;
use p13_multi_gpu::Communicator;

#[test]
fn without_a_gpu_nccl_is_an_error_naming_what_is_missing() {
    match NcclComm::single(Duration::from_secs(30)) {
        Ok(c) => {
            // A GPU and NCCL are here: a world of one sums to itself.
            let mut v = vec![1.5f32, -2.0, 3.25];
            c.all_reduce_sum(&mut v).unwrap();
            assert_eq!(v, [1.5, -2.0, 3.25]);
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("libcuda") || msg.contains("libnccl"),
                "the error should name the libraries it tried: {msg}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_world_of_one_on_the_gpu_runs_every_call() {
    let c = NcclComm::single(Duration::from_secs(30)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((c.rank(), c.world()), (0, 1));
    for n in [0usize, 1, 577, 300_001] {
        let x: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 0.25 - 3.0).collect();
        let mut y = x.clone();
        c.all_reduce_sum(&mut y).unwrap();
        assert_eq!(y, x, "all-reduce of {n} values over one rank");
        let mut all = vec![0f32; n];
        c.all_gather(&x, &mut all).unwrap();
        assert_eq!(all, x, "all-gather of {n} values");
    }
    for len in [0usize, 5, 3 << 20] {
        let msg: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let mut b = msg.clone();
        c.broadcast(0, &mut b).unwrap();
        assert_eq!(b, msg, "broadcast of {len} bytes");
    }
    c.barrier().unwrap();
    assert!(c.send(0, b"x").is_err(), "a send to itself is refused");
    let s = c.stats();
    assert_eq!(s.calls, 4 * 2 + 3 + 1);
    assert!(c.broken().is_none());
}
