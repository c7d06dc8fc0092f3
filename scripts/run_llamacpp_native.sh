#!/usr/bin/env bash
# llama.cpp's own server (continuous batching on) on the same GGUF as ours,
# with the same thread count (all cores), for `p08_continuous bench-serve`.
#
#   bash scripts/run_llamacpp_native.sh [port] [parallel]    (defaults 8091, 16)
#
# Needs .llamacpp/bin/llama-server (bash scripts/build_llamacpp.sh). Each of
# the `parallel` slots gets 4,096 positions of context (a 2,048-token prompt
# plus its output fits); prompts are processed in batches of up to 2,048
# tokens (llama.cpp's default n_batch).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PORT="${1:-8091}"
PARALLEL="${2:-16}"
BIN="$ROOT/.llamacpp/bin/llama-server"
[ -x "$BIN" ] || { echo "run_llamacpp_native: $BIN is missing; run: bash scripts/build_llamacpp.sh" >&2; exit 1; }
bash "$ROOT/scripts/fetch_assets.sh" smollm2 >&2
export LD_LIBRARY_PATH="$ROOT/.llamacpp/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$BIN" \
  --model "$ROOT/assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" \
  --alias SmolLM2-135M-Instruct \
  --threads "$(nproc)" --threads-batch "$(nproc)" \
  --parallel "$PARALLEL" --ctx-size $((PARALLEL * 4096)) --cont-batching \
  --host 127.0.0.1 --port "$PORT"
