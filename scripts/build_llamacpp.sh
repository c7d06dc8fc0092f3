#!/usr/bin/env bash
# Build llama.cpp's own tools (llama-server with continuous batching,
# llama-bench, llama-perplexity, llama-batched-bench) from the source that
# PyPI's llama-cpp-python sdist vendors (vendor/llama.cpp), with CMake from
# PyPI, into the git-ignored .llamacpp/ folder. Idempotent: a finished build
# whose stamp matches the version and flags is left alone.
#
#   bash scripts/build_llamacpp.sh            # -> .llamacpp/bin/llama-server ...
#
# AMX is off: llama.cpp's native build uses it and dies with SIGILL on these
# virtual machines. The AVX-512 flags are turned on only when the host has
# AVX-512 (F, VNNI, BF16), so the build runs on AVX2-only hosts too; the
# flags used are written to .llamacpp/FLAGS.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
OUT="$ROOT/.llamacpp"
JOBS="${JOBS:-$(nproc)}"

has() { grep -qw "$1" /proc/cpuinfo; }
on_if() { if has "$1"; then echo ON; else echo OFF; fi; }
FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
  "-DGGML_AVX512=$(on_if avx512f)" "-DGGML_AVX512_VNNI=$(on_if avx512_vnni)"
  "-DGGML_AVX512_BF16=$(on_if avx512_bf16)" "-DGGML_AVX_VNNI=$(on_if avx_vnni)"
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
  -DLLAMA_CURL=OFF -DGGML_OPENMP=ON -DCMAKE_BUILD_TYPE=Release
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON)
STAMP="$VERSION ${FLAGS[*]}"
if [ -x "$OUT/bin/llama-server" ] && [ "$(cat "$OUT/STAMP" 2>/dev/null)" = "$STAMP" ]; then
  echo "build_llamacpp: up to date ($OUT/bin)" >&2
  exit 0
fi

mkdir -p "$OUT"
# CMake (and ninja) from PyPI, in a venv of their own.
if [ ! -x "$OUT/venv/bin/cmake" ]; then
  python3 -m venv "$OUT/venv"
  "$OUT/venv/bin/pip" install --quiet --disable-pip-version-check 'cmake==3.31.6' 'ninja==1.11.1.4'
fi
# The sdist, not a wheel: it carries llama.cpp's source in vendor/llama.cpp.
if [ ! -d "$OUT/src/vendor/llama.cpp" ]; then
  rm -rf "$OUT/dl" "$OUT/src"
  "$OUT/venv/bin/pip" download --quiet --disable-pip-version-check --no-deps \
    --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$OUT/dl"
  mkdir -p "$OUT/src"
  tar -xzf "$OUT"/dl/llama_cpp_python-*.tar.gz -C "$OUT/src" --strip-components=1
fi
export PATH="$OUT/venv/bin:$PATH"
cmake -S "$OUT/src/vendor/llama.cpp" -B "$OUT/build" -G Ninja "${FLAGS[@]}"
cmake --build "$OUT/build" -j "$JOBS" --target llama-server llama-bench llama-perplexity llama-batched-bench
mkdir -p "$OUT/bin"
for t in llama-server llama-bench llama-perplexity llama-batched-bench; do
  cp "$OUT/build/bin/$t" "$OUT/bin/"
done
# Shared libraries, if the build made any.
find "$OUT/build" -name '*.so*' -exec cp -P {} "$OUT/bin/" \; 2>/dev/null || true
printf '%s\n' "${FLAGS[@]}" > "$OUT/FLAGS"
echo "$STAMP" > "$OUT/STAMP"
echo "build_llamacpp: built $("$OUT/bin/llama-server" --version 2>&1 | head -2 | tr '\n' ' ') -> $OUT/bin" >&2
