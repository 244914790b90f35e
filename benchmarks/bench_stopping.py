"""Rows needed to know accuracy to +-1 and +-2 points with a time-uniform confidence sequence.

    .venv/bin/python benchmarks/bench_stopping.py [--runs 200] [--round 50]

Two parts, printed as Markdown for benchmarks/RESULTS.md:

1. Simulated streams (no model): a fixed set of 0/1 rows at several accuracies, many random
   orders; the mean width after n rows of the empirical-Bernstein sequence without replacement
   (``dist_eval.sequential``), of Hoeffding's sequence of the same construction, and of a plain
   time-uniform Hoeffding bound (a union bound over n); and how often the sequence ever missed.
2. The demo task (``--backend local``, one process): its test split evaluated in full once;
   each row's correctness taken in the seeded content-hash order of ``--limit``
   (``data.sample.key_order``, seed 0) and looked at every ``--round`` rows: the rows at which
   the interval is at most 2 and 4 points wide (+-1, +-2), against the whole split and the
   ``--limit`` a careful user would choose without knowing the accuracy (the normal interval's
   n at p = 0.5 with the finite-population correction).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# Every row evaluated by every run: the row store (on by default) would serve a repeated run's
# rows without a forward. An explicit --row-store (bench_row_store's) still wins.
os.environ.setdefault("DIST_EVAL_ROW_STORE", "off")

from dist_eval import sequential as sq  # noqa: E402


def simulated(runs: int, population: int = 10000, checkpoints=(500, 1000, 2000, 5000)) -> None:
    print(f"| accuracy | rows | empirical-Bernstein CS (without replacement) | Hoeffding CS (same construction) "
          f"| Hoeffding, union over n | CS ever missed ({runs} runs) |")
    print("|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for rate in (0.5, 0.7, 0.8, 0.9, 0.95, 0.99):
        rows = (rng.random(population) < rate).astype(np.float64)
        values = np.stack([rng.permutation(rows) for _ in range(runs)])
        low, high = sq.sequence(values, population)
        low_h, high_h = sq.sequence(values, population, method="hoeffding")
        missed = ((low > rows.mean() + 1e-12) | (high < rows.mean() - 1e-12)).any(axis=1).mean()
        for n in checkpoints:
            union = 2 * sq.hoeffding_union(n, population)
            print(f"| {rate} | {n} | {(high - low)[:, n - 1].mean():.4f} | {(high_h - low_h)[:, n - 1].mean():.4f} "
                  f"| {union:.4f} | {missed:.3f} |")


def careful_limit(half_width: float, population: int, z: float = 1.959964) -> int:
    """The n of a normal interval of this half-width at the worst case p = 0.5, corrected for
    sampling without replacement from ``population`` rows."""
    n0 = z * z * 0.25 / half_width ** 2
    return int(min(population, np.ceil(n0 / (1 + (n0 - 1) / population))))


def demo_split(split: str, round_rows: int, folder: str) -> None:
    from datasets import load_from_disk

    from dist_eval.data.sample import key_order
    from dist_eval.demo import demo_assets

    out = os.path.join(folder, split)
    subprocess.run([sys.executable, "-m", "dist_eval", "--backend", "local", "--output-dir", out,
                    "--progress", "none", "--quiet"], check=True, cwd=ROOT, timeout=600)
    with open(os.path.join(out, "predictions.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    correct = np.zeros(len(rows))
    for row in rows:
        correct[row["index"]] = float(row["label"] == row["pred"])
    data = load_from_disk(demo_assets(log=lambda _: None).data_dir)[split]
    order = key_order([data["text"], data["label"]], 0)
    values = correct[order]
    for half in (0.02, 0.01):
        report = sq.stop_report(values, len(values), round_rows, width=2 * half)
        interval = report["interval"]
        print(f"| {split} | {len(values)} | {correct.mean():.4f} | +-{half * 100:.0f} | {report['rows_used']} "
              f"({report['reason']}) | [{interval['low']:.4f}, {interval['high']:.4f}] "
              f"| {careful_limit(half, len(values))} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--round", type=int, default=50, help="rows a round")
    args = parser.parse_args()
    simulated(args.runs)
    print()
    print("| split | rows | accuracy (all rows) | points | rows used (why) | interval | careful --limit |")
    print("|---|---:|---:|---:|---:|---|---:|")
    with tempfile.TemporaryDirectory() as folder:
        demo_split("test", args.round, folder)


if __name__ == "__main__":
    main()
