#!/usr/bin/env bash
# Create (or reuse) .venv-reference/: a current transformers, for checking dist_eval's newer
# families and tokenizers against computations nobody in this project wrote
# (tests/reference/make_reference.py runs in it; tests/test_families_reference.py compares).
#
#   ./launch/install_reference.sh     # idempotent: returns at once when the venv is complete
#
# It never imports dist_eval, and dist_eval never imports from it: the project's own
# environment (.venv, launch/install.sh) keeps petals' pinned transformers.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DIST_EVAL_REFERENCE_VENV:-$ROOT/.venv-reference}"
PYTHON="${DIST_EVAL_PYTHON:-python3}"
TORCH_SPEC="${DIST_EVAL_TORCH:-torch==2.13.0}"
# the reference: the last transformers 4.x and the tokenizers it pins (saved since late 2024)
REFERENCE=("transformers==4.57.6" "tokenizers>=0.22,<0.23" safetensors numpy)
STAMP="$VENV/.dist_eval_reference_installed"
WANT="$(cat "$ROOT/launch/install_reference.sh" "$ROOT/launch/venv_tools.sh" | sha256sum | cut -d' ' -f1)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec(\"transformers\") is None)" 2>/dev/null; then
  exit 0
fi
echo "[install_reference] setting up $VENV" >&2
source "$ROOT/launch/venv_tools.sh"
make_venv "$VENV" "$PYTHON"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "${INSTALL[@]}" "$TORCH_SPEC"  # first, alone: nothing later pulls a CUDA build
fi
"${INSTALL[@]}" "${REFERENCE[@]}"
echo "$WANT" > "$STAMP"
echo "[install_reference] done: $VENV" >&2
