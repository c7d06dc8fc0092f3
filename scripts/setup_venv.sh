#!/usr/bin/env bash
# Create .venv-NAME with what scripts/requirements-NAME.txt pins, and check
# that MODULE imports from it. Idempotent: a venv whose stamp matches the
# requirements file is left alone. Serialised with flock, since parallel
# tests may call it.
#   bash scripts/setup_venv.sh NAME MODULE     (e.g. client openai, ray ray)
set -euo pipefail
NAME="${1:?usage: setup_venv.sh NAME MODULE}"
MODULE="${2:?usage: setup_venv.sh NAME MODULE}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-$NAME"
REQ="$ROOT/scripts/requirements-$NAME.txt"
[ -f "$REQ" ] || { echo "setup_venv: no $REQ" >&2; exit 1; }
mkdir -p "$ROOT/target"
exec 9>"$ROOT/target/.setup_${NAME}_venv.lock"
flock 9
want="$(sha256sum "$REQ" | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
command -v python3 >/dev/null || { echo "setup_venv: python3 is needed (apt-get install python3 python3-venv)" >&2; exit 1; }
rm -rf "$VENV"
python3 -m venv "$VENV" || { echo "setup_venv: python3 -m venv failed (apt-get install python3-venv)" >&2; exit 1; }
"$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$REQ"
echo "$want" > "$VENV/.stamp"
echo "setup_venv: $("$VENV/bin/python" -c "import $MODULE; print('$MODULE', $MODULE.__version__)") -> $VENV" >&2
