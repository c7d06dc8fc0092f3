#!/usr/bin/env python3
"""A small byte-level BPE tokenizer.json, trained with HF `tokenizers` (the
library behind transformers' fast tokenizers),
with the ids transformers gives a corpus of strings: proves the tokenizer.json
loader without committing a 2 MB real vocabulary.

Writes p04_transformer/fixtures/tiny_bpe/tokenizer.json and
p04_transformer/fixtures/tiny_bpe/tokenizer_corpus.json.
Run:  .venv-ref/bin/python scripts/export_p04_hf_tokenizer.py
"""
import json
import os

import tokenizers
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIR = os.path.join(ROOT, "p04_transformer", "fixtures", "tiny_bpe")

TRAIN = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "It's the dog's toy; they'll see, we've done it, I'm here.",
    "café naïve résumé — über 東京 😀 numbers 1234 5678 90",
    "def f(x):\n    return x * 2\n\n",
    "the then there these those this that than thin think",
] * 4

CORPUS = [
    "The quick brown fox", "the lazy dog.", "It's they'll we've I'm", "café über 東京 😀",
    "numbers 1234 and 98765", "def f(x):\n    return x\n", "   spaces   inside  ", "\n\n\t",
    "unknownword zzzz", "<|endoftext|>the end<|endoftext|>", "", " ", "a", "THE QUICK",
]


def main():
    t = ByteLevelBPETokenizer(add_prefix_space=False)
    t.train_from_iterator(TRAIN, vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"])
    path = os.path.join(DIR, "tokenizer.json")
    t.save(path)
    fast = PreTrainedTokenizerFast(tokenizer_file=path)
    cases = [{"text": s, "ids": fast(s, add_special_tokens=False).input_ids} for s in CORPUS]
    with open(os.path.join(DIR, "tokenizer_corpus.json"), "w") as f:
        json.dump({"tokenizers": tokenizers.__version__, "cases": cases}, f, ensure_ascii=False, indent=0)
        f.write("\n")
    print(f"tokenizers {tokenizers.__version__}: vocab {t.get_vocab_size()}, {len(cases)} cases -> {DIR}")


if __name__ == "__main__":
    main()
