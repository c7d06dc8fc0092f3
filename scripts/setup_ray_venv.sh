#!/usr/bin/env bash
# Create .venv-ray with Ray Serve (pinned in
# scripts/requirements-ray.txt). Idempotent: a venv whose stamp matches
# the requirements file is left alone. Serialised with flock, since parallel
# tests may call it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-ray"
REQ="$ROOT/scripts/requirements-ray.txt"
mkdir -p "$ROOT/target"
exec 9>"$ROOT/target/.setup_ray_venv.lock"
flock 9
want="$(sha256sum "$REQ" | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
command -v python3 >/dev/null || { echo "setup_ray_venv: python3 is needed (apt-get install python3 python3-venv)" >&2; exit 1; }
rm -rf "$VENV"
python3 -m venv "$VENV" || { echo "setup_ray_venv: python3 -m venv failed (apt-get install python3-venv)" >&2; exit 1; }
"$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$REQ"
echo "$want" > "$VENV/.stamp"
echo "setup_ray_venv: $("$VENV/bin/python" -c 'import ray; print("ray", ray.__version__)') -> $VENV" >&2
