"""Time-uniform confidence sequences (dist_eval.sequential) tested as statistics:
fixed seeds, no wall clock, many simulated optionally-stopped runs at once (vectorised)."""

import json
import os
import sys

import numpy as np
import pytest
from scipy.stats import binom

from dist_eval import sequential as sq

POPULATION = 1200
RUNS = 400
ROUND = 40
ROUND_ENDS = np.arange(ROUND, POPULATION + 1, ROUND)


def streams(rate, seed=0, population=POPULATION, runs=RUNS):
    """One fixed finite set of 0/1 rows (a model's per-row correctness) and ``runs`` random
    orders of it: the rows each run would see, without replacement."""
    rng = np.random.default_rng(seed)
    rows = (rng.random(population) < rate).astype(np.float64)
    return rows.mean(), np.stack([rng.permutation(rows) for _ in range(runs)])


def peeked_bootstrap(values, ends, level=0.95):
    """The fixed-n percentile bootstrap interval of the mean after each round (exact: for 0/1
    rows the bootstrap mean is Binomial(n, mean) / n), as a user who peeks would compute it."""
    n = np.asarray(ends, dtype=np.float64)
    means = np.cumsum(values, axis=-1)[..., np.asarray(ends) - 1]
    alpha = 1.0 - level
    return binom.ppf(alpha / 2, n, means / n) / n, binom.ppf(1 - alpha / 2, n, means / n) / n


def missed(lower, upper, truth):
    return (lower > truth + 1e-12) | (upper < truth - 1e-12)


@pytest.mark.parametrize("rate", [0.5, 0.9])
def test_optional_stopping_keeps_the_coverage_and_peeking_at_a_bootstrap_does_not(rate):
    """The adversary's stop: at the first round whose interval misses the truth (or the last).
    The sequence still covers in >= 95% of runs; the bootstrap looked at after every round
    covers in fewer."""
    truth, values = streams(rate)
    lower, upper = sq.sequence(values, POPULATION)
    rounds = ROUND_ENDS - 1
    sequence_coverage = 1 - missed(lower[:, rounds], upper[:, rounds], truth).any(axis=1).mean()
    low_b, high_b = peeked_bootstrap(values, ROUND_ENDS[:-1])
    bootstrap_coverage = 1 - missed(low_b, high_b, truth).any(axis=1).mean()
    assert sequence_coverage >= 0.95, sequence_coverage
    assert bootstrap_coverage < 0.95, bootstrap_coverage
    # a single fixed n (no peeking) is fine for the bootstrap: the contrast is the peeking
    assert 1 - missed(low_b[:, 4], high_b[:, 4], truth).mean() >= 0.93


def test_stopping_at_a_width_covers_and_is_narrow_enough():
    truth, values = streams(0.85, seed=3)
    lower, upper = sq.sequence(values, POPULATION)
    stops = [sq.stopping_round(lower[r], upper[r], ROUND_ENDS, width=0.1) for r in range(RUNS)]
    ends = np.array([ROUND_ENDS[k] - 1 for k, _ in stops])
    low, high = lower[np.arange(RUNS), ends], upper[np.arange(RUNS), ends]
    assert {reason for _, reason in stops} == {"width"}
    assert (high - low <= 0.1).all() and ends.max() < POPULATION - 1
    assert 1 - missed(low, high, truth).mean() >= 0.95


def test_the_whole_set_seen_gives_its_exact_mean():
    rng = np.random.default_rng(5)
    scores = rng.random(777) * 2.0          # e.g. a Brier score, in [0, 2]
    for method in sq.METHODS:
        result = sq.interval(scores, 777, bounds=(0.0, 2.0), method=method)
        assert result["low"] == result["high"] == float(np.mean(scores))
        assert result["time_uniform"] is True and result["rows"] == result["population"] == 777
    lower, upper = sq.paired_sequence(scores[:300] / 2, scores[300:600] / 2, 300)
    assert lower[-1] == upper[-1] == float(np.mean(scores[300:600] / 2 - scores[:300] / 2))


def test_the_width_shrinks_round_by_round_and_always_holds_the_sure_bounds():
    truth, values = streams(0.7, seed=4, runs=50)
    lower, upper = sq.sequence(values, POPULATION)
    width = (upper - lower)[:, ROUND_ENDS - 1]
    assert (np.diff(width, axis=1) <= 0).all() and (np.diff(width, axis=1) < 0).any(axis=1).all()
    seen = np.cumsum(values, axis=1)
    assert (lower >= seen / POPULATION - 1e-12).all()
    assert (upper <= (seen + POPULATION - np.arange(1, POPULATION + 1)) / POPULATION + 1e-12).all()


@pytest.mark.parametrize("rate", [0.5, 0.8, 0.95])
def test_at_least_as_narrow_as_a_time_uniform_hoeffding_bound(rate):
    _, values = streams(rate, seed=6, runs=100)
    lower, upper = sq.sequence(values, POPULATION)
    width = (upper - lower)[:, ROUND_ENDS - 1].mean(axis=0)
    assert (width <= 2 * sq.hoeffding_union(ROUND_ENDS, POPULATION)).all()
    if rate >= 0.8:   # and narrower than Hoeffding's sequence of the same construction
        low_h, high_h = sq.sequence(values, POPULATION, method="hoeffding")
        assert (width[5:-1] < (high_h - low_h)[:, ROUND_ENDS[5:-1] - 1].mean(axis=0)).all()


def test_paired_differences_decide_when_one_model_is_better():
    rng = np.random.default_rng(8)
    first = (rng.random(POPULATION) < 0.70).astype(float)
    second = np.where(rng.random(POPULATION) < 0.15, 1.0, first)          # B fixes 15% of rows
    order = rng.permutation(POPULATION)
    lower, upper = sq.paired_sequence(first[order], second[order], POPULATION)
    k, reason = sq.stopping_round(lower, upper, ROUND_ENDS, decide=True)
    assert reason == "decided" and lower[ROUND_ENDS[k] - 1] > 0 and ROUND_ENDS[k] < POPULATION
    lower, upper = sq.paired_sequence(first[order], first[order], POPULATION)
    assert sq.stopping_round(lower, upper, ROUND_ENDS, decide=True) == (len(ROUND_ENDS) - 1, "end")


def test_values_outside_the_declared_bounds_are_refused():
    with pytest.raises(ValueError, match=r"values: expected within \[0.0, 1.0\], got"):
        sq.sequence([0.5, 1.5], 10)
    with pytest.raises(ValueError, match="method"):
        sq.sequence([0.5], 10, method="normal")


def test_the_stop_report_uses_only_the_rows_up_to_its_round():
    truth, values = streams(0.9, seed=9, runs=1)
    report = sq.stop_report(values[0], POPULATION, ROUND, width=0.1)
    used = report["rows_used"]
    assert report["reason"] == "width" and used % ROUND == 0 and used < POPULATION
    assert report["rows_saved"] == POPULATION - used and report["interval"]["width"] <= 0.1
    assert report["interval"]["low"] <= truth <= report["interval"]["high"]
    assert report["interval"]["time_uniform"] is True and report["estimate"] == values[0, :used].mean()
    changed = values[0].copy()
    changed[used:] = 1 - changed[used:]          # rows after the stop cannot change it
    assert sq.stop_report(changed, POPULATION, ROUND, width=0.1) == report
    assert sq.stop_report(values[0], POPULATION, ROUND, width=0.0)["rows_used"] == POPULATION


def test_the_row_values_of_the_stopping_metrics_average_to_the_reported_metrics():
    from dist_eval.metrics import brier_score, softmax, top_k_accuracy

    rng = np.random.default_rng(10)
    logits, labels = rng.normal(size=(300, 5)), rng.integers(0, 5, 300)
    values, bounds = sq.row_values("accuracy", logits, labels)
    assert bounds == (0.0, 1.0) and values.mean() == np.mean(np.argmax(logits, axis=1) == labels)
    values, _ = sq.row_values("top_k_accuracy", logits, labels, top_k=3)
    assert values.mean() == pytest.approx(top_k_accuracy(logits, labels, 3), abs=1e-15)
    values, bounds = sq.row_values("brier", logits, labels)
    assert bounds == (0.0, 2.0) and values.mean() == pytest.approx(brier_score(softmax(logits), labels), abs=1e-15)
    assert sq.interval(values, 300, bounds=bounds)["low"] == pytest.approx(values.mean(), abs=1e-12)
    with pytest.raises(ValueError, match="metric: expected one of"):
        sq.row_values("f1", logits, labels)


@pytest.mark.parametrize("width, rule", [(None, "time-uniform"), (0.05, "time-uniform"), (0.05, "fixed-width")])
@pytest.mark.parametrize("method", sq.METHODS)
@pytest.mark.parametrize("kind", ["correct", "brier", "paired"])
def test_a_round_at_a_time_gives_the_bits_of_the_whole_sequence(method, kind, width, rule):
    """RunningSequence (what a stopping run keeps between rounds, at a cost of the round's
    rows): after each round of uneven size, the interval sequence() gives at that row for
    every row so far, bit for bit, through to the exact mean when the set is seen."""
    rng = np.random.default_rng(len(kind))
    population = 2500
    if kind == "correct":
        values, bounds = (rng.random(population) < 0.8).astype(np.float64), (0.0, 1.0)
    elif kind == "brier":
        values, bounds = rng.random(population) ** 3 * 2.0, (0.0, 2.0)
    else:  # the second model's minus the first's, as paired_sequence takes them
        values, bounds = (rng.random(population) < 0.7) - (rng.random(population) < 0.6).astype(np.float64), (-1.0, 1.0)
    lower, upper = sq.sequence(values, population, 0.95, bounds, method, width=width, rule=rule)
    running = sq.RunningSequence(population, 0.95, bounds, method, width=width, rule=rule)
    seen, rounds = 0, 0
    while seen < population:
        step = int(rng.integers(1, 400))
        interval = running.extend(values[seen:seen + step])
        seen = min(population, seen + step)
        rounds += 1
        assert interval == (float(lower[seen - 1]), float(upper[seen - 1]))
    assert rounds > 5 and running.rows == population
    assert interval == (float(values.mean()), float(values.mean()))
    with pytest.raises(ValueError, match="at most population"):
        running.extend(values[:1])


# The stop rules on the issue-37 grid (benchmarks/bench_stop_rules.py prints the figures).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_stop_rules as rules  # noqa: E402


def _populations(population, rng):
    """Several sets (name, rows, bounds): 0/1 rows at several accuracies, a Brier-like score in
    [0, 2], and paired differences of two models' correctness in [-1, 1]."""
    for rate in (0.5, 0.9, 0.99):
        yield f"correct-{rate}", (rng.random(population) < rate).astype(np.float64), (0.0, 1.0)
    yield "brier", rng.beta(0.5, 3.0, population) * 2.0, (0.0, 2.0)
    first = (rng.random(population) < 0.7).astype(np.float64)
    second = np.where(rng.random(population) < 0.1, 1.0 - first, first)
    yield "paired", second - first, (-1.0, 1.0)


@pytest.mark.simulation
def test_the_sequence_tuned_to_a_width_holds_at_every_row_at_once():
    """2,000 random orders of each set: the tuned sequence's intervals hold at every row of an
    order at once in at least 95% of them (the issue asks for 94%), at several widths."""
    rng = np.random.default_rng(37)
    population, orders = 1000, 2000
    for name, rows, bounds in _populations(population, rng):
        values = rows[np.argsort(rng.random((orders, population)), axis=1)]
        for width in (0.02, 0.1):
            lower, upper = sq.sequence(values, population, bounds=bounds, width=width)
            coverage = 1 - missed(lower, upper, rows.mean()).any(axis=1).mean()
            assert coverage >= 0.95, (name, width, coverage)


@pytest.mark.simulation
def test_the_time_uniform_rule_tuned_to_the_width_needs_at_most_3x_the_fixed_n_rows():
    """Each cell of the grid: the median rows over 25 random orders at most 3.0x those of a
    fixed-n normal interval of that width at the true accuracy (fpc, rounded up to a round); the
    all-time weights (the rule before) needed up to 5.7x."""
    worst_before, worst, covered = 0.0, 0.0, []
    for population, rate, width in rules.GRID:
        oracle = rules.oracle_rows(population, rate, width)
        used, holds = rules.time_uniform_stops(population, rate, width, 25, max_rows=3 * oracle + rules.ROUND)
        assert np.median(used) <= 3.0 * oracle, (population, rate, width, np.median(used), oracle)
        worst, covered = max(worst, np.median(used) / oracle), covered + list(holds)
        if (population, rate, width) == (100_000, 0.5, 0.02):
            before, _ = rules.time_uniform_stops(population, rate, width, 9, tuned=False)
            worst_before = np.median(before) / oracle
    assert worst < 2.8 and worst_before > 5.0, (worst, worst_before)
    assert np.mean(covered) >= 0.95  # at the stop, over the grid's 600 runs


@pytest.mark.simulation
def test_the_fixed_width_rule_needs_about_the_fixed_n_rows_and_covers_at_its_stop():
    """Each cell of the grid, 10,000 runs: median rows at most 1.3x the oracle's, coverage at the
    stop at least 94% (95% nominal), p = 0.99 and W = 0.01 included, where a normal interval
    stopped the same way covers in fewer than 90% of runs."""
    for seed, (population, rate, width) in enumerate(rules.GRID):
        oracle = rules.oracle_rows(population, rate, width)
        used, covered = rules.fixed_width_stops(population, rate, width, 10_000, seed=seed)
        assert np.median(used) <= 1.3 * oracle, (population, rate, width, np.median(used), oracle)
        assert covered.mean() >= 0.94, (population, rate, width, covered.mean())
    _, wald = rules.fixed_width_stops(20_000, 0.99, 0.01, 10_000, interval="wald")
    assert wald.mean() < 0.90, wald.mean()


def test_the_fixed_width_intervals_are_those_of_the_rows_seen_and_end_at_the_exact_mean():
    rng = np.random.default_rng(11)
    rows = (rng.random(5000) < 0.9).astype(np.float64)
    lower, upper = sq.sequence(rows, 5000, rule="fixed-width")
    n = np.arange(1, 5001)
    low, high = sq.fixed_width_bounds(n, np.cumsum(rows), np.cumsum(rows), 5000)
    assert np.array_equal(lower[:-1], low[:-1]) and np.array_equal(upper[:-1], high[:-1])
    assert lower[-1] == upper[-1] == rows.mean() and (lower <= upper).all()
    # at 2,000 rows: the Agresti-Coull interval with the finite-population correction
    s, t, z = rows[:2000].sum(), 2000, sq.Z95
    centre = (s + z * z / 2) / (t + z * z)
    half = z * np.sqrt(centre * (1 - centre) * (5000 - t) / 4999 / (t + z * z))
    assert (lower[t - 1], upper[t - 1]) == pytest.approx((centre - half, centre + half), abs=1e-12)
    with pytest.raises(ValueError, match="rule: expected one of"):
        sq.sequence(rows, 5000, rule="peek")


def test_the_stop_report_says_which_rule_stopped_and_what_it_guarantees():
    truth, values = streams(0.9, seed=12, runs=1)
    tuned = sq.stop_report(values[0], POPULATION, ROUND, width=0.1)
    fixed = sq.stop_report(values[0], POPULATION, ROUND, width=0.1, rule="fixed-width")
    assert tuned["interval"]["rule"] == "time-uniform" and tuned["interval"]["time_uniform"] is True
    assert tuned["interval"]["tuned_to_width"] == 0.1 and "stays valid" in tuned["interval"]["guarantee"]
    assert fixed["interval"]["rule"] == "fixed-width" and fixed["interval"]["time_uniform"] is False
    assert "this stopping rule only" in fixed["interval"]["guarantee"]
    assert fixed["rows_used"] < tuned["rows_used"] and fixed["interval"]["width"] <= 0.1


@pytest.mark.parametrize("paired", [False, True])
def test_the_stop_report_is_read_back_as_it_was_written(paired):
    """Issue 47: the stop report's keys are its fields, written once: a report read back from its
    JSON is the same report, and ``better`` is a key (null when neither is better) of a paired run only."""
    from dist_eval.sequential import StopReport, describe

    report = StopReport(metric="accuracy", stop_at_width=0.1, stop_when_decided=paired, rule="time-uniform",
                        reason="end", better=None, paired=paired,
                        interval={"of": "x", "low": 0.5, "high": 0.5, "width": 0.0, "level": 0.95, **describe()},
                        rows_used=10, rows_in_set=10, rows_saved=0, rounds=1, round_rows=10, seconds=0.1,
                        seconds_saved_estimate=0.0, metrics_are_of="every row of the set")
    written = json.loads(json.dumps(report.to_json()))
    assert ("better" in written) == paired
    assert StopReport.from_json(written) == report
    assert "the set ended" in report.sentence() and "time-uniform" in report.sentence()
