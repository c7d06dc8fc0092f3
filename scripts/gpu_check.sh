#!/usr/bin/env bash
# The GPU check: one prepared run on a machine with an NVIDIA GPU (written
# for an H200; it needs a CUDA 13 driver, and PyTorch for step 4; no Rust
# toolchain, no network). It builds nothing: the binaries come from
# `bash scripts/gpu_build.sh` on a machine with Rust, in gpu-bin/.
#
#   on the machine with Rust:  bash scripts/gpu_build.sh
#   copy the repository, gpu-bin/ included, to the GPU machine; there:
#                              bash scripts/gpu_check.sh
#   then copy gpu-out/ back into the repository on the first machine.
#
# Steps (each under its own time limit, all under one deadline of 330 s, so
# the packing at the end always runs and the whole check stays under six
# minutes):
#   1. where the CUDA libraries are; nvidia-smi; whether our binaries start
#      (glibc, shared libraries) and see the device (`p03_gpu_kernel info`)
#   2. every GPU test (`--ignored`) of p03 and p11, and their unit tests
#   3. `p03_gpu_kernel bench`, then `p11_gpu_bench run`: rows, JSON, plots
#   4. PyTorch on the same device as a second reference for the matmul peers
#   5. compute-sanitizer memcheck over p03's GPU tests, if time is left
# It writes five files into gpu-out/ (or $OUT, if set) to copy back:
# log.txt, rows.md (numbers.md rows, stamped with the commit gpu-bin was
# built at), torch.json, p11/suite.json, and all.tgz (every step's output,
# nvidia-smi, and the plots: p03/plots, p11/plots). Exit status: the number
# of failed steps (0 = all passed); 100 = the binaries cannot run here.
#
# `bash scripts/gpu_check.sh quick` runs step 1, the tests, and both benches
# with --quick (about a minute): run it first where time on the GPU machine
# is short, to find out cheaply that the binaries run there.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
MODE="${1:-full}"
OUT="${OUT:-$ROOT/gpu-out}"
BIN="$ROOT/gpu-bin"
mkdir -p "$OUT/tests"
export INFERENCE_LAB_ROOT="$ROOT"
FAILED=0
DEADLINE=$((SECONDS + 330))
log() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/log.txt"; }
step() { # name timeout_s command...
  local name="$1" limit="$2"
  shift 2
  local left=$((DEADLINE - SECONDS - 20))
  [ "$limit" -gt "$left" ] && limit="$left"
  if [ "$limit" -le 0 ]; then
    log "skip:  $name (deadline)"
    FAILED=$((FAILED + 1))
    return 1
  fi
  log "start: $name (limit ${limit} s)"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/tests/$name.txt" 2>&1
  local rc=$?
  log "end:   $name rc=$rc in $((SECONDS - t0)) s"
  if [ "$rc" -ne 0 ]; then
    FAILED=$((FAILED + 1))
    tail -n 30 "$OUT/tests/$name.txt" | tee -a "$OUT/log.txt"
  fi
  return "$rc"
}

pack() { # everything but the four loose files into all.tgz (five files to copy back)
  local items=()
  for f in tests p03 p11/plots nvidia-smi.txt; do [ -e "$OUT/$f" ] && items+=("$f"); done
  if [ "${#items[@]}" -gt 0 ]; then
    tar czf "$OUT/all.tgz" -C "$OUT" "${items[@]}" && (cd "$OUT" && rm -rf "${items[@]}")
  fi
}
trap pack EXIT

[ -d "$BIN" ] || { log "no $BIN: run scripts/gpu_build.sh on a machine with Rust and copy gpu-bin/ here"; exit 100; }
chmod +x "$BIN"/p03_gpu_kernel "$BIN"/p11_gpu_bench "$BIN"/tests/* 2>/dev/null
# The binaries must be built from the sources that travelled with them.
if ! (cd "$ROOT" && sha256sum --quiet -c "$BIN/SOURCES") >>"$OUT/log.txt" 2>&1; then
  log "gpu-bin was built from other sources than this tree: rerun scripts/gpu_build.sh"
  exit 100
fi
COMMIT="$(cat "$BIN/COMMIT")"
log "binaries built at $COMMIT (newest glibc symbol $(cat "$BIN/GLIBC")); mode $MODE"
ldd --version 2>&1 | head -1 | tee -a "$OUT/log.txt"

# ---- 1. libraries, device, do our binaries start ----------------------------
CUDA_DIRS=""
# (Not /usr/lib/x86_64-linux-gnu: it is on the default path, and ahead of
# the driver's mount it could shadow libcuda.so.1.)
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib64; do
  [ -e "$d/libcublas.so.13" ] || [ -e "$d/libnvrtc.so.13" ] && CUDA_DIRS="$CUDA_DIRS:$d"
done
# PyTorch's wheels carry their own CUDA libraries: a fallback.
PY_NV="$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null || true)"
if [ -n "$PY_NV" ]; then
  for d in "$PY_NV"/nvidia/*/lib "$PY_NV"/nvidia/cu13/lib; do
    [ -d "$d" ] && CUDA_DIRS="$CUDA_DIRS:$d"
  done
fi
export LD_LIBRARY_PATH="${CUDA_DIRS#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The plotting libraries our commands link, only if the image lacks them.
if ldd "$BIN/p11_gpu_bench" | grep -q "not found"; then
  log "using carried libraries for: $(ldd "$BIN/p11_gpu_bench" | grep 'not found' | awk '{print $1}' | tr '\n' ' ')"
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$BIN/lib"
fi
if ! fc-list 2>/dev/null | grep -q .; then
  export FONTCONFIG_FILE="$BIN/fonts/fonts.conf"
  log "no system fonts: using the carried one"
fi
log "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv \
  2>&1 | tee -a "$OUT/log.txt"

if ! step info 45 "$BIN/p03_gpu_kernel" info; then
  log "our binary does not run here: stopping (see tests/info.txt)"
  exit 100
fi
cat "$OUT/tests/info.txt" | tee -a "$OUT/log.txt"

# ---- 2. tests ---------------------------------------------------------------
# The unit tests include the GPU-opening one (it opens the device when a
# driver is there); the integration tests are the ignored GPU tests. The
# nvrtc tests fetch NVRTC through pip, and a GPU machine may have no
# network: skipped (they run in every CPU test run).
step p03-unit 30 "$BIN/tests/p03_gpu_kernel-unit" --test-threads=1
step p03-gpu 120 "$BIN/tests/p03_gpu_kernel-gpu" --ignored --test-threads=1
step p11-unit 30 "$BIN/tests/p11_gpu_bench-unit" --test-threads=1
step p11-gpu 60 "$BIN/tests/p11_gpu_bench-gpu" --ignored --test-threads=1

# ---- 3. benches -------------------------------------------------------------
Q=""
[ "$MODE" = quick ] && Q="--quick"
step p03-bench 120 "$BIN/p03_gpu_kernel" bench $Q --rows "$OUT/rows.md" --commit "$COMMIT" \
  --plots "$OUT/p03/plots"
step p11-run 150 "$BIN/p11_gpu_bench" run $Q --out "$OUT/p11" --rows "$OUT/rows.md" --commit "$COMMIT"
# ---- 4. PyTorch as a second reference ---------------------------------------
step torch 90 python3 scripts/gpu_torch_check.py "$OUT/torch.json"

# ---- 5. compute-sanitizer memcheck over the kernels' tests, if time is left
# (some virtualised or sandboxed machines refuse it). Not counted as a
# failure: a refusal there says nothing about our kernels; its output is in
# all.tgz (tests/memcheck.txt) either way.
if command -v compute-sanitizer >/dev/null 2>&1 && [ $((DEADLINE - SECONDS)) -gt 60 ]; then
  before=$FAILED
  step memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$BIN/tests/p03_gpu_kernel-gpu" --ignored --test-threads=1 \
    --skip events_time_the_kernel --skip half_precision
  FAILED=$before
fi

cat "$OUT/tests/p03-bench.txt" "$OUT/tests/p11-run.txt" 2>/dev/null | grep -v '^\s*$' | tail -n 80 >>"$OUT/log.txt"

log "done: $FAILED step(s) failed"
exit "$FAILED"
