#!/usr/bin/env python3
"""numpy/OpenBLAS and PyTorch peers for `cargo run --release -p p02_matmul_bench -- sweep`.

Run once per thread count (the caller sets OPENBLAS_NUM_THREADS/OMP_NUM_THREADS
before numpy loads, and --threads for torch). Times C = A @ B per call (f32,
row-major, fresh output each call as the Rust side does), with warm-up, and
prints one JSON object:

  {"numpy": "...", "torch": "...", "blas": "...", "threads": t,
   "square": [{"n": N, "numpy_s": median, "torch_s": median}, ...],
   "linear": [{"m": M, "k": K, "n": N, "numpy_s": ..., "torch_s": ...}, ...]}

`linear` is y = x @ W.T with W stored (N, K) as PyTorch stores weights.
"""
import argparse
import json
import time

import numpy as np
import torch


def timeit(f, flops):
    f()
    # Enough samples for a stable median without spending minutes on N = 4096.
    n_min = 3 if flops > 1e10 else (5 if flops > 1e9 else 20)
    samples, start = [], time.perf_counter()
    while len(samples) < n_min or time.perf_counter() - start < (0.0 if flops > 1e9 else 0.2):
        t = time.perf_counter()
        f()
        samples.append(time.perf_counter() - t)
    return float(np.median(samples))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,128,256,512,1024,2048,4096")
    ap.add_argument("--linear", default="", help="M:K:N,... shapes")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    out = {"numpy": np.__version__, "torch": torch.__version__, "threads": args.threads, "square": [], "linear": []}
    try:
        cfg = np.show_config(mode="dicts")
        out["blas"] = cfg["Build Dependencies"]["blas"]["name"]
    except Exception:  # older numpy
        out["blas"] = "unknown"
    with torch.inference_mode():
        for n in [int(s) for s in args.sizes.split(",") if s]:
            a = rng.standard_normal((n, n), dtype=np.float32)
            b = rng.standard_normal((n, n), dtype=np.float32)
            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
            flops = 2.0 * n ** 3
            out["square"].append({"n": n, "numpy_s": timeit(lambda: a @ b, flops), "torch_s": timeit(lambda: ta @ tb, flops)})
        for shape in [s for s in args.linear.split(",") if s]:
            m, k, n = (int(v) for v in shape.split(":"))
            x = rng.standard_normal((m, k), dtype=np.float32)
            w = rng.standard_normal((n, k), dtype=np.float32)
            tx, tw = torch.from_numpy(x), torch.from_numpy(w)
            flops = 2.0 * m * k * n
            out["linear"].append({
                "m": m, "k": k, "n": n,
                "numpy_s": timeit(lambda: x @ w.T, flops),
                "torch_s": timeit(lambda: torch.nn.functional.linear(tx, tw), flops),
            })
    print(json.dumps(out))


if __name__ == "__main__":
    main()
