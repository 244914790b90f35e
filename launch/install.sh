#!/usr/bin/env bash
# Create (or reuse) .venv/ at the repository root with a working Petals stack.
#
#   ./launch/install.sh            # idempotent: returns at once when .venv is complete
#   DIST_EVAL_PYTHON=python3.11 ./launch/install.sh
#   DIST_EVAL_TORCH="torch==2.13.0" ./launch/install.sh   # torch spec for a fresh venv
#
#   DIST_EVAL_INSTALLER=pip ./launch/install.sh           # pip instead of uv (launch/venv_tools.sh)
#
# The current stack: transformers 5.x with the huggingface-hub and tokenizers it asks for, a current peft, and
# petals 2.2 beside them. Why not `pip install petals`: petals 2.2.0.post1's metadata pins the 2023 stack
# (transformers <4.35, huggingface-hub <1.0, peft 0.5.0, tokenizers 0.13) and hivemind==1.1.10.post2, whose sdist
# downloads the p2pd binary at build time (fails offline / air-gapped), and pydantic<2. hivemind 1.1.12 ships p2pd
# in its wheel; dist_eval/backends/petals/shims.py bridges what petals needs of the older packages (each bridge
# with the versions it bridges), nothing installed is edited. So petals goes in with --no-deps, after its real
# needs. The 2023 stack petals pins, where stock petals servers run, is launch/install_reference.sh pinned.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DIST_EVAL_VENV:-$ROOT/.venv}"
PYTHON="${DIST_EVAL_PYTHON:-python3}"
TORCH_SPEC="${DIST_EVAL_TORCH:-torch==2.13.0}"
STAMP="$VENV/.dist_eval_installed"
# The stamp holds a hash of what was installed; a change of this script or of
# pyproject.toml re-runs the install.
WANT="$(cat "$ROOT/launch/install.sh" "$ROOT/launch/venv_tools.sh" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && "$VENV/bin/python" -c "import dist_eval" 2>/dev/null; then
  exit 0
fi

# pyproject.toml's requires-python, said in one line before a venv is made of another Python
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
  FOUND="$("$PYTHON" --version 2>/dev/null)" || FOUND="not found"
  echo "[install] error: DIST_EVAL_PYTHON=$PYTHON is ${FOUND:-not found}; dist_eval needs Python >= 3.11. Pass DIST_EVAL_PYTHON=python3.11 (or a newer one)." >&2
  exit 1
fi
echo "[install] setting up $VENV (about a minute on first run)" >&2
source "$ROOT/launch/venv_tools.sh"
make_venv "$VENV" "$PYTHON"

# 1. torch first, on its own, so nothing later pulls a multi-GB CUDA build.
#    A torch >= 2.6 already in the venv (e.g. a CUDA build on a GPU cluster) is kept; an older one
#    is replaced: before 2.6, torch.load (petals' and transformers 4.33's reading of a
#    pytorch_model.bin) runs the file's pickled code (pyproject.toml asks for torch>=2.6).
TORCH_AT_LEAST_2_6='import re, sys, torch; sys.exit(tuple(map(int, re.findall(r"\d+", torch.__version__)[:2])) < (2, 6))'
if ! "$VENV/bin/python" -W ignore -c "$TORCH_AT_LEAST_2_6" 2>/dev/null; then
  if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "[install] torch $("$VENV/bin/python" -W ignore -c "import torch; print(torch.__version__)" 2>/dev/null) is older than 2.6: installing $TORCH_SPEC" >&2
  fi
  "${INSTALL[@]}" "$TORCH_SPEC"
  if ! "$VENV/bin/python" -W ignore -c "$TORCH_AT_LEAST_2_6"; then
    echo "[install] error: DIST_EVAL_TORCH=$TORCH_SPEC installs a torch older than 2.6; dist_eval needs torch>=2.6. Pass a spec of 2.6 or later." >&2
    exit 1
  fi
fi

# 2. the current transformers and peft, petals' real run-time needs (its own metadata pins are stale) + ours.
"${INSTALL[@]}" \
  "transformers==5.23.0" "peft==0.21.2" "hivemind==1.1.12" "pydantic>=2" \
  accelerate "tensor_parallel==1.0.23" "speedtest-cli==2.1.3" \
  humanfriendly async-timeout sentencepiece safetensors Dijkstar cpufeature requests \
  datasets numpy scikit-learn scipy jinja2 tqdm matplotlib pytest pytest-random-order pytest-xdist ruff statsmodels

# 3. petals itself and bitsandbytes (imported by the server; CPU works unquantized).
"${INSTALL[@]}" --no-deps "petals==2.2.0.post1" "bitsandbytes==0.41.1"

# 4. this project, editable, without re-resolving anything.
"${INSTALL[@]}" --no-deps -e "$ROOT"

# 5. every module's bytecode, once (launch/venv_tools.sh: compile_venv)
compile_venv "$VENV" "$ROOT/dist_eval"

echo "$WANT" > "$STAMP"
echo "[install] done: $VENV" >&2
