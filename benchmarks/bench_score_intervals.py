"""One rank's share of the probability scores' exact bootstrap ("the score intervals" phase
up to 65,536 rows, or with a rare class: dist_eval.intervals.EXACT_SCORE_ROWS; above, the
run draws them grouped on rank 0, which bench_big_set.py's phases show), alone: this
checkout beside a baseline git ref, and whether the two give the same bits.

    .venv/bin/python benchmarks/bench_score_intervals.py --rows 200000 [--nproc 2] [--baseline main]

The data: ``--rows`` rows of ``--classes`` classes (4, as the demo task), random labels and
the softmax of random float32 logits (distinct scores, as a model's), made from ``--seed``.
Each code runs, in its own process with one thread (``OMP_NUM_THREADS=1``, as the CLI's
ranks), ``score_resamples_part`` of rank 0 of ``--nproc`` (what one rank computes in a run:
every draw, every N-th chunk of resamples) with the default 1000 resamples; the figure is
that call's seconds. The values of the two codes are then compared byte for byte.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Every row evaluated by every run: the row store (on by default) would serve a repeated run's
# rows without a forward. An explicit --row-store (bench_row_store's) still wins.
os.environ.setdefault("DIST_EVAL_ROW_STORE", "off")


def data(rows: int, classes: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, rows)
    logits = rng.normal(size=(rows, classes)).astype(np.float32).astype(np.float64)
    logits[np.arange(rows), labels] += 1.0
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    return probs / probs.sum(axis=1, keepdims=True), labels


def worker(args) -> int:
    """In the code on PYTHONPATH: time rank 0's part and save its values."""
    import time

    import numpy as np

    from dist_eval.intervals import score_resamples_part

    probs, labels = data(args.rows, args.classes, args.seed)
    started = time.perf_counter()
    numbers, values = score_resamples_part(probs, labels, args.resamples, 0, None, 15, (0, args.nproc))
    seconds = time.perf_counter() - started
    np.savez(args.save, numbers=numbers, **values)
    print(json.dumps({"seconds": seconds}))
    return 0


def run(code: str, args, save: str) -> float:
    env = {**os.environ, "PYTHONPATH": code, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--save", save, "--rows", str(args.rows),
           "--classes", str(args.classes), "--seed", str(args.seed), "--nproc", str(args.nproc),
           "--resamples", str(args.resamples)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=code, env=env)
    if out.returncode != 0:
        raise SystemExit(f"run of {code} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2, help="the world size whose rank 0 share is timed")
    p.add_argument("--resamples", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", default="main", help="git ref run beside this checkout ('' for none)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--save", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="bench_score_intervals_") as workdir:
        codes = {"this checkout": ROOT}
        if args.baseline:
            folder = tempfile.mkdtemp(dir=workdir)
            archive = subprocess.run(["git", "-C", ROOT, "archive", args.baseline], capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
            codes[f"baseline {args.baseline}"] = folder
        seconds, saved = {}, {}
        for label, code in codes.items():
            saved[label] = os.path.join(workdir, f"{len(saved)}.npz")
            seconds[label] = run(code, args, saved[label])
        print(f"{args.rows} rows, {args.classes} classes, {args.resamples} resamples, rank 0 of {args.nproc}:")
        for label, value in seconds.items():
            print(f"  {label:<28} {value:7.2f} s")
        if len(saved) == 2:
            first, second = (np.load(path) for path in saved.values())
            same = sorted(first.files) == sorted(second.files) and all(
                first[name].tobytes() == second[name].tobytes() for name in first.files)
            print(f"  the same bits (every value of rank 0's resamples): {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
