"""The confidence sequence a stopping run keeps, per round: the whole sequence recomputed over
every row seen after each round (what dist_eval did before, O(rows seen) a round) beside
``sequential.RunningSequence`` continued a round at a time (O(round rows)), in one run.

    .venv/bin/python benchmarks/bench_sequence_rounds.py [--population 1000000] [--round 256] [--upto 200000]

The data: ``--population`` 0/1 rows (accuracy 0.9, seed 0), looked at every ``--round`` rows up
to ``--upto`` rows (a run that has not stopped yet). Prints the seconds of each way, rows per
second of the sequence alone, and checks the last intervals are the same bits.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from dist_eval import sequential as sq

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--population", type=int, default=1_000_000)
    p.add_argument("--round", type=int, default=256)
    p.add_argument("--upto", type=int, default=200_000)
    args = p.parse_args(argv)
    values = (np.random.default_rng(0).random(args.population) < 0.9).astype(np.float64)
    ends = range(args.round, min(args.upto, args.population) + 1, args.round)

    started = time.perf_counter()
    for end in ends:
        lower, upper = sq.sequence(values[:end], args.population)
    whole = time.perf_counter() - started

    started = time.perf_counter()
    running = sq.RunningSequence(args.population)
    for end in ends:
        interval = running.extend(values[end - args.round:end])
    incremental = time.perf_counter() - started

    same = interval == (float(lower[-1]), float(upper[-1]))
    rows = ends[-1]
    print(f"{len(ends)} rounds of {args.round} rows, up to {rows} of {args.population}:")
    print(f"  the whole sequence after each round   {whole:8.3f} s  {rows / whole:12.0f} rows/s")
    print(f"  RunningSequence, a round at a time    {incremental:8.3f} s  {rows / incremental:12.0f} rows/s")
    print(f"  last interval the same bits: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
