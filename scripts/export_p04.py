#!/usr/bin/env python3
"""Project 04 parity fixtures, made with real transformers.

1. fixtures/tiny_gpt2/ and fixtures/tiny_llama/: tiny random GPT2LMHeadModel and
   LlamaForCausalLM (GQA: 4 query heads, 2 KV heads; untied head) saved with
   save_pretrained (config.json + model.safetensors, the published layouts),
   initializer_range 0.3 so activations are O(1) and parity is discriminating;
   io.safetensors: `ids` (2, 7) i64 and `logits` (2, 7, vocab) f32 from one
   batched forward.
2. fixtures/smollm2_parity.safetensors + smollm2_parity.json: SmolLM2-135M-Instruct
   loaded by transformers from the same Q4_1 GGUF (gguf_file=, dequantised to
   fp32): for 5 prompts (one chat-formatted), the prompt ids, the last-position
   logits, and 32 greedy tokens from a plain argmax loop with no EOS stop
   (exactly what a no-cache greedy generator does).

Run:  bash scripts/fetch_assets.sh smollm2 && .venv-ref/bin/python scripts/export_p04.py
"""
import json
import os

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

SEED = 0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "p04_transformer", "fixtures")
SMOL_DIR = os.path.join(ROOT, "assets", "smollm2")
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
]
CHAT = "What is the capital of France?"


def tiny(name, model):
    d = os.path.join(OUT, name)
    model.eval()
    model.save_pretrained(d, safe_serialization=True)
    g = torch.Generator().manual_seed(SEED + 7)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=g)
    with torch.no_grad():
        logits = model(ids).logits.float()
    save_file({"ids": ids.contiguous(), "logits": logits.contiguous()}, os.path.join(d, "io.safetensors"))
    print(f"{name}: logits std {logits.std().item():.3f}")


CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "2+2?"}],
]


def smollm2():
    tok = AutoTokenizer.from_pretrained(SMOL_DIR, gguf_file=SMOL_FILE)
    model = AutoModelForCausalLM.from_pretrained(SMOL_DIR, gguf_file=SMOL_FILE, dtype=torch.float32)
    model.eval()
    chat = tok.apply_chat_template([{"role": "user", "content": CHAT}], tokenize=False, add_generation_prompt=True)
    texts = PROMPTS + [chat]
    tensors, meta = {}, {"prompts": [], "transformers": transformers.__version__, "torch": torch.__version__}
    with torch.no_grad():
        for i, text in enumerate(texts):
            ids = tok(text, return_tensors="pt").input_ids
            logits = model(ids).logits[0, -1].float()
            seq = ids
            gen = []
            for _ in range(32):
                nxt = int(model(seq).logits[0, -1].argmax())
                gen.append(nxt)
                seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
            tensors[f"p{i}/ids"] = ids[0].contiguous()
            tensors[f"p{i}/last_logits"] = logits.contiguous()
            tensors[f"p{i}/greedy"] = torch.tensor(gen, dtype=torch.int64)
            meta["prompts"].append({"text": text, "n_ids": int(ids.shape[1]), "greedy_text": tok.decode(gen)})
            print(repr(text), "->", repr(tok.decode(gen)))
    # The GGUF's chat template on multi-turn conversations, with and without a
    # system turn, and the file's BOS policy on a plain prompt (transformers 5
    # honours add_bos_token = false; 4.57 prepended <|im_start|>).
    meta["chat_templates"] = []
    for conv in CONVERSATIONS:
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        meta["chat_templates"].append({"messages": conv, "text": text})
    meta["bos_policy"] = {"text": "Hello", "ids": tok("Hello").input_ids}
    save_file(tensors, os.path.join(OUT, "smollm2_parity.safetensors"))
    with open(os.path.join(OUT, "smollm2_parity.json"), "w") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    torch.set_num_threads(2)
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(SEED)
    tiny("tiny_gpt2", GPT2LMHeadModel(GPT2Config(
        vocab_size=101, n_positions=64, n_embd=32, n_layer=2, n_head=4,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, initializer_range=0.3)))
    torch.manual_seed(SEED + 1)
    tiny("tiny_llama", LlamaForCausalLM(LlamaConfig(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.3)))
    smollm2()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, seed {SEED}; wrote {OUT}")
