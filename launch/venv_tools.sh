# Sourced by launch/install.sh and launch/install_reference.sh (not run on its own): the one way
# this project makes a virtual environment and installs into it.
#
# uv installs where it can be had (several times faster than pip: it unpacks in parallel and
# does not byte-compile torch's thousands of files up front), else pip. uv does not read pip's
# configuration, so the find-links and index of `pip config` / PIP_* variables are passed on
# (a machine whose torch wheel lies in a local folder keeps using it).

# make_venv VENV PYTHON: create VENV with PYTHON's venv module unless it exists; then set INSTALL
# to the install command for it (an array: "${INSTALL[@]}" PACKAGE ...).
make_venv() {
  local venv="$1" python="$2"
  [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
  local pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
  # -q twice for uv itself: pip's warnings about the configured indexes (a file:// index without
  # uv in it) are not the install's output
  if [[ "${DIST_EVAL_INSTALLER:-uv}" == uv ]] && { "$venv/bin/python" -m uv --version >/dev/null 2>&1 || "${pip[@]}" -q uv; }; then
    INSTALL=("$venv/bin/python" -m uv pip install -q --python "$venv/bin/python")
    local links index
    links="${PIP_FIND_LINKS:-$("$venv/bin/python" -m pip config get global.find-links 2>/dev/null || true)}"
    index="${PIP_INDEX_URL:-$("$venv/bin/python" -m pip config get global.index-url 2>/dev/null || true)}"
    for link in $links; do
      if [[ -e "$link" || "$link" == *://* ]]; then INSTALL+=(--find-links "$link"); fi
    done
    if [[ -n "$index" ]]; then INSTALL+=(--index-url "$index"); fi
  else
    INSTALL=("${pip[@]}")
  fi
}

# compile_venv VENV [DIR...]: write the bytecode of every module in VENV's site-packages (and in
# each DIR) now. uv installs without it, and where PYTHONDONTWRITEBYTECODE is set (as on the
# machine this project is developed on) Python never writes it either: every process compiles torch,
# transformers, datasets and petals from source again (benchmarks/RESULTS.md: "bytecode").
# A file written for a newer Python (torch ships one) fails alone and is skipped.
compile_venv() {
  local venv="$1"
  shift
  "$venv/bin/python" - "$@" <<'PY'
import compileall, sys, sysconfig

for folder in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.argv[1:]]):
    compileall.compile_dir(folder, quiet=2, workers=0)
PY
}
