#!/usr/bin/env python3
"""PyTorch peer for `cargo run --release -p p01_engine -- bench`.

Times the same MNIST MLP (weights from p01_engine/fixtures/mlp) per call at
each batch size with the same method as the Rust side: warm-up calls, then one
sample per call until at least --min-samples and --min-time have passed.
Prints one JSON object: {"torch": version, "threads": n, "flops_per_image": ...,
"points": [{"batch": b, "median_s": ..., "p95_s": ..., "n": ...}, ...]}.

FLOPs per image come from torch.utils.flop_counter.FlopCounterMode at batch 1,
an independent count of what the Rust engine derives from its graph.
"""
import argparse
import json
import time

import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import load_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256,512,1024")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--min-samples", type=int, default=20)
    ap.add_argument("--min-time", type=float, default=0.3)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    w = load_file(args.weights)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    model[0].weight.data, model[0].bias.data = w["fc1.weight"], w["fc1.bias"]
    model[2].weight.data, model[2].bias.data = w["fc2.weight"], w["fc2.bias"]
    model[4].weight.data, model[4].bias.data = w["fc3.weight"], w["fc3.bias"]
    model.eval()
    images = load_file(args.images)["images"]
    pool = torch.cat([images, images[: 1024 - len(images)]]) if len(images) < 1024 else images

    with torch.inference_mode():
        from torch.utils.flop_counter import FlopCounterMode
        fc = FlopCounterMode(display=False)
        with fc:
            model(pool[:1])
        flops = fc.get_total_flops()
        points = []
        for b in [int(x) for x in args.batches.split(",")]:
            x = pool[:b].contiguous()
            for _ in range(args.warmup):
                model(x)
            samples, start = [], time.perf_counter()
            while len(samples) < args.min_samples or time.perf_counter() - start < args.min_time:
                t = time.perf_counter()
                model(x)
                samples.append(time.perf_counter() - t)
                if len(samples) >= 10000:
                    break
            s = np.asarray(samples)
            points.append({"batch": b, "median_s": float(np.median(s)), "p95_s": float(np.percentile(s, 95)), "n": len(s)})
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "flops_per_image": flops, "points": points}))


if __name__ == "__main__":
    main()
