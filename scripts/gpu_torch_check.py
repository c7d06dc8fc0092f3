"""PyTorch on the GPU machine as a second reference for Project 03/11.

Run by scripts/gpu_check.sh (the GPU machine has PyTorch and needs no Rust toolchain).
It measures what the Rust suite measures through cuBLAS, the same way (CUDA
events after warm-up, medians), so the two peers can be compared in one run:
FP32 matmul (TF32 off), BF16 matmul, device copy bandwidth, and one
correctness anchor: a seeded 1024^3 FP32 product against float64 on the GPU.

    python3 scripts/gpu_torch_check.py OUT.json
"""

import json
import statistics
import sys


def timed(fn, reps, warmup=3):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return statistics.median(times), times[int(0.95 * (len(times) - 1))]


def main(out):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    res = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
    }
    g = torch.Generator(device="cpu").manual_seed(0)
    for n in (1024, 4096, 8192):
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a = (torch.rand(n, n, generator=g) * 2 - 1).to(dev, dt)
            b = (torch.rand(n, n, generator=g) * 2 - 1).to(dev, dt)
            med, p95 = timed(lambda: a @ b, reps=20)
            res[f"matmul {name} {n}^3 FLOP/s at median"] = 2 * n**3 / med
            res[f"matmul {name} {n}^3 FLOP/s at p95"] = 2 * n**3 / p95
    x = torch.empty(1 << 28, dtype=torch.float32, device=dev)
    y = torch.empty_like(x)
    med, _ = timed(lambda: y.copy_(x), reps=30)
    res["device copy 1 GiB, bytes read + written per s at median"] = 2 * x.numel() * 4 / med
    a = torch.rand(1024, 1024, generator=g, dtype=torch.float64) * 2 - 1
    b = torch.rand(1024, 1024, generator=g, dtype=torch.float64) * 2 - 1
    c32 = (a.float().to(dev) @ b.float().to(dev)).double().cpu()
    c64 = a.float().double() @ b.float().double()
    res["fp32 1024^3 max |torch - f64| / max |f64|"] = float((c32 - c64).abs().max() / c64.abs().max())
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    for k, v in res.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main(sys.argv[1])
