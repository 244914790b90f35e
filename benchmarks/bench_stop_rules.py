"""Rows used and coverage of the stop rules (``--stop-rule``) on simulated sets, against a fixed sample.

    .venv/bin/python benchmarks/bench_stop_rules.py [--orders 50] [--runs 2000] [--round 256]

The grid: sets of N in {20,000, 100,000} 0/1 rows (a model's per-row correctness) at accuracy p
in {0.5, 0.8, 0.95, 0.99}, asked for a 95% interval at most W in {0.01, 0.02, 0.05} wide, looked at
every ``--round`` rows (``--stop-round-rows``' default). For each cell, printed as Markdown for
benchmarks/RESULTS.md:

- the oracle: the rows of a fixed-n 95% normal interval of width W at the set's true accuracy
  (finite-population corrected, rounded up to a whole round), and the careful ``--limit``: the
  same at p = 0.5 (what a user who does not know the accuracy plans for);
- the time-uniform rule before (all-time weights, this module's sequence before issue 37) and
  now (tuned to W): median rows used over ``--orders`` random orders, the ratio to the oracle,
  and the share of those orders whose interval at the stop holds the set's accuracy;
- the fixed-width rule: median rows, ratio and coverage at the stop over ``--runs`` runs (the
  rows of each round drawn without replacement: a hypergeometric count, all the rule reads of
  0/1 rows); and a normal (Wald) interval stopped the same way, for contrast.

The suite runs the same functions (tests/test_sequential.py): the tuned rule at most 3.0x the
oracle, the fixed-width rule at most 1.3x with coverage at its stop of at least 94%.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from statistics import NormalDist
from typing import Optional

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dist_eval import sequential as sq  # noqa: E402

GRID = [(n, p, w) for n in (20_000, 100_000) for p in (0.5, 0.8, 0.95, 0.99) for w in (0.01, 0.02, 0.05)]
ROUND = 256
CHUNK = 10  # orders simulated at once (memory: CHUNK x N floats, a few arrays of them)


def set_of(population: int, rate: float) -> np.ndarray:
    """A set of 0/1 rows with round(rate x population) ones."""
    rows = np.zeros(population)
    rows[: int(round(rate * population))] = 1.0
    return rows


def oracle_rows(population: int, rate: float, width: float, round_rows: int = ROUND) -> int:
    """A fixed-n normal interval's rows at the true accuracy, rounded up to a whole round."""
    rows = sq.fixed_n_rows(rate * (1.0 - rate), width, population)
    return min(population, math.ceil(rows / round_rows) * round_rows)


def careful_limit(population: int, width: float) -> int:
    """The --limit a careful user plans without knowing the accuracy: the oracle at p = 0.5."""
    return sq.fixed_n_rows(0.25, width, population)


def time_uniform_stops(population: int, rate: float, width: float, orders: int, seed: int = 0,
                       tuned: bool = True, round_rows: int = ROUND, max_rows: Optional[int] = None):
    """(rows used, covered at the stop) per random order of the set, the time-uniform rule looked
    at every round: tuned to ``width``, or (``tuned=False``) with the all-time weights.
    ``max_rows``: only the first rows of each order are looked at (the sequence at a row depends
    on the rows before it only); an order not stopped by then counts as using the whole set.
    """
    rng = np.random.default_rng(seed)
    rows = set_of(population, rate)
    seen = min(population, max_rows or population)
    ends = np.arange(round_rows, seen + round_rows, round_rows).clip(max=seen)
    used, covered = [], []
    for start in range(0, orders, CHUNK):
        values = np.stack([rng.permutation(rows)[:seen] for _ in range(min(CHUNK, orders - start))])
        lower, upper = sq.sequence(values, population, width=width if tuned else None)
        low, high = lower[:, ends - 1], upper[:, ends - 1]
        narrow = (high - low <= width) | (ends >= population)
        k = np.argmax(narrow, axis=1)
        pick = np.arange(len(k))
        used.append(np.where(narrow[pick, k], ends[k], population))
        covered.append((low[pick, k] <= rows.mean() + 1e-12) & (high[pick, k] >= rows.mean() - 1e-12))
    return np.concatenate(used), np.concatenate(covered)


def _wald(rows, sums, population: int):
    z = sq.Z95
    mean = sums / rows
    half = z * np.sqrt(mean * (1.0 - mean) * (population - rows) / (population - 1) / rows)
    return mean - half, mean + half


def fixed_width_stops(population: int, rate: float, width: float, runs: int, seed: int = 0,
                      interval: str = "fixed-width", round_rows: int = ROUND):
    """(rows used, covered at the stop) per run of the fixed-width rule (``interval="wald"``: a
    normal interval at the stop instead of the rule's), each round's count of ones drawn without
    replacement from what the set has left."""
    rng = np.random.default_rng(seed)
    ones = int(round(rate * population))
    truth = ones / population
    left_ones, left_zeros = np.full(runs, ones), np.full(runs, population - ones)
    sums = np.zeros(runs)
    used, covered = np.zeros(runs, dtype=np.int64), np.zeros(runs, dtype=bool)
    done = np.zeros(runs, dtype=bool)
    seen = 0
    while not done.all():
        take = min(round_rows, population - seen)
        drawn = rng.hypergeometric(left_ones, left_zeros, take) if take < population - seen else left_ones.copy()
        sums, seen = sums + drawn, seen + take
        left_ones, left_zeros = left_ones - drawn, left_zeros - (take - drawn)
        if interval == "wald":
            low, high = _wald(seen, sums, population)
        else:
            low, high = sq.fixed_width_bounds(seen, sums, sums, population)
        stop = ~done & ((high - low <= width) | (seen >= population))
        used[stop] = seen
        covered[stop] = (low[stop] <= truth + 1e-12) & (high[stop] >= truth - 1e-12)
        done |= stop
    return used, covered


def grid(orders: int, runs: int) -> None:
    print(f"| N | p | W | oracle rows | careful --limit | time-uniform before: rows (x oracle) | time-uniform "
          f"now: rows (x oracle, x limit) | covered at stop ({orders} orders) | fixed-width: rows (x oracle, x "
          f"limit) | covered at stop ({runs} runs) | normal interval stopped so: covered |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    worst = {"time-uniform": 0.0, "fixed-width": 0.0, "fixed-width coverage": 1.0}
    for population, rate, width in GRID:
        oracle, limit = oracle_rows(population, rate, width), careful_limit(population, width)
        before, _ = time_uniform_stops(population, rate, width, orders, tuned=False)
        now, now_covered = time_uniform_stops(population, rate, width, orders)
        fixed, fixed_covered = fixed_width_stops(population, rate, width, runs)
        _, wald_covered = fixed_width_stops(population, rate, width, runs, interval="wald")
        tu, fw = np.median(now), np.median(fixed)
        worst["time-uniform"] = max(worst["time-uniform"], tu / oracle)
        worst["fixed-width"] = max(worst["fixed-width"], fw / oracle)
        worst["fixed-width coverage"] = min(worst["fixed-width coverage"], fixed_covered.mean())
        print(f"| {population:,} | {rate} | {width} | {oracle} | {limit} | {np.median(before):.0f} "
              f"({np.median(before) / oracle:.2f}x) | {tu:.0f} ({tu / oracle:.2f}x, {tu / limit:.2f}x) "
              f"| {now_covered.mean():.3f} | {fw:.0f} ({fw / oracle:.2f}x, {fw / limit:.2f}x) "
              f"| {fixed_covered.mean():.4f} | {wald_covered.mean():.4f} |", flush=True)
    print(f"\nworst: time-uniform {worst['time-uniform']:.2f}x the oracle, fixed-width {worst['fixed-width']:.2f}x, "
          f"fixed-width coverage at its stop {worst['fixed-width coverage']:.4f}")


# --stop-when-decided: two models on the same rows, B right where A is wrong on a share ``fixes``
# of the rows and wrong where A is right on ``breaks``; the difference B - A is fixes - breaks.
DECIDED_GRID = [(20_000, fixes, breaks) for fixes, breaks in ((0.055, 0.045), (0.06, 0.04), (0.07, 0.03),
                                                               (0.15, 0.05))]


def decided_stops(population: int, fixes: float, breaks: float, orders: int, seed: int = 0,
                  round_rows: int = ROUND):
    """(rows used, decided for the better model) per random order: the time-uniform sequence of
    the per-row difference (all-time weights: no width asked for), looked at every round, stopping
    once it excludes 0 or at the end of the set."""
    rng = np.random.default_rng(seed)
    diff = np.zeros(population)
    diff[: int(round(fixes * population))] = 1.0
    diff[int(round(fixes * population)): int(round((fixes + breaks) * population))] = -1.0
    ends = np.arange(round_rows, population + round_rows, round_rows).clip(max=population)
    used, right = [], []
    for start in range(0, orders, CHUNK):
        values = np.stack([rng.permutation(diff) for _ in range(min(CHUNK, orders - start))])
        lower, upper = sq.sequence(values, population, bounds=(-1.0, 1.0))
        low, high = lower[:, ends - 1], upper[:, ends - 1]
        decided = ((low > 0) | (high < 0)) & (ends < population)
        stop = decided | (ends >= population)
        k = np.argmax(stop, axis=1)
        pick = np.arange(len(k))
        used.append(ends[k])
        right.append(decided[pick, k] & (low[pick, k] > 0))
    return np.concatenate(used), np.concatenate(right)


def paired_test_rows(population: int, fixes: float, breaks: float, power: float, level: float = 0.95) -> int:
    """The rows a fixed-n two-sided paired test (a normal test of the mean difference, as McNemar's
    for 0/1 rows) needs for this ``power``, corrected for sampling without replacement."""
    gap, normal = fixes - breaks, NormalDist()
    variance = fixes + breaks - gap * gap
    n0 = ((normal.inv_cdf(0.5 + level / 2.0) + normal.inv_cdf(power)) ** 2) * variance / gap ** 2
    return int(min(population, math.ceil(n0 / (1.0 + (n0 - 1.0) / population))))


def decided(orders: int) -> None:
    print(f"| N | B fixes | B breaks | B - A | rows used: median (mean) | decided for B ({orders} orders) "
          f"| fixed-n paired test of that power | ratio (median, mean) | fixed-n test at 80% power |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for population, fixes, breaks in DECIDED_GRID:
        used, right = decided_stops(population, fixes, breaks, orders)
        power = min(right.mean(), 1.0 - 0.5 / orders)  # all decided: the power of one order fewer
        fixed = paired_test_rows(population, fixes, breaks, power)
        print(f"| {population:,} | {fixes} | {breaks} | {fixes - breaks:+.2f} | {np.median(used):.0f} "
              f"({used.mean():.0f}) | {right.mean():.3f} | {fixed} | {np.median(used) / fixed:.2f}x, "
              f"{used.mean() / fixed:.2f}x | {paired_test_rows(population, fixes, breaks, 0.8)} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=50, help="random orders per cell, time-uniform rule")
    parser.add_argument("--runs", type=int, default=2000, help="runs per cell, fixed-width rule")
    parser.add_argument("--decided-orders", type=int, default=200, help="random orders per cell, "
                                                                         "--stop-when-decided")
    args = parser.parse_args()
    started = time.perf_counter()
    grid(args.orders, args.runs)
    print()
    decided(args.decided_orders)
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
