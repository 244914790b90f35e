"""Time-uniform confidence sequences for the mean of a finite set sampled without replacement.

A pure numpy module (no torch): the statistics for stopping an evaluation once its interval
is narrow enough (``--stop-at-width``, ``--stop-when-decided``: :mod:`dist_eval.stopping`
runs the rounds and asks this module). Rows are seen in a fixed random order (``data/sample.py``'s
content-hash order); after ``t`` of the set's ``N`` rows the sequence gives an interval for
the mean over **all N rows**. The intervals hold at every ``t`` at once with probability at
least ``level`` (time-uniform), so a run may look after every round and stop whenever it
likes: the interval it stops on is still a valid 95% interval. A fixed-N interval (the
bootstrap's) used that way is not (``tests/test_sequential.py`` shows both).

The sequence is the predictable-plug-in empirical-Bernstein confidence sequence for sampling
without replacement (Waudby-Smith & Ramdas, "Confidence sequences for sampling without
replacement", NeurIPS 2020, Theorem 3). Values are rescaled to [0, 1] from their declared
bounds. With ``S`` the sum of the rows seen before row ``i`` (1-based), the mean of the rows
not yet seen is ``(N mu - S) / (N - i + 1)``; the betting weights ``lambda_i`` depend only on
the rows before ``i`` (predictable), so

    lower/upper = sum lambda_i (x_i + S / (N-i+1)) / D  -/+  (log(2/alpha) + sum v_i psi(lambda_i)) / D,
    D = sum lambda_i N / (N-i+1),  v_i psi(lambda_i) = (x_i - mean_{i-1})^2 (-log(1-lambda_i) - lambda_i).

Each interval is intersected with the ones before it (an intersection of a confidence
sequence's intervals is one too) and with what the rows seen prove whatever the rest are
(their sum plus 0 or plus 1 for each unseen row), so the interval of a finished set is
exactly its mean. ``method="hoeffding"`` is the same construction with Hoeffding's
``psi(lambda) = lambda^2 / 8`` (no variance): the baseline the docs compare with.

Tuned to a width (``width=W``, what ``--stop-at-width`` asks for): the weights that reach a
half-width ``h = W / 2`` soonest. After ``t`` rows of variance ``sigma^2`` with one weight
``lambda`` the margin is about ``log(2/alpha) / (lambda t) + sigma^2 lambda / 2``; it first
reaches ``h`` at ``t = 2 sigma^2 log(2/alpha) / h^2`` with ``lambda = h / sigma^2``, so
``lambda_i = min(h / var_{i-1}, 1/2)`` with the variance of the rows before ``i`` (shrunk to
1/4 by ``TUNED_PRIOR_ROWS`` rows: the first rows' variance is noise). About ``2 log(2/alpha) /
z^2 = 1.9`` times a fixed-n normal interval's rows at the same width (1.4-2.3 measured),
against up to 5.7 times for the all-time weights (``lambda_i ~ sqrt(1 / (t log t))``), which spread the bet over every
``t``. The weights are predictable, so the intervals still hold at every row at once:
a run that stops where it likes, or goes on past W, still has a valid 95% interval; they are
only narrowest around the rows where W is reached (Waudby-Smith & Ramdas 2020 on tuning the
weights to a sample size; Howard et al. 2021 on tuning a boundary the same way).

The other rule (``rule="fixed-width"``, :func:`fixed_width_bounds`, ``--stop-rule fixed-width``)
is not time-uniform: the fixed-n interval of the rows seen (Agresti-Coull: ``z^2 / 2``
pseudo-rows at each bound, the finite-population correction), used once, at the first round
where it is at most W wide (Chow & Robbins 1965). It needs about the fixed-n interval's rows;
its coverage at that stop is about 95% (measured: ``benchmarks/bench_stop_rules.py``), for
that rule only. ``describe`` gives each rule's guarantee in the words the report shows.
"""
from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist
from typing import Dict, List, Optional, Tuple

import numpy as np

METHODS = ("empirical-bernstein", "hoeffding")
# The rules a run can stop by (--stop-rule's choices): a time-uniform sequence (tuned to the width when one is asked
# for), or the fixed-n interval at the first round it is narrow enough.
TIME_UNIFORM, FIXED_WIDTH = "time-uniform", "fixed-width"
RULES = (TIME_UNIFORM, FIXED_WIDTH)
# The built-in per-row metrics a run can stop on (--stop-metric's choices, in this order), and the
# range of their per-row values.
STOP_METRICS = {"accuracy": (0.0, 1.0), "brier": (0.0, 2.0), "top_k_accuracy": (0.0, 1.0)}
# The largest betting weight: below 1 so that log(1 - lambda) stays finite (the paper's c).
MAX_LAMBDA = 0.5
# The tuned weights' variance is shrunk to 1/4 by this many rows (benchmarks/bench_stop_rules.py:
# 1 row lets a few lucky rows at p = 0.99 bet too much early on, 50 bets too little).
TUNED_PRIOR_ROWS = 10.0
# The normal quantile of the fixed-width rule's 95% interval.
Z95 = 1.959963984540054


def _scaled(values, low: float, high: float) -> np.ndarray:
    x = (np.asarray(values, dtype=np.float64) - low) / (high - low)
    if x.size and (x.min() < -1e-12 or x.max() > 1 + 1e-12):
        raise ValueError(f"values: expected within [{low}, {high}], got values in "
                         f"[{x.min() * (high - low) + low}, {x.max() * (high - low) + low}]; "
                         "declare the metric's bounds")
    return np.clip(x, 0.0, 1.0)


def _accumulate(ufunc, x: np.ndarray, carry: Optional[np.ndarray]) -> np.ndarray:
    """``ufunc.accumulate`` along the last axis, continued from ``carry`` (the value after the
    rows before, shaped ``x.shape[:-1] + (1,)``; None: no rows before). A left fold, so the
    values are those of one accumulate over every row, bit for bit.
    """
    if carry is None:
        return ufunc.accumulate(x, axis=-1)
    return ufunc.accumulate(np.concatenate([carry, x], axis=-1), axis=-1)[..., 1:]


def _shifted(carry: Optional[np.ndarray], running: np.ndarray, first: float) -> np.ndarray:
    """Each row's value of ``running`` before it: ``carry`` (or ``first``) then ``running[:-1]``."""
    before = np.full(running.shape[:-1] + (1,), first) if carry is None else carry
    return np.concatenate([before, running[..., :-1]], axis=-1)


class _Carry:
    """What the sequence after ``t`` rows needs of them: running sums, the last mean, the
    interval so far (each shaped ``leading axes + (1,)``, None before any row).
    """

    def __init__(self):
        self.t = 0
        self.sum_x = self.sum_squares = self.last_mean = self.denominator = None
        self.centre_sum = self.penalty_sum = self.lower = self.upper = None


def _extend(x: np.ndarray, carry: _Carry, population: int, log_term: float, method: str,
            target: Optional[float] = None):
    """(lower, upper) in [0, 1] after each row of ``x`` (scaled values, the rows after
    ``carry``'s), and ``carry`` moved past them. Every quantity is a running sum, mean or
    max/min, continued from the carry: any split of the rows into calls gives the same bits.
    ``target``: the half-width (scaled) the weights are tuned to reach soonest; None: all-time.
    """
    n = x.shape[-1]
    t = np.arange(carry.t + 1, carry.t + n + 1, dtype=np.float64)  # 1-based row number i
    remaining = population - t + 1.0
    sum_x = _accumulate(np.add, x, carry.sum_x)
    seen_before = _shifted(carry.sum_x, sum_x, 0.0)
    if method == "hoeffding":
        lam = np.broadcast_to(np.minimum(np.sqrt(8.0 * log_term / (t * np.log1p(t))), MAX_LAMBDA), x.shape)
        penalty = np.broadcast_to(lam * lam / 8.0, x.shape)
    else:  # betting weights from the rows before i: their mean and variance, shrunk to 1/2 and 1/4
        means = (0.5 + sum_x) / (t + 1.0)
        previous = _shifted(carry.last_mean, means, 0.5)
        sum_squares = _accumulate(np.add, (x - means) ** 2, carry.sum_squares)
        squares_before = _shifted(carry.sum_squares, sum_squares, 0.0)
        if target is None:
            var_prev = (0.25 + squares_before) / t
            lam = np.minimum(np.sqrt(2.0 * log_term / (var_prev * t * np.log1p(t))), MAX_LAMBDA)
        else:
            var_prev = (0.25 * TUNED_PRIOR_ROWS + squares_before) / (t - 1.0 + TUNED_PRIOR_ROWS)
            lam = np.minimum(target / var_prev, MAX_LAMBDA)
        penalty = (x - previous) ** 2 * (-np.log1p(-lam) - lam)
        carry.last_mean, carry.sum_squares = means[..., -1:], sum_squares[..., -1:]
    denominator = _accumulate(np.add, lam * population / remaining, carry.denominator)
    centre_sum = _accumulate(np.add, lam * (x + seen_before / remaining), carry.centre_sum)
    penalty_sum = _accumulate(np.add, penalty, carry.penalty_sum)
    centre = centre_sum / denominator
    margin = (log_term + penalty_sum) / denominator
    lower = _accumulate(np.maximum, np.maximum(centre - margin, sum_x / population), carry.lower)
    upper = _accumulate(np.minimum, np.minimum(centre + margin, (sum_x + population - t) / population), carry.upper)
    carry.t += n
    carry.sum_x, carry.denominator = sum_x[..., -1:], denominator[..., -1:]
    carry.centre_sum, carry.penalty_sum = centre_sum[..., -1:], penalty_sum[..., -1:]
    carry.lower, carry.upper = lower[..., -1:], upper[..., -1:]
    return lower, upper


def _checked(method: str, rule: str = TIME_UNIFORM) -> None:
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if rule not in RULES:
        raise ValueError(f"rule: expected one of {RULES}, got {rule!r}")


def fixed_width_bounds(rows, sums, sums_of_squares, population: int, level: float = 0.95):
    """The fixed-width rule's interval, in [0, 1], after ``rows`` rows of values in [0, 1] whose sum
    and sum of squares are given (arrays of any shape): the fixed-n interval of the rows seen
    (Agresti-Coull: ``z^2 / 2`` pseudo-rows at 0 and at 1; the finite-population correction),
    within the sure bounds. Not time-uniform: valid once, at a stop chosen by that rule.
    """
    z = Z95 if level == 0.95 else NormalDist().inv_cdf(0.5 + level / 2.0)
    t = np.asarray(rows, dtype=np.float64)
    pseudo = z * z
    sure_low, sure_high = sums / population, (sums + population - t) / population
    mean = (sums + pseudo / 2.0) / (t + pseudo)
    centre = np.clip(mean, sure_low, sure_high)
    variance = np.maximum((sums_of_squares + pseudo / 2.0) / (t + pseudo) - mean * mean, 0.0)
    half = z * np.sqrt(variance * (population - t) / max(population - 1, 1) / (t + pseudo))
    return np.maximum(centre - half, sure_low), np.minimum(centre + half, sure_high)


def _fixed_width(x: np.ndarray, carry: _Carry, population: int, level: float):
    """:func:`fixed_width_bounds` after each row of ``x`` (scaled), ``carry`` moved past them."""
    n = x.shape[-1]
    t = np.arange(carry.t + 1, carry.t + n + 1, dtype=np.float64)
    sum_x = _accumulate(np.add, x, carry.sum_x)
    sum_squares = _accumulate(np.add, x * x, carry.sum_squares)
    carry.t += n
    carry.sum_x, carry.sum_squares = sum_x[..., -1:], sum_squares[..., -1:]
    return fixed_width_bounds(t, sum_x, sum_squares, population, level)


class _Rule:
    """One rule's intervals, a stream's rows at a time (scaled to [0, 1] from ``bounds``)."""

    def __init__(self, population: int, level: float, bounds, method: str, width: Optional[float], rule: str):
        _checked(method, rule)
        self.population, self.level, self.method, self.rule = int(population), level, method, rule
        self.low, self.high = float(bounds[0]), float(bounds[1])
        # the weights' target: the half-width asked for, in the scaled units (none for no width, or 0)
        self.target = float(width) / 2.0 / (self.high - self.low) if width else None
        self.carry = _Carry()

    def step(self, values) -> Tuple[np.ndarray, np.ndarray]:
        """(lower, upper) in the values' units after each row of ``values``."""
        x = _scaled(values, self.low, self.high)
        if self.rule == FIXED_WIDTH:
            lower, upper = _fixed_width(x, self.carry, self.population, self.level)
        else:
            lower, upper = _extend(x, self.carry, self.population, math.log(2.0 / (1.0 - self.level)), self.method,
                                   self.target)
        span = self.high - self.low
        return self.low + span * lower, self.low + span * upper


def sequence(values, population: int, level: float = 0.95, bounds=(0.0, 1.0),
             method: str = "empirical-bernstein", width: Optional[float] = None, rule: str = TIME_UNIFORM):
    """``(lower, upper)``: arrays shaped like ``values`` (the last axis is the order the rows
    were seen in; leading axes are independent streams), the interval for the mean over the
    ``population`` rows after each row. Already intersected over time and with the sure bounds.
    ``width``: the width (in the values' units) the weights are tuned to reach soonest (None:
    all-time weights). ``rule="fixed-width"``: the fixed-n interval after each row instead (not
    time-uniform: valid once, at a stop chosen by that rule; see the module's doc).
    """
    stream = _Rule(population, level, bounds, method, width, rule)
    values = np.asarray(values, dtype=np.float64)
    n = values.shape[-1]
    if n > population:
        raise ValueError(f"values: expected at most population={population} rows, got {n}")
    if n == 0:
        _scaled(values, stream.low, stream.high)
        return np.zeros(values.shape), np.zeros(values.shape)
    lower, upper = stream.step(values)
    if n == population:
        exact = np.mean(values, axis=-1)
        lower[..., -1] = exact
        upper[..., -1] = exact
    return lower, upper


class RunningSequence:
    """:func:`sequence` of one stream given a round of rows at a time: ``extend(values)``
    returns ``(low, high)`` after the round's last row, the bits ``sequence`` gives at that
    row for all the rows so far, at a cost of the round's rows (not of every row seen).
    """

    def __init__(self, population: int, level: float = 0.95, bounds=(0.0, 1.0),
                 method: str = "empirical-bernstein", width: Optional[float] = None, rule: str = TIME_UNIFORM):
        self._stream = _Rule(population, level, bounds, method, width, rule)
        self.population, self.method, self.rule = self._stream.population, method, rule
        self._values: List[np.ndarray] = []  # for the exact mean once every row is seen

    @property
    def rows(self) -> int:
        return self._stream.carry.t

    def extend(self, values) -> Tuple[float, float]:
        values = np.asarray(values, dtype=np.float64)
        if values.ndim != 1 or values.size == 0:
            raise ValueError(f"values: expected a non-empty 1-D array of a round's rows, got shape {values.shape}")
        if self.rows + values.size > self.population:
            raise ValueError(f"values: expected at most population={self.population} rows in all, "
                             f"got {self.rows + values.size}")
        self._values.append(values)
        lower, upper = self._stream.step(values)
        if self.rows == self.population:
            exact = float(np.mean(np.concatenate(self._values)))
            return exact, exact
        return float(lower[-1]), float(upper[-1])


def describe(rule: str = TIME_UNIFORM, width: Optional[float] = None, level: float = 0.95,
             method: str = "empirical-bernstein") -> Dict:
    """What an interval of ``rule`` is and guarantees, for a report: ``rule``, ``method``,
    ``time_uniform``, ``tuned_to_width`` (time-uniform) and ``guarantee`` (words a user reads).
    """
    _checked(method, rule)
    pct = f"{100 * level:g}%"
    if rule == FIXED_WIDTH:
        return {"rule": rule, "method": "fixed-n-agresti-coull-without-replacement-chow-robbins-stop",
                "time_uniform": False,
                "guarantee": f"about {pct} at this stop, for this stopping rule only: the run stopped at the first "
                             f"round where the fixed-sample {pct} interval of the rows seen was at most {width} "
                             "wide; in simulations such intervals covered the set's value in 94.7-98.3% of runs "
                             "(benchmarks/RESULTS.md, stop rules). Not valid if you look at it and then evaluate "
                             "more rows: --stop-rule time-uniform is."}
    tuned = (f" Its weights are tuned to reach a width of {width} in the fewest rows." if width is not None else "")
    return {"rule": rule, "method": f"confidence-sequence-{method}-without-replacement", "time_uniform": True,
            "tuned_to_width": width,
            "guarantee": f"{pct} time-uniform: the intervals after every round hold all at once with probability "
                         f"at least {pct}, so this one is valid wherever the run stopped, and stays valid if you "
                         f"look at it and then evaluate more rows.{tuned}"}


def interval(values, population: int, level: float = 0.95, bounds=(0.0, 1.0),
             method: str = "empirical-bernstein", width: Optional[float] = None,
             rule: str = TIME_UNIFORM) -> Optional[Dict]:
    """The interval after every row in ``values`` has been seen (None before any row)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return None
    lower, upper = sequence(values, population, level, bounds, method, width, rule)
    about = describe(rule, width, level, method)
    return {**bounds_of(float(lower[-1]), float(upper[-1])), "level": level, "method": about["method"],
            "time_uniform": about["time_uniform"],
            "rows": int(values.size), "population": int(population)}


def hoeffding_union(rows, population: int, level: float = 0.95, span: float = 1.0) -> np.ndarray:
    """The plain time-uniform Hoeffding baseline: the half-width after ``rows`` rows of a
    fixed-n Hoeffding interval at level ``1 - alpha / (t (t + 1))`` (a union bound over t,
    valid without replacement too, Hoeffding 1963 section 6); 0 once the set is seen.
    """
    t = np.asarray(rows, dtype=np.float64)
    half = span * np.sqrt(np.log(2.0 * t * (t + 1.0) / (1.0 - level)) / (2.0 * t))
    return np.where(t >= population, 0.0, half)


def paired_sequence(first, second, population: int, level: float = 0.95, bounds=(0.0, 1.0),
                    method: str = "empirical-bernstein", width: Optional[float] = None, rule: str = TIME_UNIFORM):
    """The sequence for the mean of ``second - first`` per row (both in ``bounds``)."""
    diff = np.asarray(second, dtype=np.float64) - np.asarray(first, dtype=np.float64)
    return sequence(diff, population, level, paired_bounds(bounds), method, width, rule)


def paired_bounds(bounds) -> tuple:
    """The bounds of ``second - first`` per row when both lie in ``bounds``: [-(high-low), high-low]."""
    span = float(bounds[1]) - float(bounds[0])
    return -span, span


def stop_reason(low: float, high: float, rows: int, population: Optional[int], width: Optional[float] = None,
                decide: bool = False) -> Optional[str]:
    """The one stop rule, after a round that brings the rows seen to ``rows``, given the rule's
    interval then: "end" (``population`` rows seen: the interval is the exact value), "decided"
    (``decide`` and the interval excludes 0), "width" (at most ``width`` wide), or None: go on.
    """
    if population is not None and rows >= population:
        return END
    if decide and (low > 0 or high < 0):
        return DECIDED
    if width is not None and high - low <= width:
        return WIDTH
    return None


# Why a run stopped (StopReport.reason), and how the summary says it.
WIDTH, DECIDED, END = "width", "decided", "end"
STOP_REASONS = {WIDTH: "its interval is at most {width} wide",
                DECIDED: "the {better} checkpoint is better (the interval of the difference excludes 0)",
                END: "the set ended"}


def bounds_of(low: float, high: float) -> Dict:
    """An interval's ``low``, ``high`` and ``width``: the first keys of each interval a report holds."""
    return {"low": low, "high": high, "width": high - low}


def where_stopped(interval: Dict, reason: str, rows_used: int, rows_in_set: int, rounds: int,
                  round_rows: int) -> Dict:
    """The keys a stop report (:class:`StopReport`, :func:`stop_report`) says of where it stopped, in order."""
    return dict(interval=interval, reason=reason, rows_used=rows_used, rows_in_set=rows_in_set,
                rows_saved=rows_in_set - rows_used, rounds=rounds, round_rows=round_rows)


@dataclasses.dataclass(frozen=True)
class StopReport:
    """``metrics.json``'s ``stopping``, its keys these fields in this order: written by a run in
    rounds (``stopping.py``), read back with :meth:`from_json` by the summary and the report.
    ``better`` is written only for a paired run (``paired``, not written: where it may be null).
    """
    metric: str
    stop_at_width: Optional[float]
    stop_when_decided: bool
    rule: str
    reason: str  # a key of STOP_REASONS
    better: Optional[str]  # "first", "second" or None (neither): a paired run only
    interval: Dict  # of, low, high, width, level and describe()'s keys
    rows_used: int
    rows_in_set: int
    rows_saved: int
    rounds: int
    round_rows: int
    seconds: float
    # the rows not evaluated at the rate of those that were (the rounds' evaluation loops)
    seconds_saved_estimate: float
    metrics_are_of: str
    paired: bool = False

    def to_json(self) -> Dict:
        """The dict metrics.json holds."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "paired" and (f.name != "better" or self.paired)}

    @classmethod
    def from_json(cls, stop: Dict) -> StopReport:
        """The report a metrics.json's ``stopping`` holds."""
        return cls(**{"better": None, **stop, "paired": "better" in stop})

    def sentence(self) -> str:
        """What the run stopped on, in the words of the summary."""
        interval = self.interval
        why = STOP_REASONS[self.reason].format(width=self.stop_at_width, better=self.better)
        saved = (f" {self.rows_saved} rows saved (about {self.seconds_saved_estimate:.1f} s of evaluation); "
                 f"the metrics below are of the {self.rows_used} rows used, a random sample."
                 if self.rows_saved else "")
        return (f"stopped after {self.rows_used} of {self.rows_in_set} rows ({self.rounds} round(s)): {why}. "
                f"{interval['of']}: [{interval['low']:.4f}, {interval['high']:.4f}] "
                f"({100 * interval['level']:g}% {self.guarantee_words()}).{saved}")

    def guarantee_words(self) -> str:
        """What the interval it stopped on guarantees, in a few words (``interval.guarantee`` says more)."""
        if self.interval.get("time_uniform", True):
            return "time-uniform: valid wherever the run stops"
        return "fixed-width rule: valid at this stop only, not if more rows are evaluated after it"


def stopping_round(lower, upper, round_ends, width: Optional[float] = None, decide: bool = False,
                   population: Optional[int] = None):
    """The index into ``round_ends`` (row counts after each round) of the first round at which
    :func:`stop_reason` stops, the last round otherwise (reason "end"). Returns ``(round, reason)``,
    reason one of "width", "decided", "end".
    """
    for k, end in enumerate(round_ends):
        at_end = population is not None and end >= population
        low, high = (0.0, 0.0) if at_end else (float(lower[end - 1]), float(upper[end - 1]))
        reason = stop_reason(low, high, end, population, width, decide)
        if reason is not None:
            return k, reason
    return len(round_ends) - 1, END


def stop_report(values, population: int, round_rows: int, width: Optional[float] = None,
                decide: bool = False, bounds=(0.0, 1.0), level: float = 0.95, paired_with=None,
                rule: str = TIME_UNIFORM) -> Dict:
    """What a run that looks after every ``round_rows`` rows would stop on: ``values`` are the
    per-row values of the whole set in the order the rows are seen (``paired_with``: the first
    model's, ``values`` then the second's; the difference is second - first). Only the rows up to
    the stopping round decide it. ``rule``: "time-uniform" (tuned to ``width`` when given) or
    "fixed-width". Keys: ``interval`` (low, high, width, level, rule, method, time_uniform,
    guarantee, ...), ``reason`` ("width", "decided" or "end"), ``rows_used``, ``rows_in_set``,
    ``rows_saved``, ``rounds``, ``round_rows``, ``estimate`` (the mean of the rows used).
    """
    values = np.asarray(values, dtype=np.float64)
    if paired_with is not None:
        lower, upper = paired_sequence(paired_with, values, population, level, bounds, width=width, rule=rule)
        values = values - np.asarray(paired_with, dtype=np.float64)
    else:
        lower, upper = sequence(values, population, level, bounds, width=width, rule=rule)
    ends = list(range(round_rows, values.size, round_rows)) + [values.size]
    k, reason = stopping_round(lower, upper, ends, width, decide, population)
    used = ends[k]
    interval = {**bounds_of(float(lower[used - 1]), float(upper[used - 1])), "level": level,
                **describe(rule, width, level)}
    return {**where_stopped(interval, reason, used, int(population), k + 1, round_rows),
            "estimate": float(values[:used].mean())}


def row_values(metric: str, logits, labels, top_k: int = 2):
    """``(per-row values, their bounds)`` of a built-in stopping metric (STOP_METRICS): their
    mean is the metric of metrics.json (accuracy from the argmax, as ``preds``).
    """
    from dist_eval.metrics import per_sample_brier, softmax, top_k_hits

    logits, labels = np.asarray(logits), np.asarray(labels)
    if metric not in STOP_METRICS:
        raise ValueError(f"metric: expected one of {sorted(STOP_METRICS)}, got {metric!r}")
    if metric == "accuracy":
        values = (np.argmax(logits, axis=1) == labels).astype(np.float64)
    elif metric == "top_k_accuracy":
        values = top_k_hits(logits, labels, top_k).astype(np.float64)
    else:
        values = per_sample_brier(softmax(logits), labels)
    return values, STOP_METRICS[metric]


def fixed_n_rows(variance: float, width: float, population: int, level: float = 0.95) -> int:
    """The rows a fixed-n normal interval of this ``width`` needs for values of this
    ``variance``, corrected for sampling ``population`` rows without replacement (the
    benchmarks' "oracle" at the true variance, and the careful ``--limit`` at 1/4).
    """
    z = NormalDist().inv_cdf(0.5 + level / 2.0)
    n0 = z * z * variance / (width / 2.0) ** 2
    return int(min(population, math.ceil(n0 / (1.0 + (n0 - 1.0) / population))))
