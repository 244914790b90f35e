#!/usr/bin/env bash
# One prepared run on a GPU machine (the project's device tool), issue 75: tests/test_gpu.py (the GPU path,
# and every family in float16 and bfloat16 against a current transformers on the same GPU), each step under
# its own time limit, the figures as JSON.
#   bash benchmarks/gpu/families_check.sh [OUT_DIR] [WHEELS]   # OUT_DIR: $OUT, else /tmp/gpu_check; WHEELS: .whl
# The Petals stack from WHEELS (benchmarks/gpu/fetch_wheels.sh) into /tmp/site, on PYTHONPATH for dist_eval;
# the reference (tests/reference/*.py) runs on the machine's own python3 without that path: its own
# transformers (5.17 on the device tool's image). GPU_TESTS: the pytest -k expression (default: all).
# GPU_BENCH_LEFT: with this many seconds left of GPU_TOTAL (default 400) after the tests, a 1B benchmark
# (GPU_BENCH_ARGS) runs in the rest.
set -u
OUT_DIR=${1:-${OUT:-/tmp/gpu_check}}
WHEELS=${2:-.whl}
mkdir -p "$OUT_DIR"
step() {  # step NAME SECONDS CMD...: run one step under a limit, its log and time kept
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - start))" | tee -a "$OUT_DIR/steps.txt"
  tail -n 40 "$OUT_DIR/$name.log"
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
  || exit 1
# the machine's own tokenizers (0.23 on the image), not the wheel's 0.15: the reference's tokenizer.json files
# have merges saved as pairs, which tokenizers < 0.20 does not read (the project's environment has 0.22)
rm -rf /tmp/site/tokenizers /tmp/site/tokenizers-*.dist-info
sed -i 's/"tokenizers>=0.11.1,!=0.11.3,<0.14"/"tokenizers>=0.11.1"/' /tmp/site/transformers/dependency_versions_table.py
{ nvidia-smi -L; env -u PYTHONPATH python3 -c "import transformers, tokenizers, torch
print('reference (no PYTHONPATH): transformers', transformers.__version__, 'tokenizers', tokenizers.__version__,
'torch', torch.__version__)"; } | tee "$OUT_DIR/machine.txt"
export PYTHONPATH=$PWD/benchmarks/gpu/stubs:/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DIST_EVAL_ROW_STORE=off
export DIST_EVAL_GPU_REPORT_DIR=$OUT_DIR
python3 -c "import importlib.metadata as m, os, sys, torch; print(sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'cpus', os.cpu_count(),
*(f'{p} {m.version(p)}' for p in ('transformers', 'petals', 'hivemind', 'tokenizers', 'datasets')))" \
  | tee -a "$OUT_DIR/machine.txt"
step test_gpu "${GPU_TEST_LIMIT:-330}" python3 -m pytest -n 0 -p no:cacheprovider -m gpu tests/test_gpu.py \
  -v -rA --durations=15 --timeout "${GPU_TEST_TIMEOUT:-320}" -k "${GPU_TESTS:-}"
LEFT=$(( ${GPU_TOTAL:-400} - SECONDS ))
if [[ -n "${GPU_BENCH_ARGS:-}" && $LEFT -ge ${GPU_BENCH_LEFT:-150} ]]; then
  # shellcheck disable=SC2086
  step bench_1b "$LEFT" python3 benchmarks/bench_gpu.py --out "$OUT_DIR/gpu_1b.json" $GPU_BENCH_ARGS
fi
ps -ef | grep -E "petals|hivemind|p2pd|torchrun" | grep -v grep || echo "no process left"
