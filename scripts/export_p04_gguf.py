#!/usr/bin/env python3
"""GGUF fixtures for Project 04's loader, made with the reference `gguf` package.

1. p04_transformer/fixtures/tiny_quant.gguf: written by gguf.GGUFWriter, with
   metadata of every value type and one tensor of each type the loader reads
   (F32, F16, BF16, Q8_0, Q4_0, Q4_1), quantised by gguf.quants.quantize from
   seeded random data; tiny_quant_expected.safetensors holds
   gguf.quants.dequantize of the same bytes (what our dequantiser must equal).
2. p04_transformer/fixtures/smollm2_dequant.safetensors: the first rows of
   several real SmolLM2-135M-Instruct tensors (Q8_0, Q4_1, F32), dequantised
   by gguf-py, for the test that reads the fetched model.

Run:  bash scripts/fetch_assets.sh smollm2 && .venv-ref/bin/python scripts/export_p04_gguf.py
"""
import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from safetensors.numpy import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "p04_transformer", "fixtures")
SMOL = os.path.join(ROOT, "assets", "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
SEED = 0


def tiny():
    rng = np.random.default_rng(SEED)
    path = os.path.join(OUT, "tiny_quant.gguf")
    w = gguf.GGUFWriter(path, arch="tinytest")
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4_000_000_000)
    w.add_int32("test.i32", -2_000_000_000)
    w.add_float32("test.f32", 1.5)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "héllo ✓")
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float64("test.f64", -0.25)
    w.add_array("test.array_str", ["a", "bb", "Ġ t", ""])
    w.add_array("test.array_i32", [1, -2, 3])
    expected = {}
    # (name, type, (rows, cols)); cols is ne[0], a multiple of the block size.
    specs = [
        ("t_f32", T.F32, (3, 5)),
        ("t_f16", T.F16, (4, 32)),
        ("t_bf16", T.BF16, (2, 64)),
        ("t_q8_0", T.Q8_0, (3, 64)),
        ("t_q4_0", T.Q4_0, (2, 96)),
        ("t_q4_1", T.Q4_1, (5, 32)),
    ]
    for name, ty, shape in specs:
        data = (rng.standard_normal(shape) * 2.0).astype(np.float32)
        data[0, 0] = 0.0
        if ty == T.F32:
            q = data
        elif ty == T.F16:
            q = data.astype(np.float16)
        else:
            q = gguf.quants.quantize(data, ty)
        w.add_tensor(name, q, raw_dtype=ty)
        expected[name] = np.ascontiguousarray(gguf.quants.dequantize(q, ty).astype(np.float32).reshape(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    save_file(expected, os.path.join(OUT, "tiny_quant_expected.safetensors"))


def smollm2():
    r = gguf.GGUFReader(SMOL)
    want = {"token_embd.weight": 4, "blk.0.attn_q.weight": 4, "blk.0.ffn_down.weight": 4, "blk.29.attn_k.weight": 4, "blk.0.attn_norm.weight": 1, "output_norm.weight": 1}
    out = {}
    for t in r.tensors:
        if t.name in want:
            full = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            full = full.reshape(-1, int(t.shape[0]))  # (rows, ne0)
            out[t.name] = np.ascontiguousarray(full[: want[t.name]])
    assert len(out) == len(want), sorted(out)
    save_file(out, os.path.join(OUT, "smollm2_dequant.safetensors"))


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    tiny()
    if os.path.exists(SMOL):
        smollm2()
    else:
        print(f"{SMOL} missing: run bash scripts/fetch_assets.sh smollm2 (skipped the SmolLM2 part)")
    print(f"gguf {getattr(gguf, '__version__', '0.17.1')}, numpy {np.__version__}, seed {SEED}; wrote {OUT}")
