#!/usr/bin/env bash
# llama.cpp's OpenAI-compatible server (llama-cpp-python[server]) on the same
# GGUF as ours, 2 threads, for side-by-side `p06_server bench` runs.
#
#   bash scripts/run_llamacpp_server.sh [port]     (default 8080)
#
# Needs .venv-peer with llama-cpp-python 0.3.36 built from source (see
# p05_kv_cache/README.md for the CMAKE_ARGS; on a host without AVX-512 leave
# the AVX-512 flags OFF) and the server extras:
#   .venv-peer/bin/pip install 'llama-cpp-python[server]==0.3.36'
# Two server defaults are changed, as a user serving it would: logits_all
# (logits for every prompt position, kept in a (n_ctx, vocab) array; only
# needed for prompt logprobs) and interrupt_requests (a new request aborts the
# stream in flight, so every concurrent client but one fails).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PORT="${1:-8080}"
bash "$ROOT/scripts/fetch_assets.sh" smollm2
exec "$ROOT/.venv-peer/bin/python" -m llama_cpp.server \
  --model "$ROOT/assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" \
  --model_alias SmolLM2-135M-Instruct \
  --n_threads 2 --n_threads_batch 2 --n_ctx 4096 \
  --logits_all False --interrupt_requests False \
  --host 127.0.0.1 --port "$PORT"
