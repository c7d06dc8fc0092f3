"""The gloo peer of `p13_multi_gpu bench-allreduce`: torch.distributed's
all-reduce (sum, f32) on the gloo backend, `--world` processes on loopback,
at each of `--sizes` bytes. Prints one JSON line: for each size, the
seconds per all-reduce of each sample (rank 0's clock), each sample timing
enough back-to-back calls to last ~20 ms, after 20 warm-up calls, like the
Rust side.

    .venv-ref/bin/python scripts/bench_p13_gloo.py --world 3 --samples 5 --sizes 4,2304
"""

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, world, port, sizes, samples, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = []
    for nbytes in sizes:
        buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
        reps = min(max(20_000_000 // (nbytes + 20_000), 1), 2000)
        for _ in range(min(reps, 20)):
            dist.all_reduce(buf)
        per = []
        for _ in range(samples):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(buf)
            per.append((time.perf_counter() - t0) / reps)
        results.append(per)
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--sizes", type=str, required=True)
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, a.world, port, sizes, a.samples, out)) for r in range(a.world)]
    for pr in procs:
        pr.start()
    results = out.get(timeout=1800)
    for pr in procs:
        pr.join(timeout=60)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
