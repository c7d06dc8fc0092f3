#!/usr/bin/env python3
"""Tokenizer corpus for Project 04: >= 200 varied strings and the ids the
transformers tokenizer gives them (SmolLM2-135M-Instruct, loaded from the same
GGUF), with add_special_tokens=False (pure tokenization). The ids of "Hello"
with special tokens are recorded as `bos_policy`: transformers 5 follows the
GGUF's add_bos_token = false and prepends nothing (4.57 prepended <|im_start|>).

Writes p04_transformer/fixtures/tokenizer_corpus.json.
Run:  bash scripts/fetch_assets.sh smollm2 && .venv-ref/bin/python scripts/export_p04_tokenizer.py
"""
import json
import os
import random

import transformers
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "p04_transformer", "fixtures", "tokenizer_corpus.json")
SEED = 0

BASE = [
    "Hello world", "Hello, world!", "The quick brown fox jumps over the lazy dog.",
    "It's a dog's life; they'll see, we've done, I'm here, you'd know.", "don't DON'T Don't",
    "café naïve résumé Zürich Ångström façade", "El niño está aquí — ¿qué tal?", "Ça va? Oui, très bien.",
    "Привет, мир!", "Γειά σου Κόσμε", "שלום עולם", "مرحبا بالعالم", "नमस्ते दुनिया", "こんにちは世界",
    "你好，世界！", "안녕하세요 세계", "ภาษาไทย", "Tiếng Việt có dấu",
    "emoji 😀😃😄 👍🏽 ❤️ 👨‍👩‍👧‍👦 🇫🇷", "math: ∑ ∫ √2 ≈ 1.414, π ≠ 3", "arrows → ← ↑ ↓ ⇒",
    "1234567890", "3.14159 and 2.71828", "Call 555-0199 or +1 (800) 123-4567", "Year 2024, 1st, 2nd, 3rd, 100%",
    "   leading spaces", "trailing spaces   ", "many     spaces     inside", "tabs\tand\ttabs",
    "line one\nline two\n\nline four", "\n\n\n", "   ", " ", "", "a", "\t\n \r\n",
    "def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }", "<html><body>Hi</body></html>",
    '{"key": "value", "n": [1, 2, 3]}', "SELECT * FROM users WHERE id = 42;", "https://example.com/path?q=1&r=2#frag",
    "user@example.com", "C:\\Program Files\\App", "snake_case camelCase PascalCase kebab-case",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>", "text<|im_end|>more", "<|im_start|><|im_end|>", "<|im_start |> not special",
    "Mr. O'Neil's 'quoted' \"double\" `back`", "...!!!???", "—–-", "¡¡¡Hola!!!", "ALL CAPS SENTENCE HERE",
    "Zero-width\u200bjoiner", "non\u00a0breaking space", "combining e\u0301 and a\u0308", "ﬁ ligature ﬀ",
    "Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙", "Roman Ⅻ numerals ⅷ", "superscript x² y³ ½ ¼",
]


def variants(rng):
    out = list(BASE)
    words = ["alpha", "beta", "Gamma", "δέλτα", "東京", "naïve", "42", "3.5", "don't", "😀", "x_y", "foo-bar", "  ", "\n", "the"]
    while len(out) < 240:
        n = rng.randint(1, 9)
        seps = [" ", "  ", "\n", "\t", ", ", ". ", "", " \n "]
        s = "".join(rng.choice(words) + rng.choice(seps) for _ in range(n))
        out.append(s)
    return out


def main():
    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets", "smollm2"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    rng = random.Random(SEED)
    corpus = variants(rng)
    cases = []
    for s in corpus:
        ids = tok(s, add_special_tokens=False).input_ids
        cases.append({"text": s, "ids": ids, "decoded": tok.decode(ids)})
    bos = tok("Hello").input_ids
    with open(OUT, "w") as f:
        json.dump({"transformers": transformers.__version__, "seed": SEED, "bos_policy": {"text": "Hello", "ids_with_special_tokens": bos}, "cases": cases}, f, ensure_ascii=False, indent=0)
        f.write("\n")
    print(f"{len(cases)} cases -> {OUT}")


if __name__ == "__main__":
    main()
