#!/usr/bin/env bash
# A run's phases ("time:" line, "done in") on 2 ranks, this checkout against a baseline, in one run.
#
#     benchmarks/bench_phases.sh BASELINE_CHECKOUT [RUNS [FLAG...]]
#
# BASELINE_CHECKOUT: another checkout of dist_eval (e.g. `git worktree add /tmp/base <commit>`); both run
# with this checkout's .venv (`ln -s "$PWD/.venv" /tmp/base/.venv`). Each run: torchrun --nproc_per_node 2,
# the local backend, 40 rows of the tests' tiny Llama (tests/conftest.py, built once in a temp folder) and
# the FLAGs (default: --row-store off; the row store's cache is a temp folder of this script's); the two checkouts
# alternate, RUNS times each (default 3). Prints each run's own time line.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
base="$(cd "${1:?usage: bench_phases.sh BASELINE_CHECKOUT [RUNS [FLAG...]]}" && pwd)"
runs="${2:-3}"
flags=("${@:3}")
[ ${#flags[@]} -gt 0 ] || flags=(--row-store off)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export DIST_EVAL_CACHE="$work/cache"
(cd "$here/tests" && "$here/.venv/bin/python" -c "
from conftest import build_checkpoint, build_tiny_model, write_csv
build_tiny_model('$work/model'); build_checkpoint('$work/ck.pt'); write_csv('$work/data.csv', 40)") >/dev/null 2>&1
for i in $(seq "$runs"); do
  for checkout in "$base" "$here"; do
    line=$(cd "$checkout" && "$here/.venv/bin/python" -m torch.distributed.run --nproc_per_node 2 \
      --master_port $((29600 + i)) -m dist_eval --backend local --model "$work/model" --checkpoint "$work/ck.pt" \
      --data-files "$work/data.csv" --output-dir "$work/out-$i-$(basename "$checkout")" "${flags[@]}" 2>&1 \
      | grep -E "time: launch|done in" | tr -s ' ' | tr '\n' ' ')
    echo "$(git -C "$checkout" rev-parse --short HEAD) run $i:$line"
  done
done
