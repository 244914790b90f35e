#!/usr/bin/env bash
# The suite's time from a fresh clone, install included, as CI runs it (`CI=true bash .ci/run`),
# once per CPU instruction set named (ATEN_CPU_CAPABILITY; torch's kernels sum in another order
# on each, so each run also shows the suite passes there). Each run gets its own clone of HEAD
# in a temporary folder (removed afterwards) and prints one line: capability, exit code, seconds
# in all, pytest's closing line. Exits non-zero when any run fails. Run it on a quiet machine:
# the figures in benchmarks/RESULTS.md ("the test suite's time") come from it.
#   bash benchmarks/suite_time.sh                 # default avx2 and the machine's best
#   bash benchmarks/suite_time.sh avx512 avx512   # the same one twice
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
capabilities=("$@")
if [[ ${#capabilities[@]} -eq 0 ]]; then
  best=avx2  # torch's AVX512 kernels need F, BW, VL and DQ
  if grep -qw avx512f /proc/cpuinfo && grep -qw avx512bw /proc/cpuinfo && grep -qw avx512vl /proc/cpuinfo \
      && grep -qw avx512dq /proc/cpuinfo; then best=avx512; fi
  capabilities=(default avx2)
  [[ "$best" == avx2 ]] || capabilities+=("$best")
fi
status=0
for capability in "${capabilities[@]}"; do
  work="$(mktemp -d)"
  git clone -q "$repo" "$work/fresh"
  start=$(date +%s)
  (cd "$work/fresh" && ATEN_CPU_CAPABILITY="$capability" CI=true bash .ci/run) > "$work/log" 2>&1
  code=$?
  took=$(( $(date +%s) - start ))
  closing="$(grep -E '^=+ .*(passed|failed|error).* in [0-9.]+s' "$work/log" | tail -1)"
  echo "ATEN_CPU_CAPABILITY=$capability: exit $code in $took s (.ci/run from a fresh clone) | $closing"
  if [[ $code -ne 0 ]]; then
    status=1
    cp "$work/log" "/tmp/suite_time-$capability-$$.log"
    echo "  log kept: /tmp/suite_time-$capability-$$.log"
  fi
  rm -rf "$work"
done
exit $status
