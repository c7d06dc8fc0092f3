#!/usr/bin/env bash
# Build, on a machine with the Rust toolchain (no GPU needed), everything
# scripts/gpu_check.sh runs on the GPU machine, which needs no Rust
# toolchain: the release test binaries of p03/p11 and their two commands,
# stripped, into gpu-bin/ (git-ignored). Also records the commit they were
# built at, for the rows.
#
#   here:   bash scripts/gpu_build.sh
#   then copy the repository, gpu-bin/ included, to the GPU machine;
#   there:  bash scripts/gpu_check.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BIN="$ROOT/gpu-bin"
rm -rf "$BIN"
mkdir -p "$BIN/tests"

# The commands.
cargo build --release -p p03_gpu_kernel -p p11_gpu_bench --bins
cp target/release/p03_gpu_kernel target/release/p11_gpu_bench "$BIN/"

# The test binaries (unit tests of both libraries and their GPU tests), by
# the paths cargo reports.
cargo test --release --no-run -p p03_gpu_kernel -p p11_gpu_bench --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys, shutil, os
dest = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    t = m["target"]
    if t["kind"] == ["bin"]:
        continue  # the commands themselves, copied above
    crate = m["package_id"].split("#")[0].rstrip("/").split("/")[-1]
    crate = m["target"]["name"] if t["kind"] == ["lib"] else crate
    name = (m["target"]["name"] + "-unit") if t["kind"] == ["lib"] else (crate + "-" + t["name"])
    shutil.copy(m["executable"], os.path.join(dest, name))
    print("test binary:", name)
' "$BIN/tests"

strip "$BIN"/p03_gpu_kernel "$BIN"/p11_gpu_bench "$BIN"/tests/*
# The shared libraries the commands link for plotting (fontconfig, freetype
# and theirs), used on the GPU machine only if its own are missing, and one
# font with a fontconfig file naming it (a bare machine may have no fonts).
mkdir -p "$BIN/lib" "$BIN/fonts"
ldd "$BIN/p11_gpu_bench" | awk '/=>/{print $3}' \
  | grep -v -E '/(libc|libm|libgcc_s|libpthread|libdl|ld-linux[^/]*)\.so' \
  | while read -r lib; do cp -L "$lib" "$BIN/lib/"; done
cp -L "$(fc-match -f '%{file}' sans-serif)" "$BIN/fonts/"
cat > "$BIN/fonts/fonts.conf" <<'XML'
<?xml version="1.0"?>
<!DOCTYPE fontconfig SYSTEM "fonts.dtd">
<fontconfig>
  <dir prefix="relative">.</dir>
  <include ignore_missing="yes">/etc/fonts/fonts.conf</include>
</fontconfig>
XML
# What the binaries were built from: gpu_check.sh refuses to run them
# against a tree whose sources differ (a stale gpu-bin tests old kernels).
git ls-files -- common p01_engine p02_matmul_bench p03_gpu_kernel p11_gpu_bench \
  | grep -E '\.(rs|cu|h|cpp|toml)$' | xargs sha256sum > "$BIN/SOURCES"
git rev-parse --short=10 HEAD > "$BIN/COMMIT"
if [ -n "$(git status --porcelain --untracked-files=no -- . ':!numbers.md' ':!*/plots/*')" ]; then
  echo "$(cat "$BIN/COMMIT")-dirty" > "$BIN/COMMIT"
fi
# The newest glibc symbol version the binaries need (gpu_check.sh logs it
# beside the GPU machine's own glibc, which must be at least that).
need="$(objdump -T "$BIN"/p03_gpu_kernel "$BIN"/p11_gpu_bench "$BIN"/tests/* 2>/dev/null \
  | grep -o 'GLIBC_[0-9.]*' | sort -V | tail -1)"
echo "$need" > "$BIN/GLIBC"
du -sh "$BIN"
ls -la "$BIN" "$BIN/tests"
echo "built at $(cat "$BIN/COMMIT"); newest glibc symbol needed: $need"
