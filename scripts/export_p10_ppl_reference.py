"""transformers' f32 scores on the first chunks of the perplexity text: the
reference for Project 10's harness (p10_quant/tests/perplexity.rs).

SmolLM2-135M-Instruct is loaded by transformers from the Q4_1 GGUF
(gguf_file=, dequantised to float32 by gguf-py), the text tokenised by the
GGUF's tokenizer, and each chunk of CTX tokens run as a fresh sequence; as in
llama-perplexity, positions CTX/2 .. CTX-2 are scored on the next token.
Written: the chunks' token ids, and per chunk the sum of the scored tokens'
negative log-likelihoods (nats, float64 log-softmax of the float32 logits).

    .venv-ref/bin/python scripts/export_p10_ppl_reference.py \
        assets/text/corpus.txt p10_quant/fixtures/ppl_reference.json

torch 2.9.1, transformers 5.24.0, gguf 0.17.1 (scripts/requirements.txt).
Deterministic (no sampling, no seed); one thread for reproducible sums.
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOL_DIR = os.path.join(ROOT, "assets", "smollm2")
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CTX = 512
CHUNKS = 2


def main(text_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(SMOL_DIR, gguf_file=SMOL_FILE)
    model = AutoModelForCausalLM.from_pretrained(SMOL_DIR, gguf_file=SMOL_FILE, dtype=torch.float32).eval()
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    # The head of the text is enough for CHUNKS chunks; tokenise a generous
    # prefix, not the whole corpus.
    ids = tok(text[: CTX * CHUNKS * 8], add_special_tokens=False)["input_ids"]
    assert len(ids) >= CTX * CHUNKS, f"only {len(ids)} tokens"
    chunks = []
    for c in range(CHUNKS):
        chunk = ids[c * CTX : (c + 1) * CTX]
        with torch.no_grad():
            logits = model(torch.tensor([chunk])).logits[0].double()
        lp = torch.log_softmax(logits, dim=-1)
        first = CTX // 2
        nll = [-lp[i, chunk[i + 1]].item() for i in range(first, CTX - 1)]
        chunks.append({"ids": chunk, "nll_sum": sum(nll), "scored": len(nll)})
        print(f"chunk {c}: mean NLL {sum(nll) / len(nll):.6f}", file=sys.stderr)
    out = {
        "text": os.path.relpath(text_path, ROOT),
        "ctx": CTX,
        "first_scored": CTX // 2,
        "chunks": chunks,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    with open(out_path, "w") as f:
        json.dump(out, f)
        f.write("\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
