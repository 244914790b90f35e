"""Paired comparison of two runs on the same rows: is B really better than A?

Pure functions of aligned per-row arrays (row i of A and row i of B are the same input;
the caller matches the shared rows by row id). No processes, no torch.distributed.

- :func:`mcnemar_exact`: McNemar's exact test of the accuracies, the two-sided binomial
  test of the discordant pairs at 1/2: ``scipy.stats.binomtest(b, b + c, 0.5).pvalue``
  (statsmodels' ``mcnemar(exact=True)``).
- :func:`paired_bootstrap`: percentile bootstrap intervals of the differences B - A in
  accuracy, macro-F1 and mean loss, every resample drawing the same row indices for A and
  B (and for the three metrics), over a canonical row order: the result depends only on the
  multiset of row pairs, so it is the same for any world size, and the seed fixes it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dist_eval.intervals import METHOD, canonical_row_order
from dist_eval.metrics import paired_differences, paired_rows, weighted_sums
from dist_eval.resampling import check_resampling, generator, percentile_interval, resample_counts

PAIRED_STREAM = 2  # the bootstrap's random stream: SeedSequence(seed, spawn_key=(PAIRED_STREAM,))


def binomial_two_sided_pvalue(b: int, c: int) -> float:
    """Two-sided exact binomial p-value of b successes in b + c trials at p = 1/2:
    ``scipy.stats.binomtest(b, b + c, 0.5).pvalue`` (``min(1, 2 P[X <= min(b, c)])``), and
    1 where there are no trials (which binomtest refuses).
    """
    from scipy.stats import binomtest  # imported here: only a comparison needs scipy.stats

    b, c = int(b), int(c)
    if b < 0 or c < 0:
        raise ValueError(f"counts must be >= 0; got {b}, {c}")
    if b + c == 0:
        return 1.0
    return float(binomtest(b, b + c, 0.5).pvalue)


def mcnemar_exact(correct_a: np.ndarray, correct_b: np.ndarray) -> dict:
    """McNemar's exact test on paired correctness: ``{"a_only": b, "b_only": c,
    "discordant": b + c, "pvalue"}`` where b counts rows only A gets right and c rows only
    B gets right; the p-value is :func:`binomial_two_sided_pvalue` (b, c).
    """
    correct_a = np.asarray(correct_a, dtype=bool)
    correct_b = np.asarray(correct_b, dtype=bool)
    if correct_a.shape != correct_b.shape or correct_a.ndim != 1:
        raise ValueError(f"correct_a and correct_b must be 1-D of one length; got {correct_a.shape}, {correct_b.shape}")
    b = int((correct_a & ~correct_b).sum())
    c = int((~correct_a & correct_b).sum())
    return {"a_only": b, "b_only": c, "discordant": b + c, "pvalue": binomial_two_sided_pvalue(b, c)}


def paired_bootstrap(
    labels: np.ndarray,
    preds_a: np.ndarray,
    preds_b: np.ndarray,
    losses_a: np.ndarray,
    losses_b: np.ndarray,
    num_labels: int,
    resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> dict | None:
    """Differences B - A and their paired percentile bootstrap intervals:
    ``{"method", "resamples", "seed", "level", "accuracy": {"difference", "interval"},
    "f1_macro": {...}, "loss": {...}}`` (macro-F1 over all ``num_labels`` classes, as
    :mod:`dist_eval.metrics`; loss the mean of the given per-row losses).

    Each resample draws n row indices with replacement (from
    ``Generator(PCG64(SeedSequence(seed, spawn_key=(PAIRED_STREAM,))))``) over the rows
    sorted canonically, and scores A and B on the same rows. An exact bootstrap: cost
    about resamples x rows x classes operations. ``interval`` is None when ``resamples``
    is 0; the whole result is None when there are no rows.
    """
    labels, preds_a, preds_b, losses_a, losses_b = paired_rows(labels, preds_a, preds_b, losses_a, losses_b)
    check_resampling(resamples, level)
    if labels.shape[0] == 0:
        return None
    point = paired_differences(labels, preds_a, preds_b, losses_a, losses_b, num_labels)
    out = {"method": METHOD, "resamples": int(resamples), "seed": int(seed), "level": float(level)}
    draws = _paired_resamples(labels, preds_a, preds_b, losses_a, losses_b, num_labels, resamples, seed)
    for name, difference in point.items():
        interval = percentile_interval(draws[name], level) if resamples else None
        out[name] = {"difference": float(difference), "interval": interval}
    return out


def _paired_resamples(labels, preds_a, preds_b, losses_a, losses_b, num_labels: int, resamples: int, seed: int):
    """``{"accuracy", "f1_macro", "loss"}``: the difference B - A in each resample."""
    order = canonical_row_order(labels, preds_a, preds_b, losses_a, losses_b)
    labels, preds_a, preds_b = labels[order], preds_a[order], preds_b[order]
    n = labels.shape[0]
    loss_gap = losses_b[order] - losses_a[order]
    eye = np.eye(num_labels)
    true_onehot = eye[labels]
    per_model = []
    for preds in (preds_a, preds_b):
        correct = (preds == labels).astype(np.float64)
        per_model.append((correct, eye[preds], true_onehot * correct[:, None]))
    out = {name: np.empty(resamples) for name in ("accuracy", "f1_macro", "loss")}
    for start, whole in resample_counts(generator(seed, PAIRED_STREAM), n, resamples):
        counts = whole.astype(np.float64)
        stop = start + counts.shape[0]
        support = counts @ true_onehot
        accuracy, f1_macro = [], []
        for correct, pred_onehot, tp_onehot in per_model:
            tp = counts @ tp_onehot
            denominator = support + counts @ pred_onehot  # 2tp + fp + fn
            f1 = np.divide(2 * tp, denominator, out=np.zeros_like(tp), where=denominator != 0)
            accuracy.append(counts @ correct / n)
            f1_macro.append(f1.mean(axis=1))
        out["accuracy"][start:stop] = accuracy[1] - accuracy[0]
        out["f1_macro"][start:stop] = f1_macro[1] - f1_macro[0]
        out["loss"][start:stop] = weighted_sums(counts, loss_gap) / n  # the rest: counts, exact in any order
    return out


def holm_adjusted(pvalues: Sequence[float]) -> list:
    """Holm's step-down adjustment of m p-values (family-wise error over all m): the i-th
    smallest becomes max over j <= i of min(1, (m - j + 1) p_(j)), in the input's order. A
    p-value adjusted below alpha rejects exactly as Holm's procedure at level alpha does.
    """
    p = np.asarray(pvalues, dtype=np.float64)
    m = p.size
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])
    adjusted = np.empty(m)
    adjusted[order] = np.maximum.accumulate(scaled) if m else scaled
    return adjusted.tolist()
