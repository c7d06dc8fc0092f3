#!/usr/bin/env bash
# Project 06's measurements, in one run: the HTTP layer's overhead over the
# p05 engine, ours vs llama.cpp's server at concurrency 1 and 4 (same
# prompts, same GGUF, 2 threads each), and our serial engine's throughput
# against offered load. Rows go to numbers.md, JSON to target/bench/,
# plots to p06_server/plots/.
#
#   bash scripts/bench_p06.sh            (about 15 minutes on 2 cores)
#   PARTS="peers" bash scripts/bench_p06.sh     (any of: overhead peers sweep)
#
# llama.cpp's server needs .venv-peer (see scripts/run_llamacpp_server.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
cargo build --release -p p06_server
BIN=target/release/p06_server
N="${N:-16}"
PARTS="${PARTS:-overhead peers sweep}"
want() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
COMMON=(--num-requests "$N" --warmup 2 --input-len 256 --output-len 64 --ignore-eos)

wait_healthy() { # url
  for _ in $(seq 1 600); do
    curl -sf "$1/v1/models" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "server at $1 did not come up" >&2; return 1
}

$BIN --port 8000 > target/p06_ours.log 2>&1 & OURS=$!
bash scripts/run_llamacpp_server.sh 8080 > target/p06_llamacpp.log 2>&1 & PEER=$!
trap 'kill $OURS $PEER 2>/dev/null || true' EXIT
wait_healthy http://127.0.0.1:8000
wait_healthy http://127.0.0.1:8080
until curl -sf http://127.0.0.1:8000/health >/dev/null; do sleep 0.2; done

# 1. What the HTTP layer costs (in-process engine vs the same engine over a socket).
if want overhead; then
  $BIN bench --overhead --reps 8 --input-len 256 --output-len 64
fi

# 2. Side by side, one server at a time, same prompts (same seed).
if want peers; then
  for c in 1 4; do
    $BIN bench --url http://127.0.0.1:8000 --label ours --concurrency $c "${COMMON[@]}" \
      --prediction "c1: ~600 ms (p05 prefill at 256); c4: + ~1.5 service times of queueing"
    $BIN bench --url http://127.0.0.1:8080 --label llama.cpp --concurrency $c "${COMMON[@]}" \
      --prediction "c1: ~1.3 s (p05's same-run prefill 200 tok/s)"
  done
fi

# 3. The serial engine's throughput against offered load (the baseline for p07/p08).
if want sweep; then
  $BIN bench --url http://127.0.0.1:8000 --label ours --rates "${RATES:-0.1,0.2,0.3,0.4,0.6,1.0}" "${COMMON[@]}" \
    --prediction "capacity ~0.39 req/s (one request at a time: 0.6 s prefill + 63 x 31 ms)"
fi
