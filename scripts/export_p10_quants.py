"""Fixtures for Project 10's block formats, made by gguf-py (the reference
implementation of GGUF's quantisers in Python, mirroring ggml's C ones).

For each case (seeded rows of 256 values, including hard ones: constant
rows, zeros, one outlier, tiny and huge scales, exact ties) and each format
(Q8_0, Q4_0, Q4_1): the quantised bytes `gguf.quants.quantize` writes and the
f32 values `gguf.quants.dequantize` reads back.

Writes p10_quant/fixtures/quants.safetensors and quants.json.
Run: .venv-ref/bin/python scripts/export_p10_quants.py
"""
import json
import os

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType as T
from safetensors.numpy import save_file

SEED = 0
OUT = os.path.join(os.path.dirname(__file__), "..", "p10_quant", "fixtures")


def cases(rng):
    k = 256
    rows = {
        "normal": rng.standard_normal((6, k)).astype(np.float32),
        "uniform_wide": (rng.uniform(-1e3, 1e3, (2, k))).astype(np.float32),
        "tiny": (rng.standard_normal((2, k)) * 1e-4).astype(np.float32),
        "positive": rng.uniform(0.5, 2.0, (2, k)).astype(np.float32),
        "negative": -rng.uniform(0.5, 2.0, (2, k)).astype(np.float32),
    }
    hard = np.zeros((6, k), dtype=np.float32)
    hard[1, :] = 0.37  # constant: Q4_1's d is 0, Q8_0's values all 127
    hard[2, :] = rng.standard_normal(k).astype(np.float32) * 0.01
    hard[2, 5] = 40.0  # one outlier per block 0
    hard[2, 40] = -55.0
    hard[3, :] = np.tile(np.array([-1.0, 1.0], dtype=np.float32), k // 2)  # exact ties
    hard[4, :] = (np.arange(k, dtype=np.float32) - 128) / 16  # steps land on halves
    hard[5, :32] = 65504.0  # f16's largest
    hard[5, 32:64] = -1e-8
    rows["hard"] = hard
    return rows


def main():
    rng = np.random.default_rng(SEED)
    tensors, meta = {}, {"seed": SEED, "gguf": gguf.__version__ if hasattr(gguf, "__version__") else "0.17.1",
                         "numpy": np.__version__, "cases": {}}
    for name, x in cases(rng).items():
        tensors[f"{name}/input"] = x
        meta["cases"][name] = list(x.shape)
        for fmt in ("Q8_0", "Q4_0", "Q4_1"):
            q = gguf.quants.quantize(x, T[fmt])
            tensors[f"{name}/{fmt}/bytes"] = np.ascontiguousarray(q).view(np.uint8).reshape(-1)
            tensors[f"{name}/{fmt}/dequant"] = gguf.quants.dequantize(q, T[fmt]).astype(np.float32)
    os.makedirs(OUT, exist_ok=True)
    save_file(tensors, os.path.join(OUT, "quants.safetensors"))
    with open(os.path.join(OUT, "quants.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    print(f"wrote {len(tensors)} tensors to {OUT}")


if __name__ == "__main__":
    main()
