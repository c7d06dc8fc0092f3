#!/usr/bin/env python3
"""Peers for `cargo run --release -p p05_kv_cache -- bench`: prefill tok/s on a
256-token prompt and decode tok/s for 128 tokens after a 16-token prompt, with
2 threads, on the same SmolLM2 GGUF.

  --peer transformers   transformers fp32 (the GGUF dequantised), run with .venv-ref
  --peer llamacpp       llama.cpp (llama-cpp-python built from source, Q4_1 as is), run with .venv-peer

Prints one JSON object {"peer", "version", "prefill_tok_s", "decode_tok_s",
"prefill_runs", "decode_runs", "greedy_ids"}: the medians of --reps timed
runs, every timed run's rate, and the N_DECODE greedy ids of the untimed
first run, so the bench can say how far the peer's tokens agree with ours
before it compares speeds. Prompts are fixed token ids, so both peers and
the Rust side run identical work.
"""
import argparse
import json
import os
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GGUF_DIR = os.path.join(ROOT, "assets", "smollm2")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PREFILL_IDS = [(100 + 37 * i) % 49152 for i in range(256)]
DECODE_PROMPT = [(100 + 37 * i) % 49152 for i in range(16)]
N_DECODE = 128


def bench_transformers(reps):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=GGUF, dtype=torch.float32).eval()
    pre, dec, greedy = [], [], []
    with torch.inference_mode():
        for rep in range(reps + 1):
            ids = torch.tensor([PREFILL_IDS])
            t = time.perf_counter()
            model(ids, use_cache=True)
            pre.append(len(PREFILL_IDS) / (time.perf_counter() - t))
            ids = torch.tensor([DECODE_PROMPT])
            out = model(ids, use_cache=True)
            past, nxt = out.past_key_values, out.logits[0, -1].argmax()
            t = time.perf_counter()
            for _ in range(N_DECODE):
                if rep == 0:
                    greedy.append(int(nxt))
                out = model(nxt.view(1, 1), past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[0, -1].argmax()
            dec.append(N_DECODE / (time.perf_counter() - t))
    return transformers.__version__, pre[1:], dec[1:], greedy


def bench_llamacpp(reps):
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama
    llm = Llama(model_path=os.path.join(GGUF_DIR, GGUF), n_ctx=512, n_threads=2, n_threads_batch=2, n_batch=512, verbose=False, logits_all=False)
    pre, dec, greedy = [], [], []
    for rep in range(reps + 1):
        llm.reset()
        t = time.perf_counter()
        llm.eval(PREFILL_IDS)
        pre.append(len(PREFILL_IDS) / (time.perf_counter() - t))
        llm.reset()
        llm.eval(DECODE_PROMPT)
        t = time.perf_counter()
        for _ in range(N_DECODE):
            # The last position's logits, read from the context: with
            # logits_all=False, llama-cpp-python 0.3.x no longer copies them
            # into `llm.scores` (it stays zeros, so its argmax was always
            # token 0: the greedy-agreement row of 2026-11-30 caught it).
            last = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
            nxt = int(last.argmax())
            if rep == 0:
                greedy.append(nxt)
            llm.eval([nxt])
        dec.append(N_DECODE / (time.perf_counter() - t))
    return llama_cpp.__version__, pre[1:], dec[1:], greedy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", choices=["transformers", "llamacpp"], required=True)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    version, pre, dec, greedy = (bench_transformers if a.peer == "transformers" else bench_llamacpp)(a.reps)
    print(json.dumps({
        "peer": a.peer, "version": version,
        "prefill_tok_s": statistics.median(pre), "decode_tok_s": statistics.median(dec),
        "prefill_runs": pre, "decode_runs": dec, "greedy_ids": greedy,
    }))


if __name__ == "__main__":
    main()
