#!/usr/bin/env bash
# One prepared run on a GPU machine without package access (the project's device tool: carry
# .whl, fetched first with benchmarks/gpu/fetch_wheels.sh): installs the Petals stack from the
# wheels, runs the GPU tests (tests/test_gpu.py), then benchmarks/bench_gpu.py on the 1B model,
# each step with its own time limit so that a hang in one still leaves the others' results.
#   bash benchmarks/gpu/device_check.sh [OUT_DIR]      # OUT_DIR: $OUT, else /tmp/gpu_check
# Every log and the benchmark's JSON go to OUT_DIR; the steps' times to OUT_DIR/steps.txt.
set -u
OUT_DIR=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT_DIR"
step() {  # step NAME SECONDS CMD...: run one step under a limit, its log and time kept
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - start))" | tee -a "$OUT_DIR/steps.txt"
  tail -n 25 "$OUT_DIR/$name.log"
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
sed -i 's/"tokenizers>=0.11.1,!=0.11.3,<0.14"/"tokenizers>=0.11.1"/' /tmp/site/transformers/dependency_versions_table.py
export PYTHONPATH=$PWD/benchmarks/gpu/stubs:/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DIST_EVAL_ROW_STORE=off
nvidia-smi -L
python3 -c "import importlib.metadata as m, os, sys, torch; print(sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'cpus', os.cpu_count(),
*(f'{p} {m.version(p)}' for p in ('transformers', 'petals', 'hivemind', 'tokenizers', 'datasets')))" \
  | tee "$OUT_DIR/machine.txt"
if [[ -z "${GPU_SKIP_TESTS:-}" ]]; then
  step test_gpu "${GPU_TEST_LIMIT:-240}" python3 -m pytest -n 0 -p no:cacheprovider -m gpu tests/test_gpu.py \
    -v -rA --durations=10 --timeout 200
fi
# GPU_BENCH_ARGS: more bench_gpu.py flags (e.g. --dtype bfloat16); GPU_BENCH2_ARGS: a second benchmark
# run with these flags instead (e.g. --ranks 1 --dist-eval-args="--dist-backend nccl"), its JSON gpu_1b_2.json
# shellcheck disable=SC2086
step bench_1b "${GPU_BENCH_LIMIT:-300}" python3 benchmarks/bench_gpu.py --repeats "${GPU_BENCH_REPEATS:-1}" \
  --ranks "${GPU_BENCH_RANKS:-1,4,16}" --own-swarm-ranks "${GPU_OWN_SWARM_RANKS:-4}" --out "$OUT_DIR/gpu_1b.json" \
  ${GPU_BENCH_ARGS:-}
if [[ -n "${GPU_BENCH2_ARGS:-}" ]]; then
  # shellcheck disable=SC2086
  eval "step bench_1b_2 ${GPU_BENCH_LIMIT:-300} python3 benchmarks/bench_gpu.py --out $OUT_DIR/gpu_1b_2.json $GPU_BENCH2_ARGS"
fi
ps -ef | grep -E "petals|hivemind|p2pd|torchrun" | grep -v grep || echo "no process left"
