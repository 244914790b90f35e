"""Clustered rows (``--cluster-by COLUMN``, issue 52): intervals that resample whole clusters.

Rows that share a cluster (the questions about one passage, the turns of one conversation,
one template filled many times, the pieces of one document) are not independent, and an
interval that draws rows one by one is too narrow. The cluster bootstrap draws the G clusters
with replacement (G of them per resample) and keeps every row of each cluster drawn; the
cluster-robust (CR1) standard error of a mean is the closed form of the same idea, and the
design effect is its variance over the variance of independent rows (how many times fewer
independent rows the set is worth).

Pure numpy functions of per-row arrays and each row's cluster; no processes, no I/O. Exact for
any world size and any order of the rows: clusters are numbered in the sorted order of their
names, the rows put in a canonical order inside them (sorted by every value), so every result
depends only on the multiset of (cluster, row) pairs, and the seed fixes it. The random streams
are their own (``SeedSequence(seed, spawn_key=(CLUSTER_STREAM,))``, ``PAIRED_CLUSTER_STREAM``
for a paired comparison): a run without clusters draws what it drew before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from dist_eval.intervals import (
    EXACT_SCORE_ROWS,
    auroc_influence,
    canonical_row_order,
    macro_of_defined,
    ranking_of,
    weighted_auroc,
)
from dist_eval.metrics import paired_differences, paired_rows, weighted_sums
from dist_eval.resampling import (
    bootstrap_pvalue,
    check_resampling,
    generator,
    percentile_interval,
    percentile_intervals,
    resample_chunks,
    resample_counts,
)

CLUSTER_METHOD = "cluster-bootstrap-percentile"
CLUSTER_STREAM = 3
PAIRED_CLUSTER_STREAM = 4
# Fewer clusters than this: no clustered interval (one cluster drawn G times is the set itself)
MIN_CLUSTERS = 2
# Row weights held at once for the AUROC of cluster resamples (a constant: the results never depend on it)
ROW_WEIGHTS_PER_CHUNK = 1 << 22
# Above this many rows a resample's AUROC is linearized (its cost per resample: clusters, not rows x classes),
# as the score intervals of a big set are (dist_eval.intervals.grouped_score_intervals)
EXACT_AUROC_ROWS = EXACT_SCORE_ROWS
LINEARIZED = "; AUROC linearized"
TOO_FEW_CLUSTERS = f"too few clusters for an interval (fewer than {MIN_CLUSTERS})"


def cluster_numbers(names: Sequence) -> np.ndarray:
    """Each row's cluster as a number: the rank of its name (a text) among the sorted distinct
    names, so the same clusters get the same numbers in any order of the rows.
    """
    names = np.asarray([str(name) for name in names], dtype=str)
    if names.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.unique(names, return_inverse=True)[1].astype(np.int64).ravel()


def _compact(clusters) -> np.ndarray:
    """Cluster numbers 0..G-1 of the clusters present, in the order of the given numbers."""
    clusters = np.asarray(clusters, dtype=np.int64)
    return np.unique(clusters, return_inverse=True)[1].astype(np.int64).ravel() if clusters.size else clusters


def number_of_clusters(clusters) -> int:
    return int(np.unique(np.asarray(clusters)).size)


def _sorted(values, clusters) -> tuple:
    values = np.asarray(values, dtype=np.float64)
    clusters = _compact(clusters)
    if values.shape != clusters.shape or values.ndim != 1:
        raise ValueError(f"values and clusters must be 1-D of one length; got {values.shape}, {clusters.shape}")
    order = np.lexsort((values, clusters))  # canonical: the same sums in any order of the rows
    return values[order], clusters[order]


# a CR1 standard error this small beside the mean is a zero variance rounded (every cluster holding the same mean,
# e.g. one row fixed in each of G clusters alike): its t statistic, over 1e9, would say p = 0 of a few rows
NO_SPREAD = 1e-9


def cr1_standard_error(values, clusters) -> float:
    """The cluster-robust (CR1) standard error of the mean of ``values``: statsmodels'
    ``OLS(values, ones).fit(cov_type="cluster", cov_kwds={"groups": clusters})``'s, i.e.
    sqrt(G / (G - 1) x sum over clusters of (the cluster's sum of residuals)^2) / n. NaN with
    fewer than two clusters.
    """
    values, clusters = _sorted(values, clusters)
    n, g = values.size, number_of_clusters(clusters)
    if g < 2:
        return float("nan")
    sums = np.bincount(clusters, weights=values - values.mean(), minlength=g)
    return float(np.sqrt(g / (g - 1) * weighted_sums(sums[None, :], sums)[0]) / n)


def cluster_robust_pvalue(values, clusters) -> float:
    """Two-sided p-value of a mean of 0 with clustered rows: t = mean / :func:`cr1_standard_error`
    on G - 1 degrees of freedom (statsmodels' ``OLS(values, 1).fit(cov_type="cluster", use_t=True)``
    t test). For a paired difference of correctness, McNemar's test with the clusters counted.
    NaN with fewer than two clusters or no spread between the clusters (:data:`NO_SPREAD`: the callers then use
    McNemar's exact test); 1 when the mean is 0.
    """
    from scipy.stats import t as student

    values = np.asarray(values, dtype=np.float64)
    se, g = cr1_standard_error(values, clusters), number_of_clusters(clusters)
    if np.isnan(se):
        return float("nan")
    mean = float(np.sort(values).sum() / values.size)
    if mean == 0:
        return 1.0
    if se <= NO_SPREAD * abs(mean):  # every cluster's mean alike (zero but for rounding): no variance to test with
        return float("nan")
    return float(2 * student.sf(abs(mean) / se, g - 1))


def iid_standard_error(values) -> float:
    """The standard error of the mean of independent rows: sqrt(sample variance / n) (OLS's)."""
    values = np.sort(np.asarray(values, dtype=np.float64))
    n = values.size
    if n < 2:
        return float("nan")
    residuals = values - values.mean()
    return float(np.sqrt(weighted_sums(residuals[None, :], residuals)[0] / (n - 1) / n))


def design_effect(values, clusters) -> float:
    """The variance of the mean with clusters (CR1) over that of independent rows: 1 when the
    clusters do not matter, about 1 + (m - 1) ICC for clusters of m rows with intra-cluster
    correlation ICC. NaN where either is undefined or the rows do not vary.
    """
    clustered, rows = cr1_standard_error(values, clusters), iid_standard_error(values)
    return float((clustered / rows) ** 2) if rows > 0 else float("nan")


@dataclass
class _ClassSums:
    """Per cluster [G, P] over the P classes present (as a label or a prediction): support, predictions, hits."""

    support: np.ndarray
    predicted: np.ndarray
    hits: np.ndarray
    num_labels: int

    @classmethod
    def of(cls, clusters, labels, preds, num_labels: int, g: int, present: np.ndarray) -> _ClassSums:
        column = np.full(num_labels, -1, dtype=np.int64)
        column[present] = np.arange(present.size)
        size = g * present.size

        def per_cluster(classes, weights=None):
            return np.bincount(clusters * present.size + column[classes], weights=weights,
                               minlength=size).reshape(g, present.size).astype(np.float64)

        return cls(per_cluster(labels), per_cluster(preds), per_cluster(labels, (labels == preds).astype(np.float64)),
                   num_labels)

    def drawn(self, weights: np.ndarray, sizes: np.ndarray) -> tuple:
        """(accuracy, macro-F1) of each resample (``weights`` [r, G]: how often each cluster is drawn)."""
        tp = weights @ self.hits
        denominator = weights @ self.support + weights @ self.predicted  # 2tp + fp + fn
        f1 = np.divide(2 * tp, denominator, out=np.zeros_like(tp), where=denominator != 0)
        return tp.sum(axis=1) / sizes, f1.sum(axis=1) / self.num_labels  # absent classes: F1 0


class _ScoreSums:
    """What each probability score of a resample needs, per cluster (rows in canonical order): the AUROC's
    first (of the intervals' module: the set's AUROC and each cluster's summed influence on it, linearized,
    above EXACT_AUROC_ROWS rows; else each class's ranking, exact), then the calibration gaps, the Brier
    sums and the top-k hits.
    """

    def __init__(self, probs, labels, clusters, g: int, top_k, bins: int):
        from dist_eval import metrics as M

        self.linearized = clusters.size > EXACT_AUROC_ROWS
        if self.linearized:  # A + the drawn clusters' summed influence: the exact AUROC's first order
            self.auroc, influence = auroc_influence(probs, labels)
            self.influence = None if influence is None else np.bincount(clusters, weights=influence, minlength=g)
            del influence
        else:
            classes = [1] if probs.shape[1] == 2 else range(probs.shape[1])
            self.rankings = [ranking_of(probs[:, c], labels == c) for c in classes]
        num_labels = probs.shape[1]
        self.k = M.default_top_k(num_labels) if top_k is None else top_k
        self.bins, self.clusters = bins, clusters
        confidence = probs.max(axis=1)
        gap = confidence - (probs.argmax(axis=1) == labels)
        where = clusters * bins + M.calibration_bins(confidence, bins)
        self.gaps = np.bincount(where, weights=gap, minlength=g * bins).reshape(g, bins)
        self.brier = np.bincount(clusters, weights=M.per_sample_brier(probs, labels), minlength=g)
        self.hits = (np.bincount(clusters, weights=M.top_k_hits(probs, labels, self.k).astype(np.float64),
                                 minlength=g) if self.k is not None else None)

    def names(self) -> list:
        return ["ece", "brier", *([f"top{self.k}_accuracy"] if self.k is not None else []), "auroc_macro"]

    def drawn(self, whole: np.ndarray, weights: np.ndarray, sizes: np.ndarray) -> dict:
        out = {"ece": np.abs(weighted_sums(weights, self.gaps)).sum(axis=1) / sizes,
               "brier": weighted_sums(weights, self.brier) / sizes}
        if self.k is not None:
            out[f"top{self.k}_accuracy"] = weights @ self.hits / sizes  # counts of hits: exact in any order
        if self.linearized:
            out["auroc_macro"] = (self.auroc + weighted_sums(weights, self.influence) / sizes
                                  if self.influence is not None else np.full(whole.shape[0], np.nan))
            return out
        auroc = np.empty(whole.shape[0])
        for start, r in resample_chunks(whole.shape[0], self.clusters.size, ROW_WEIGHTS_PER_CHUNK):  # [r, n] at once
            rows = np.take(whole[start:start + r], self.clusters, axis=1)
            totals = rows.sum(axis=1, dtype=np.int64)
            per_class = np.stack([weighted_auroc(rows, ranking, totals) for ranking in self.rankings], axis=1)
            auroc[start:start + r] = macro_of_defined(per_class)
        out["auroc_macro"] = auroc
        return out


def cluster_bootstrap_intervals(
    labels, preds, losses, clusters, num_labels: int, resamples: int = 1000, seed: int = 0,
    level: float = 0.95, probs: Optional[np.ndarray] = None, top_k: Optional[int] = None, bins: int = 15,
) -> Optional[dict]:
    """Percentile cluster-bootstrap intervals: ``{"method", "resamples", "seed", "level",
    "clusters", "accuracy", "f1_macro", "loss"}`` and, with ``probs``, ``"ece", "brier",
    "top{k}_accuracy", "auroc_macro"`` (:func:`dist_eval.intervals.bootstrap_intervals`' and
    :func:`~dist_eval.intervals.bootstrap_score_intervals`' keys). Each resample draws G of the
    G clusters (``clusters``: each row's number, any integers) with replacement and scores
    every row of each drawn cluster: each metric as :mod:`dist_eval.metrics` computes it on
    those rows. None when ``resamples`` is 0, there are no rows or fewer than MIN_CLUSTERS
    clusters. Cost: resamples x (clusters x classes), and resamples x rows x classes for AUROC up
    to EXACT_AUROC_ROWS rows; above, a resample's AUROC is linearized (the set's plus the drawn rows'
    influence, as :func:`dist_eval.intervals.auroc_influence` gives it; ``method`` says so).
    """
    labels, preds = np.asarray(labels, dtype=np.int64), np.asarray(preds, dtype=np.int64)
    losses, clusters = np.asarray(losses, dtype=np.float64), _compact(clusters)
    check_resampling(resamples, level)
    if not labels.shape == preds.shape == losses.shape == clusters.shape or labels.ndim != 1:
        raise ValueError(f"labels, preds, losses and clusters differ in shape: {labels.shape}, {preds.shape}, "
                         f"{losses.shape}, {clusters.shape}")
    g = int(clusters.max()) + 1 if clusters.size else 0  # numbered 0..G-1 by _compact
    if resamples == 0 or labels.size == 0 or g < MIN_CLUSTERS:
        return None
    extra = [] if probs is None else [np.asarray(probs, dtype=np.float64)]
    order = canonical_row_order(clusters, labels, preds, losses, *extra)
    clusters, labels, preds, losses = clusters[order], labels[order], preds[order], losses[order]
    # the rows' probabilities in canonical order: a temporary, not held through the resamples
    scores = None if probs is None else _ScoreSums(extra[0][order], labels, clusters, g, top_k, bins)
    present = np.flatnonzero(np.bincount(labels, minlength=num_labels) + np.bincount(preds, minlength=num_labels))
    classes = _ClassSums.of(clusters, labels, preds, num_labels, g, present)
    sizes = np.bincount(clusters, minlength=g).astype(np.float64)
    loss_sums = np.bincount(clusters, weights=losses, minlength=g)
    names = ["accuracy", "f1_macro", "loss", *(scores.names() if scores else [])]
    values = {name: np.empty(resamples) for name in names}
    for start, whole in resample_counts(generator(seed, CLUSTER_STREAM), g, resamples):
        stop, weights = start + whole.shape[0], whole.astype(np.float64)
        drawn_sizes = weights @ sizes
        values["accuracy"][start:stop], values["f1_macro"][start:stop] = classes.drawn(weights, drawn_sizes)
        values["loss"][start:stop] = weighted_sums(weights, loss_sums) / drawn_sizes
        for name, drawn in (scores.drawn(whole, weights, drawn_sizes) if scores else {}).items():
            values[name][start:stop] = drawn
    method = CLUSTER_METHOD + (LINEARIZED if scores is not None and scores.linearized else "")
    return {**percentile_intervals(values, seed, level, method, defined=True), "clusters": g}


def paired_cluster_bootstrap(
    labels, preds_a, preds_b, losses_a, losses_b, clusters, num_labels: int, resamples: int = 1000,
    seed: int = 0, level: float = 0.95,
) -> Optional[dict]:
    """:func:`dist_eval.paired.paired_bootstrap`'s result (differences B - A in accuracy,
    macro-F1 and loss, :func:`dist_eval.metrics.paired_differences`, and their intervals) with
    whole clusters drawn: each resample draws G of
    the G clusters with replacement, the same for A and B. Adds ``clusters``, and to
    ``accuracy`` and ``loss`` (means of a per-row difference) the CR1 and independent-rows
    standard errors of the difference, their design effect and the cluster-robust test's p-value
    (:func:`cluster_robust_pvalue`); macro F1 (not a mean of rows) gets the cluster bootstrap's
    p-value, :func:`bootstrap_pvalue` (below 1 - level exactly where 0 is outside its interval).
    None when there are no rows; intervals None with ``resamples`` 0 or fewer than MIN_CLUSTERS
    clusters.
    """
    check_resampling(resamples, level)
    labels, preds_a, preds_b, losses_a, losses_b = paired_rows(labels, preds_a, preds_b, losses_a, losses_b)
    if labels.size == 0:
        return None
    clusters = _compact(clusters)
    g = number_of_clusters(clusters)
    point = {"method": CLUSTER_METHOD, "resamples": int(resamples), "seed": int(seed), "level": float(level),
             **{name: {"difference": float(value), "interval": None} for name, value
                in paired_differences(labels, preds_a, preds_b, losses_a, losses_b, num_labels).items()},
             "clusters": g}
    gap = losses_b - losses_a
    difference = (preds_b == labels).astype(np.float64) - (preds_a == labels)
    for name, per_row in (("accuracy", difference), ("loss", gap)):
        point[name].update(standard_error_clustered=_none_if_nan(cr1_standard_error(per_row, clusters)),
                           standard_error_rows=_none_if_nan(iid_standard_error(per_row)),
                           design_effect=_none_if_nan(design_effect(per_row, clusters)),  # None: undefined
                           pvalue_clustered=_none_if_nan(cluster_robust_pvalue(per_row, clusters)))
    point["f1_macro"]["pvalue_clustered"] = None
    if resamples == 0 or g < MIN_CLUSTERS:
        return point
    order = canonical_row_order(clusters, labels, preds_a, preds_b, gap)
    draws = _paired_draws(clusters[order], labels[order], preds_a[order], preds_b[order], gap[order], num_labels,
                          g, resamples, seed)
    for name, drawn in draws.items():
        point[name]["interval"] = percentile_interval(drawn, level)
    point["f1_macro"]["pvalue_clustered"] = bootstrap_pvalue(draws["f1_macro"])
    return point


def _paired_draws(clusters, labels, preds_a, preds_b, gap, num_labels: int, g: int, resamples: int, seed: int):
    """``{"accuracy", "f1_macro", "loss"}``: B - A in each cluster resample (rows in canonical order)."""
    present = np.flatnonzero(np.bincount(labels, minlength=num_labels) + np.bincount(preds_a, minlength=num_labels)
                             + np.bincount(preds_b, minlength=num_labels))
    sides = [_ClassSums.of(clusters, labels, preds, num_labels, g, present) for preds in (preds_a, preds_b)]
    sizes = np.bincount(clusters, minlength=g).astype(np.float64)
    gap_sums = np.bincount(clusters, weights=gap, minlength=g)
    out = {name: np.empty(resamples) for name in ("accuracy", "f1_macro", "loss")}
    for start, whole in resample_counts(generator(seed, PAIRED_CLUSTER_STREAM), g, resamples):
        stop, weights = start + whole.shape[0], whole.astype(np.float64)
        drawn_sizes = weights @ sizes
        (acc_a, f1_a), (acc_b, f1_b) = (side.drawn(weights, drawn_sizes) for side in sides)
        out["accuracy"][start:stop] = acc_b - acc_a
        out["f1_macro"][start:stop] = f1_b - f1_a
        out["loss"][start:stop] = weighted_sums(weights, gap_sums) / drawn_sizes
    return out


def clustered_report(report: dict, labels, preds, losses, probs, names: Sequence, column: str,
                     bootstrap) -> dict:
    """``report`` (:func:`dist_eval.scoring.row_metrics`' of these rows) with every interval
    resampling whole clusters (``names``: each row's cluster): ``confidence_intervals`` the
    cluster bootstrap's (None, with ``interval_note``, under MIN_CLUSTERS clusters), and
    ``clustering``: the column, the number of clusters, the design effect and both standard
    errors of the accuracy, and ``unclustered_intervals`` (what ``confidence_intervals`` held:
    the rows drawn one by one), side by side. ``bootstrap``: (resamples, seed) or None.
    """
    clusters = cluster_numbers(names)
    correct = (np.asarray(labels) == np.asarray(preds)).astype(np.float64)
    out = dict(report)
    unclustered = out.pop("confidence_intervals", None)
    note = out.pop("interval_note", None)  # why the rows have no interval (a slice's): it stays last
    out["clustering"] = {
        "column": column, "clusters": number_of_clusters(clusters),
        "design_effect": _none_if_nan(design_effect(correct, clusters)),
        "standard_error": {"clustered": _none_if_nan(cr1_standard_error(correct, clusters)),
                           "rows": _none_if_nan(iid_standard_error(correct))},
        "unclustered_intervals": unclustered,
    }
    if note is not None:
        out["interval_note"] = note
    if unclustered:
        intervals = cluster_bootstrap_intervals(labels, preds, losses, clusters, int(report["num_labels"]),
                                                bootstrap[0], bootstrap[1], unclustered["level"], probs,
                                                report.get("top_k"))
        if intervals is None:
            out["interval_note"] = TOO_FEW_CLUSTERS
        else:  # the metrics the report has intervals of (a NaN one, of an undefined AUROC: None)
            out["confidence_intervals"] = {k: None if isinstance(v, list) and np.isnan(v).any() else v
                                           for k, v in intervals.items()
                                           if k in unclustered or not isinstance(v, list)}
    return out


def clustered_reports(reports, merged, probs: Optional[np.ndarray], clusters: tuple, bootstrap) -> list:
    """Rank 0: :func:`clustered_report` of each of ``reports``, (report, mask) pairs: the report of
    the merged rows ``mask`` picks (None: every row), in one call for the whole set and every slice.
    ``merged``: the run's merged rows; ``probs``: the softmax of their logits (None without logits),
    computed once by the caller for every report; ``clusters``: (column, each row's cluster name, by
    row index).
    """
    column, names = clusters
    names = np.asarray(names, dtype=object)[np.asarray(merged.indices, dtype=np.int64)]
    out = []
    for report, mask in reports:
        rows = slice(None) if mask is None else mask
        out.append(clustered_report(report, merged.labels[rows], merged.preds[rows], merged.losses[rows],
                                    None if probs is None else probs[rows], names[rows], column, bootstrap))
    return out


def _none_if_nan(value: float):
    return None if np.isnan(value) else value
