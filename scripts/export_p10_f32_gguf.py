"""The F32 base for Project 10's accuracy study: SmolLM2's Q4_1 GGUF with every
quantised tensor dequantised by gguf-py (ggml's own reference dequantisers) and
written back as F32, metadata and tokenizer unchanged. llama.cpp's
`llama-perplexity --kl-divergence-base` runs it as the base, the Q4_1 file as
the test: the same weights, so the KL divergence measures llama.cpp's 8-bit
activations, as ours measures our native path against our f32 path.

    .venv-ref/bin/python scripts/export_p10_f32_gguf.py SRC.gguf DST.gguf

gguf==0.17.1 (scripts/requirements.txt). Deterministic; no seed involved.
"""

import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize


def main(src: str, dst: str) -> None:
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch)
    for name, field in r.fields.items():
        # The writer sets these itself.
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub)
    w.add_file_type(0)  # ALL_F32: every tensor below is F32
    for t in r.tensors:
        # gguf-py's reader gives shapes innermost first; numpy arrays are
        # outermost first.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if t.tensor_type in (GGMLQuantizationType.F32,):
            data = np.asarray(t.data, dtype=np.float32).reshape(shape)
        else:
            data = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        w.add_tensor(t.name, data)
        print(f"{t.name}: {t.tensor_type.name} -> F32 {shape}", file=sys.stderr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
