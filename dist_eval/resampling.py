"""The one resampling engine under every bootstrap (issue 71): a seed's random stream, each resample's
draws (how often each row, cluster, cell or group is drawn) in chunks of bounded memory, and what the
resampled values give: a percentile interval, a p-value. The statistic of a resample stays with its caller
(:mod:`dist_eval.intervals`, :mod:`dist_eval.paired`, :mod:`dist_eval.clusters`). Each path draws from its
own numbered stream of the seed, so that a new path changes nothing another path draws.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

# Draws held at once (resamples x categories): bounds memory to a few MiB. A constant, never
# derived from the machine, so the random stream does not depend on it.
_CELLS_PER_CHUNK = 1 << 19


def check_resampling(resamples, level: float) -> None:
    """Refuse a number of resamples that is not an integer >= 0, or a level outside (0, 1)."""
    if not isinstance(resamples, (int, np.integer)) or resamples < 0:
        raise ValueError(f"resamples must be an integer >= 0 (0 disables the intervals); got {resamples!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1); got {level}")


def generator(seed: int, stream: Optional[int] = None) -> np.random.Generator:
    """``Generator(PCG64(seed))``, or with ``stream`` the path's own: ``SeedSequence(seed, spawn_key=(stream,))``."""
    return np.random.Generator(np.random.PCG64(
        seed if stream is None else np.random.SeedSequence(seed, spawn_key=(stream,))))


def resample_chunks(total: int, categories: int, cells: int = _CELLS_PER_CHUNK):
    """Yield ``(start, r)``: the resamples ``start`` to ``start + r`` held at once, of ``categories`` each."""
    step = max(1, cells // max(1, categories))
    for start in range(0, total, step):
        yield start, min(step, total - start)


def multinomial_counts(rng, n: int, probabilities: np.ndarray, resamples: int):
    """Yield ``(start, counts)`` chunks, float64 [r, categories]: how many of a resample's n draws land in
    each category (``probabilities``: each one's share of the n rows), Multinomial(n, probabilities): the
    bootstrap's law of the rows' cells or groups, at a cost of categories, not n, per resample.
    """
    for start, r in resample_chunks(resamples, len(probabilities)):
        yield start, rng.multinomial(n, probabilities, size=r).astype(np.float64)


def resample_counts(rng, n: int, resamples: int, part: tuple = (0, 1)):
    """Yield ``(start, counts)`` chunks, int32 [r, n]: ``counts[i, j]`` is how often row (or cluster) j is
    drawn in resample ``start + i``, of n drawn uniformly with replacement (``rng.integers(0, n, (r, n))``).
    ``part`` = (rank, world size): only every world-size-th chunk (the others' draws are made).
    """
    # int32 draws below 2**31 are the same numbers from the same stream as int64 ones (numpy's
    # bounded 32-bit generator serves both), with half the bytes to write.
    dtype = np.int32 if n <= np.iinfo(np.int32).max else np.int64
    for number, (start, r) in enumerate(resample_chunks(resamples, n)):
        indices = rng.integers(0, n, size=(r, n), dtype=dtype)
        if number % part[1] != part[0]:
            continue
        flat = indices.ravel() if r == 1 else (np.arange(r, dtype=np.int64)[:, None] * n + indices).ravel()
        yield start, np.bincount(flat, minlength=r * n).reshape(r, n).astype(np.int32)


def percentile_interval(values: np.ndarray, level: float, defined: bool = False) -> list:
    """``[lo, hi]``: the percentile bootstrap interval at ``level`` of the resampled ``values``; ``defined``:
    of those not NaN (a statistic undefined in some resamples: an AUROC of one class drawn), NaN if none is.
    """
    if defined:
        values = values[~np.isnan(values)]
        if values.size == 0:
            return [float("nan"), float("nan")]
    tail = 100.0 * (1.0 - level) / 2.0
    lo, hi = np.percentile(values, [tail, 100.0 - tail])
    return [float(lo), float(hi)]


def percentile_intervals(values: dict, seed: int, level: float, method: str, defined: bool = False) -> dict:
    """``{"method", "resamples", "seed", "level"}`` and each name's :func:`percentile_interval` of its
    resampled ``values`` (``{name: float64[resamples]}``).
    """
    resamples = len(next(iter(values.values())))
    out = {"method": method, "resamples": int(resamples), "seed": int(seed), "level": float(level)}
    return {**out, **{name: percentile_interval(drawn, level, defined) for name, drawn in values.items()}}


def bootstrap_pvalue(drawn) -> float:
    """The two-sided p-value of a difference of 0 that a percentile bootstrap's ``drawn`` values
    give: twice the smaller share of them on either side of 0 (at most 1), so that it is below
    1 - level where 0 lies outside the interval of that level (up to the percentiles'
    interpolation). For a statistic that is not a mean of rows (macro F1), whose clustered
    test has no closed form.
    """
    drawn = np.asarray(drawn, dtype=np.float64)
    return float(min(1.0, 2.0 * min(np.mean(drawn <= 0.0), np.mean(drawn >= 0.0))))
