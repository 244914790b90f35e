#!/usr/bin/env bash
# Create (or reuse) a reference environment: a current transformers, for checking dist_eval's
# families, config forms, tokenizers and PEFT adapters against computations nobody in this
# project wrote (tests/reference/make_reference.py runs in it; tests/test_families_reference.py compares).
#
#   ./launch/install_reference.sh       # .venv-reference/: the last transformers 4.x (4.57.6)
#   ./launch/install_reference.sh 5     # .venv-reference5/: transformers 5.x (5.23.0), its hub and PEFT, and
#                                       # dist_eval without its swarm (the current stack, as a user installs it)
#   ./launch/install_reference.sh pinned  # .venv-pinned/: the 2023 stack petals 2.2 pins (transformers 4.33),
#                                       # where stock petals servers run: the swarms others run (petals' own code)
#
# Two generations because they save config.json in two forms (transformers 5.x moved rope_theta and
# rope_scaling into rope_parameters, and renamed fields): a model may come from either.
# Idempotent: returns at once when the venv is complete. The reference scripts never import dist_eval,
# and dist_eval never imports from them: the project's own environment (.venv, launch/install.sh) is apart.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GENERATION="${1:-4}"
PYTHON="${DIST_EVAL_PYTHON:-python3}"
TORCH_SPEC="${DIST_EVAL_TORCH:-torch==2.13.0}"
NO_DEPS=()  # installed after REFERENCE, with --no-deps
case "$GENERATION" in
  # the last transformers 4.x and the tokenizers it pins (saved since late 2024)
  4) VENV="${DIST_EVAL_REFERENCE_VENV:-$ROOT/.venv-reference}"
     REFERENCE=("transformers==4.57.6" "tokenizers>=0.22,<0.23" safetensors numpy) ;;
  # transformers 5.x with the hub and tokenizers it asks for, a current PEFT (its adapters' reference), this
  # project (editable) with its own dependencies resolved beside them, the extra "petals" left out: what a user of
  # a current stack installs (the suite runs the CLI and evaluate() here); and petals 2.2 beside them, its run-time
  # needs first and itself with --no-deps as launch/install.sh does (its metadata pins the 2023 transformers):
  # petals' client and dist_eval's servers on transformers 5.x, through the bridges of backends/petals/shims.py
  5) VENV="${DIST_EVAL_REFERENCE5_VENV:-$ROOT/.venv-reference5}"
     REFERENCE=("transformers==5.23.0" "peft==0.21.2" safetensors numpy -e "$ROOT"
                "hivemind==1.1.12" "pydantic>=2" "tensor_parallel==1.0.23" "speedtest-cli==2.1.3" humanfriendly
                async-timeout sentencepiece Dijkstar cpufeature requests)
     NO_DEPS=("petals==2.2.0.post1" "bitsandbytes==0.41.1") ;;
  # the stack petals 2.2.0.post1's metadata pins (dist_eval's own install until issue 71), hivemind 1.1.12 for the
  # p2pd in its wheel: stock petals servers run here (tests/stock_petals_server.py), and this project (editable,
  # --no-deps: its bridges are no-ops on this stack) to start them as its swarm does; the pinned stack's side of
  # tests/test_current_stack.py
  pinned) VENV="${DIST_EVAL_PINNED_VENV:-$ROOT/.venv-pinned}"
     REFERENCE=("transformers>=4.32,<4.35" "huggingface-hub>=0.23,<1.0" "tokenizers<0.14" "peft==0.5.0" accelerate
                "hivemind==1.1.12" "pydantic>=2" "tensor_parallel==1.0.23" "speedtest-cli==2.1.3" humanfriendly
                async-timeout sentencepiece safetensors Dijkstar cpufeature datasets numpy scikit-learn scipy jinja2
                tqdm matplotlib packaging)
     NO_DEPS=("petals==2.2.0.post1" "bitsandbytes==0.41.1" -e "$ROOT") ;;
  *) echo "install_reference.sh: generation '$GENERATION': expected 4, 5 or pinned" >&2; exit 2 ;;
esac
STAMP="$VENV/.dist_eval_reference_installed"
WANT="$(cat "$ROOT/launch/install_reference.sh" "$ROOT/launch/venv_tools.sh" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"

installed() {
  [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec(\"transformers\") is None)" 2>/dev/null
}
if installed; then
  exit 0
fi
# one install of an environment at a time (two test files, in two pytest workers, may ask for it at once):
# the second waits, then finds it complete
if command -v flock >/dev/null; then
  exec 9>"$VENV.lock"
  flock 9
  if installed; then
    exit 0
  fi
fi
echo "[install_reference] setting up $VENV" >&2
source "$ROOT/launch/venv_tools.sh"
make_venv "$VENV" "$PYTHON"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "${INSTALL[@]}" "$TORCH_SPEC"  # first, alone: nothing later pulls a CUDA build
fi
"${INSTALL[@]}" "${REFERENCE[@]}"
if [[ -n "${NO_DEPS[*]:-}" ]]; then
  "${INSTALL[@]}" --no-deps "${NO_DEPS[@]}"
fi
# the bytecode of what the reference scripts import, written once: where PYTHONDONTWRITEBYTECODE is set, each
# reference process would compile transformers from source again (about 10 s of CPU a process here). Only
# what they import (compile_venv's whole site-packages, torch's thousands of files, took 50 s)
PYTHONDONTWRITEBYTECODE= "$VENV/bin/python" - <<'PY'
import importlib
import importlib.util

import torch  # noqa: F401
import transformers

for family in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "mixtral", "deepseek_v3", "llama4",
               "bloom", "falcon"):
    if importlib.util.find_spec(f"transformers.models.{family}"):  # the pinned 4.33 has the first five alone
        importlib.import_module(f"transformers.models.{family}.modeling_{family}")
transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast  # noqa: B018 (the lazy tokenizer modules)
if importlib.util.find_spec("peft"):
    import peft  # noqa: F401
for name in ("hivemind", "petals"):  # imported by a swarm's servers and clients only after the bridges: compiled
    if importlib.util.find_spec(name):
        import compileall, os
        compileall.compile_dir(os.path.dirname(importlib.util.find_spec(name).origin), quiet=1)
PY
echo "$WANT" > "$STAMP"
echo "[install_reference] done: $VENV" >&2
