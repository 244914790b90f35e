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
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import numpy as np

METHODS = ("empirical-bernstein", "hoeffding")
# The built-in per-row metrics a run can stop on, and the range of their per-row values.
STOP_METRICS = {"accuracy": (0.0, 1.0), "top_k_accuracy": (0.0, 1.0), "brier": (0.0, 2.0)}
# The largest betting weight: below 1 so that log(1 - lambda) stays finite (the paper's c).
MAX_LAMBDA = 0.5


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


def _extend(x: np.ndarray, carry: _Carry, population: int, log_term: float, method: str):
    """(lower, upper) in [0, 1] after each row of ``x`` (scaled values, the rows after
    ``carry``'s), and ``carry`` moved past them. Every quantity is a running sum, mean or
    max/min, continued from the carry: any split of the rows into calls gives the same bits.
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
        var_prev = (0.25 + _shifted(carry.sum_squares, sum_squares, 0.0)) / t
        lam = np.minimum(np.sqrt(2.0 * log_term / (var_prev * t * np.log1p(t))), MAX_LAMBDA)
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


def _checked_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")


def sequence(values, population: int, level: float = 0.95, bounds=(0.0, 1.0),
             method: str = "empirical-bernstein"):
    """``(lower, upper)``: arrays shaped like ``values`` (the last axis is the order the rows
    were seen in; leading axes are independent streams), the interval for the mean over the
    ``population`` rows after each row. Already intersected over time and with the sure bounds.
    """
    _checked_method(method)
    low, high = float(bounds[0]), float(bounds[1])
    x = _scaled(values, low, high)
    n = x.shape[-1]
    if n > population:
        raise ValueError(f"values: expected at most population={population} rows, got {n}")
    if n == 0:
        return np.zeros(x.shape), np.zeros(x.shape)
    lower, upper = _extend(x, _Carry(), population, math.log(2.0 / (1.0 - level)), method)
    lower, upper = low + (high - low) * lower, low + (high - low) * upper
    if n == population:
        exact = np.mean(np.asarray(values, dtype=np.float64), axis=-1)
        lower[..., -1] = exact
        upper[..., -1] = exact
    return lower, upper


class RunningSequence:
    """:func:`sequence` of one stream given a round of rows at a time: ``extend(values)``
    returns ``(low, high)`` after the round's last row, the bits ``sequence`` gives at that
    row for all the rows so far, at a cost of the round's rows (not of every row seen).
    """

    def __init__(self, population: int, level: float = 0.95, bounds=(0.0, 1.0),
                 method: str = "empirical-bernstein"):
        _checked_method(method)
        self.population, self.method = int(population), method
        self.low, self.high = float(bounds[0]), float(bounds[1])
        self.log_term = math.log(2.0 / (1.0 - level))
        self._carry = _Carry()
        self._values: List[np.ndarray] = []  # for the exact mean once every row is seen

    @property
    def rows(self) -> int:
        return self._carry.t

    def extend(self, values) -> Tuple[float, float]:
        values = np.asarray(values, dtype=np.float64)
        if values.ndim != 1 or values.size == 0:
            raise ValueError(f"values: expected a non-empty 1-D array of a round's rows, got shape {values.shape}")
        if self.rows + values.size > self.population:
            raise ValueError(f"values: expected at most population={self.population} rows in all, "
                             f"got {self.rows + values.size}")
        self._values.append(values)
        lower, upper = _extend(_scaled(values, self.low, self.high), self._carry, self.population, self.log_term,
                               self.method)
        if self.rows == self.population:
            exact = float(np.mean(np.concatenate(self._values)))
            return exact, exact
        span = self.high - self.low
        return float(self.low + span * lower[-1]), float(self.low + span * upper[-1])


def interval(values, population: int, level: float = 0.95, bounds=(0.0, 1.0),
             method: str = "empirical-bernstein") -> Optional[Dict]:
    """The interval after every row in ``values`` has been seen (None before any row)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return None
    lower, upper = sequence(values, population, level, bounds, method)
    return {"low": float(lower[-1]), "high": float(upper[-1]), "width": float(upper[-1] - lower[-1]),
            "level": level, "method": f"confidence-sequence-{method}-without-replacement",
            "time_uniform": True, "rows": int(values.size), "population": int(population)}


def hoeffding_union(rows, population: int, level: float = 0.95, span: float = 1.0) -> np.ndarray:
    """The plain time-uniform Hoeffding baseline: the half-width after ``rows`` rows of a
    fixed-n Hoeffding interval at level ``1 - alpha / (t (t + 1))`` (a union bound over t,
    valid without replacement too, Hoeffding 1963 section 6); 0 once the set is seen.
    """
    t = np.asarray(rows, dtype=np.float64)
    half = span * np.sqrt(np.log(2.0 * t * (t + 1.0) / (1.0 - level)) / (2.0 * t))
    return np.where(t >= population, 0.0, half)


def paired_sequence(first, second, population: int, level: float = 0.95, bounds=(0.0, 1.0),
                    method: str = "empirical-bernstein"):
    """The sequence for the mean of ``second - first`` per row (both in ``bounds``)."""
    diff = np.asarray(second, dtype=np.float64) - np.asarray(first, dtype=np.float64)
    return sequence(diff, population, level, paired_bounds(bounds), method)


def paired_bounds(bounds) -> tuple:
    """The bounds of ``second - first`` per row when both lie in ``bounds``: [-(high-low), high-low]."""
    span = float(bounds[1]) - float(bounds[0])
    return -span, span


def stopping_round(lower, upper, round_ends, width: Optional[float] = None, decide: bool = False,
                   population: Optional[int] = None):
    """The index into ``round_ends`` (row counts after each round) of the first round whose
    interval is at most ``width`` wide, or (``decide``) excludes 0; the last round otherwise.
    A round that reaches ``population`` rows ends the set: its interval is the exact value, and
    the reason is "end" whatever its width. Returns ``(round, reason)``, reason one of "width",
    "decided", "end".
    """
    for k, end in enumerate(round_ends):
        if population is not None and end >= population:
            return k, "end"
        lo, hi = float(lower[end - 1]), float(upper[end - 1])
        if decide and (lo > 0 or hi < 0):
            return k, "decided"
        if width is not None and hi - lo <= width:
            return k, "width"
    return len(round_ends) - 1, "end"


def stop_report(values, population: int, round_rows: int, width: Optional[float] = None,
                decide: bool = False, bounds=(0.0, 1.0), level: float = 0.95, paired_with=None) -> Dict:
    """What a run that looks after every ``round_rows`` rows would stop on: ``values`` are the
    per-row values of the whole set in the order the rows are seen (``paired_with``: the first
    model's, ``values`` then the second's; the difference is second - first). Only the rows up to
    the stopping round decide it. Keys: ``interval`` (low, high, width, level, method,
    time_uniform), ``reason`` ("width", "decided" or "end"), ``rows_used``, ``rows_in_set``,
    ``rows_saved``, ``rounds``, ``round_rows``, ``estimate`` (the mean of the rows used).
    """
    values = np.asarray(values, dtype=np.float64)
    if paired_with is not None:
        lower, upper = paired_sequence(paired_with, values, population, level, bounds)
        values = values - np.asarray(paired_with, dtype=np.float64)
    else:
        lower, upper = sequence(values, population, level, bounds)
    ends = list(range(round_rows, values.size, round_rows)) + [values.size]
    k, reason = stopping_round(lower, upper, ends, width, decide, population)
    used = ends[k]
    interval = {"low": float(lower[used - 1]), "high": float(upper[used - 1]),
                "width": float(upper[used - 1] - lower[used - 1]), "level": level,
                "method": "confidence-sequence-empirical-bernstein-without-replacement", "time_uniform": True}
    return {"interval": interval, "reason": reason, "rows_used": used, "rows_in_set": int(population),
            "rows_saved": int(population) - used, "rounds": k + 1, "round_rows": round_rows,
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
