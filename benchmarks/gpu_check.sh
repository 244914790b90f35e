#!/usr/bin/env bash
# One-shot GPU check, one command on the project's device machine (one GPU, no package registry), at most
# GPU_TOTAL seconds (default 470) of wall time, every phase under its own `timeout`, in priority order:
#   1. setup: the Petals stack from .whl/ into /tmp/site (the image's own tokenizers kept), versions, nvidia-smi
#   2. test_gpu: pytest -m gpu tests/test_gpu.py (default: all but the families' swarm test, ~6 min alone)
#   3. bench_gpu: benchmarks/bench_gpu.py, the 1B TinyLlama-shaped model in fp16, 2000 rows: the seeds' loop
#      (petals' own client, batch 16), dist_eval's defaults at N=2 and N=4, the model in-process; 3 round-robin
#      repeats, cut to the phase's time (--time-budget)
#   4. startup: if time is left, one `torchrun -m dist_eval` N=4 with its own local swarm on the same 1B model
#      (the run's time line: start-up by phase)
# Everything goes to OUT_DIR (at most 8 files): summary.txt ("PHASE name rc=N seconds=S" lines, versions, what
# was left running), test_gpu.log, test_gpu.xml, families_local.json, bench_gpu.log, gpu_1b.json, startup.log.
# Processes left at the end (the swarm servers start in sessions of their own) are found by a tag in their
# environment (GPU_CHECK_TAG) and killed: only those this script started.
#
# Reproduce (from the repository root):
#   ../shared/gpu/fetch_wheels.sh        # here, with package access: .whl/ (~44 MB, git-ignored)
#   mkdir -p .gpu/stubs && cp ../shared/gpu/sitecustomize.py .gpu/stubs/ && echo /.gpu/ >> .git/info/exclude
#   device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ".gpu"], timeout_s=540)
#   a dry run on a CPU machine (no install; the GPU tests deselected, bench_gpu refused at once without CUDA):
#   GPU_SKIP_INSTALL=1 GPU_PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh /tmp/gpu_dry
# Knobs: GPU_TOTAL, GPU_TEST_LIMIT (200), GPU_TESTS (a pytest -k expression; "" runs the whole file),
# GPU_BENCH_LIMIT (260), GPU_BENCH_ARGS (bench_gpu.py flags, replacing the 1B defaults below), GPU_SKIP_INSTALL,
# GPU_PYTHON (python3).
set -u
OUT_DIR=${1:-${OUT:-/tmp/gpu_check}}
PY=${GPU_PYTHON:-python3}
TOTAL=${GPU_TOTAL:-470}
RESERVE=15  # seconds kept for the sweep at the end
KEEP=${GPU_BENCH_KEEP:-/tmp/gpu_check_bench}
SUMMARY=$OUT_DIR/summary.txt
mkdir -p "$OUT_DIR"
TAG=gpucheck-$$-$RANDOM
export GPU_CHECK_TAG=$TAG

say() { echo "$*" | tee -a "$SUMMARY"; }
cap() { local left=$((TOTAL - SECONDS - RESERVE)); echo $(($1 < left ? $1 : left)); }
phase() {  # phase NAME LIMIT LOG CMD...: CMD under `timeout LIMIT`, its output to LOG, its tail to stdout
  local name=$1 limit=$2 log=$3 start=$SECONDS rc
  shift 3
  if ((limit < 20)); then
    say "PHASE $name rc=skipped seconds=0 (only $((TOTAL - SECONDS))s of ${TOTAL}s left)"
    return 99
  fi
  echo "== $name (limit ${limit}s, at ${SECONDS}s)"
  timeout --kill-after=15 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  say "PHASE $name rc=$rc seconds=$((SECONDS - start)) limit=$limit$( ((rc == 124 || rc == 137)) && echo ' TIMED OUT')"
  tail -n "${TAIL_LINES:-25}" "$log" | cut -c1-400
  return $rc
}
sweep() {  # kill what this script started and left running (found by GPU_CHECK_TAG in its environment)
  local p pids=()
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [[ $p == "$$" || $p == "$BASHPID" ]] && continue
    grep -qzxF "GPU_CHECK_TAG=$TAG" "/proc/$p/environ" 2>/dev/null && pids+=("$p")
  done
  if ((${#pids[@]})); then
    say "left running at the end (killed): $(ps -o pid=,args= -p "$(IFS=,; echo "${pids[*]}")" 2>/dev/null \
      | cut -c1-150 | tr '\n' ';')"
    kill -TERM "${pids[@]}" 2>/dev/null; sleep 3; kill -KILL "${pids[@]}" 2>/dev/null
  else
    say "left running at the end: none"
  fi
}
trap 'sweep' EXIT

say "gpu_check $(date -u +%FT%TZ) total=${TOTAL}s out=$OUT_DIR python=$PY $(md5sum benchmarks/gpu_check.sh \
  benchmarks/bench_gpu.py tests/test_gpu.py tests/reference/gpu_reference.py 2>/dev/null | cut -c1-8 | tr '\n' ' ')"

# ---- 1. setup
if [[ -z ${GPU_SKIP_INSTALL:-} ]]; then
  phase setup "$(cap 150)" "$SUMMARY" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || { say "setup failed: stopping"; exit 1; }
  # the image's own tokenizers (0.23), not the wheel's 0.15: the reference's tokenizer.json files (merges saved as
  # pairs) need >= 0.20, as in the project's own environment (0.22); transformers 4.33's version check relaxed
  rm -rf /tmp/site/tokenizers /tmp/site/tokenizers-*.dist-info
  sed -i 's/"tokenizers>=0.11.1,!=0.11.3,<0.14"/"tokenizers>=0.11.1"/' \
    /tmp/site/transformers/dependency_versions_table.py
  STUBS=$PWD/.gpu/stubs
  [[ -f $STUBS/sitecustomize.py ]] || STUBS=$PWD/benchmarks/gpu/stubs  # the tracked copy
  export PYTHONPATH=$STUBS:/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DIST_EVAL_ROW_STORE=off DIST_EVAL_GPU_REPORT_DIR=$OUT_DIR
{
  nvidia-smi -L 2>&1 || echo "nvidia-smi: none"
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader 2>&1 | head -4
  timeout 60 "$PY" -c "import importlib.metadata as m, os, sys, torch
print('project stack: python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA', 'cpus', os.cpu_count())
for p in ('transformers', 'tokenizers', 'petals', 'hivemind', 'datasets', 'huggingface_hub', 'pytest-timeout'):
    try:
        print(' ', p, m.version(p))
    except m.PackageNotFoundError:
        print(' ', p, 'not installed')
import transformers, tokenizers
from dist_eval.backends.petals.shims import import_petals  # the one way dist_eval imports petals
print('  imported: transformers', transformers.__version__, transformers.__file__, 'tokenizers', tokenizers.__version__,
      'petals', import_petals().__version__)" 2>&1 | tail -20
  timeout 60 env -u PYTHONPATH "$PY" -c "import transformers, tokenizers, torch
print('reference (no PYTHONPATH): transformers', transformers.__version__, 'tokenizers', tokenizers.__version__)" \
    2>&1 | tail -2
  # a local swarm of several servers forks them from one process that imported their libraries (swarm/forks.py,
  # new since the last GPU run): does that import touch CUDA here, and can a child forked after the parent's
  # torch.cuda.is_available() (what transformers' bitsandbytes check calls where bitsandbytes is installed) use it?
  timeout 90 "$PY" -c "import importlib, os, torch, torch.cuda as tc
calls = []
for name in ('is_available', 'device_count', '_lazy_init', 'current_device', 'get_device_properties'):
    def wrap(*a, _orig=getattr(tc, name), _name=name, **k):
        calls.append(_name)
        return _orig(*a, **k)
    setattr(tc, name, wrap)
from dist_eval.backends.petals.shims import import_petals
from dist_eval.swarm.forks import _PRELOAD
import_petals()
for m in _PRELOAD:
    importlib.import_module(m)
print('fork probe: CUDA calls in the fork server imports:', calls or 'none', 'initialized:', tc.is_initialized())
print('fork probe: parent is_available', tc.is_available(), 'initialized', tc.is_initialized(), flush=True)
pid = os.fork()
if pid == 0:
    try:
        print('fork probe: child forked after is_available(): cuda', float(torch.ones(4, device='cuda').sum()), flush=True)
        os._exit(0)
    except Exception as e:
        print('fork probe: child forked after is_available(): CUDA FAILS:', type(e).__name__, str(e)[:300], flush=True)
        os._exit(1)
print('fork probe: child exit', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))" 2>&1 | grep -E "fork probe|Error" | tail -6
} | tee -a "$SUMMARY"

# ---- 2. the GPU tests
TIMEOUT_OPT=()
TEST_LIMIT=$(cap "${GPU_TEST_LIMIT:-200}")
if "$PY" -c "import pytest_timeout" 2>/dev/null; then TIMEOUT_OPT=(--timeout $((TEST_LIMIT - 20))); fi
TAIL_LINES=40 phase test_gpu "$TEST_LIMIT" "$OUT_DIR/test_gpu.log" "$PY" -m pytest -n 0 -p no:cacheprovider \
  -p no:randomly -m gpu tests/test_gpu.py -v -rA --durations=15 "${TIMEOUT_OPT[@]}" \
  -k "${GPU_TESTS-not every_family_on_a_gpu_swarm}" --junitxml="$OUT_DIR/test_gpu.xml"

# ---- 3. the 1B benchmark
BENCH_LIMIT=$(cap "${GPU_BENCH_LIMIT:-260}")
# shellcheck disable=SC2206
BENCH_ARGS=(${GPU_BENCH_ARGS:---model-size tinyllama --device cuda --rows 2000 --ranks 2,4 --repeats 3})
rm -rf "$KEEP"
TAIL_LINES=20 phase bench_gpu "$BENCH_LIMIT" "$OUT_DIR/bench_gpu.log" "$PY" benchmarks/bench_gpu.py "${BENCH_ARGS[@]}" \
  --time-budget $((BENCH_LIMIT - 25)) --keep "$KEEP" --out "$OUT_DIR/gpu_1b.json"
bench_rc=$?
if ((bench_rc != 0 && bench_rc != 99)) && [[ -d $KEEP/runs ]]; then  # the failed runs' own logs, in brief
  for f in $(grep -l -E "Traceback|Error|error:" "$KEEP"/runs/*/log.txt 2>/dev/null | head -4); do
    { echo "== $f"; grep -v "^\s*$" "$f" | tail -n 25 | cut -c1-400; } >>"$OUT_DIR/bench_gpu.log"
  done
fi

# ---- 4. start-up by phase: one run with its own local swarm (dist_eval's defaults) on the benchmark's model
MODEL=$(ls -d "$KEEP"/llama-*/ 2>/dev/null | head -1)
if [[ -n $MODEL && -f $MODEL/config.json && -f $KEEP/ptune.pt && $(cap 90) -ge 45 ]]; then
  rm -rf /tmp/gpu_check_own
  phase startup "$(cap 90)" "$OUT_DIR/startup.log" "$PY" -m torch.distributed.run --nproc_per_node 4 \
    --master_port 29577 -m dist_eval --model "$MODEL" --data-files "$KEEP/data" --checkpoint "$KEEP/ptune.pt" \
    --output-dir /tmp/gpu_check_own \
    && timeout 30 "$PY" -c "import json; r = json.load(open('/tmp/gpu_check_own/metrics.json'))['run']
print('phase_seconds', json.dumps(r.get('phase_seconds'), indent=1))" >>"$OUT_DIR/startup.log" 2>&1
  grep -E "time:|done in|samples/s" "$OUT_DIR/startup.log" | cut -c1-600 | tee -a "$SUMMARY"
else
  say "PHASE startup rc=skipped seconds=0 (no benchmark model in $KEEP, or under 45 s left: $(cap 90) s)"
fi

# ---- the end: what runs on the GPU still, at most 8 files back
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null | head -5 \
  | sed 's/^/gpu process: /' | tee -a "$SUMMARY"
mapfile -t extra < <(cd "$OUT_DIR" && ls -1 | grep -vxE \
  'summary.txt|test_gpu.log|test_gpu.xml|families_local.json|families_swarm.json|bench_gpu.log|gpu_1b.json|startup.log')
if ((${#extra[@]})); then (cd "$OUT_DIR" && tar czf extras.tar.gz "${extra[@]}" && rm -rf "${extra[@]}"); fi
say "gpu_check done at ${SECONDS}s"
