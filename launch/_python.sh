# Sourced by the launch scripts: ROOT (the repository), PYTHON (the repository's .venv if
# there, else python3, unless PYTHON is set) and a PYTHONPATH that finds this checkout.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  PYTHON=python3
  [[ -x "$ROOT/.venv/bin/python" ]] && PYTHON="$ROOT/.venv/bin/python"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # a source checkout works without installing
