"""The report of a set of rows (ordered by row index), in the order the data flows: the softmax of the
logits once, every point metric (:mod:`dist_eval.metrics`), then every interval
(:mod:`dist_eval.intervals`), those of the run's merge too, whose score intervals' resamples are shared
over the ranks (:func:`shared_score_intervals`). The run's merge, a stopping run's rounds, the shards'
merge, each slice and ``python -m dist_eval.rescore`` all report their rows through it, so they give
the same numbers. It computes; the callers that run phases give the heap back (``trim_heap``).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from dist_eval import ranks
from dist_eval.chunks import chunk_rows
from dist_eval.intervals import (
    bootstrap_intervals,
    drawn_score_intervals,
    exact_score_cost,
    grouped_score_intervals,
    join_score_resamples,
    kept_score_intervals,
    score_percentiles,
    score_resamples_part,
)
from dist_eval.metrics import (
    CALIBRATION_BINS,
    confusion_matrix,
    default_top_k,
    mean_of,
    metrics_from_confusion,
    reliability_table,
    score_metrics,
    softmax,
)
from dist_eval.results import mapped_array


def mapped_softmax(logits: np.ndarray) -> np.ndarray:
    """:func:`dist_eval.metrics.softmax` of ``logits``; of more than ``chunk_rows("softmax")`` rows, a chunk
    at a time (row by row: a chunk's rows get the whole array's bits) into a
    :func:`~dist_eval.results.mapped_array` (float64: 8 bytes a class of a row, on the local disk, not
    the heap).
    """
    chunk = chunk_rows("softmax")
    probs = mapped_array(logits.shape, np.float64) if len(logits) > chunk else None
    if probs is None:
        return softmax(logits)
    for start in range(0, len(logits), chunk):
        probs[start:start + chunk] = softmax(logits[start:start + chunk])
    return probs


def row_metrics(
    labels, preds, losses, logits, num_labels: int, label_names=None,
    bootstrap: Optional[Tuple[int, int]] = None, top_k: Optional[int] = None, score_intervals: bool = True,
    probs: Optional[np.ndarray] = None, sample_values: Optional[Dict[str, np.ndarray]] = None,
) -> dict:
    """Every built-in metric of the rows, and their intervals. Without ``logits`` and ``probs`` the
    probability scores (``ece``, ``brier``, ``top{k}_accuracy``, ``auroc_macro``, ``top_k``, the
    ``reliability`` table, of the softmax of the logits: ``probs`` where the caller has it) are left out; their
    intervals join ``confidence_intervals`` under ``score_intervals`` (False: the run's merge shares
    them over the ranks, :func:`shared_score_intervals`). ``top_k``: the k of
    ``top{k}_accuracy`` (None: :func:`dist_eval.metrics.default_top_k`). ``sample_values``: per-row
    values whose means the report adds, by name. ``bootstrap``: (resamples, seed) or None.
    """
    if logits is not None and probs is None:
        probs = mapped_softmax(logits)
    # the point metrics: exactly rounded sums, in row order, the same bits for any world size
    report = {"num_samples": int(len(labels)), "num_labels": num_labels}
    report.update(metrics_from_confusion(confusion_matrix(labels, preds, num_labels), label_names))
    report["loss"] = mean_of(losses)
    scores = {}
    if probs is not None:
        k = default_top_k(probs.shape[1]) if top_k is None else top_k
        scores = {**score_metrics(probs, labels, k, CALIBRATION_BINS), "top_k": k}
        table = reliability_table(probs, labels, CALIBRATION_BINS)
        scores["reliability"] = {name: values.tolist() for name, values in table.items()}
    means = {name: mean_of(sample_values[name]) for name in sorted(sample_values or {})}
    # their intervals, of the index-ordered rows: the same for any N
    intervals = kept = None
    if bootstrap and bootstrap[0]:
        intervals = bootstrap_intervals(labels, preds, losses, num_labels, resamples=bootstrap[0], seed=bootstrap[1])
        if probs is not None and score_intervals:
            kept = kept_score_intervals(drawn_score_intervals(  # the rows as score_metrics checked them
                probs, labels, bootstrap[0], bootstrap[1], top_k=scores["top_k"], bins=CALIBRATION_BINS
            ), scores)
        report["confidence_intervals"] = intervals
    # undefined (AUROC with one class present) is null in metrics.json, not NaN: JSON has no NaN, and
    # NaN != NaN would make equal reports compare unequal
    report.update({name: None if isinstance(value, float) and np.isnan(value) else value
                   for name, value in scores.items()})
    if kept is not None:  # one dict of intervals: the same resamples count, seed and level
        if intervals:
            intervals.update(kept)
        else:
            report["score_intervals"] = kept
    report.update(means)
    return report


def rows_report(merged, num_labels: int, label_names, user_metrics, scoring, score_intervals: bool = True,
                probs: Optional[np.ndarray] = None) -> dict:
    """Every metric of the merged rows (:class:`dist_eval.merge.MergedResults`): :func:`row_metrics`' (the
    per-sample values' means among them), the user's, and ``label_names``. ``scoring``: (bootstrap
    (resamples, seed) or None, top_k).
    """
    if label_names is not None and len(label_names) != num_labels:
        label_names = None
    report = row_metrics(merged.labels, merged.preds, merged.losses, merged.logits, num_labels, label_names,
                         scoring[0], scoring[1], score_intervals, probs, merged.sample_values)
    for name, fn in (user_metrics or {}).items():
        value = fn(merged.labels, merged.preds, merged.logits)
        report[name] = value.item() if hasattr(value, "item") else value
    report["label_names"] = list(label_names) if label_names else None
    return report


def main_report(merged, num_labels: int, label_names, user_metrics, scoring) -> Tuple[dict, Optional[np.ndarray]]:
    """Rank 0: (:func:`rows_report` of its merged rows without the probability scores' intervals, which
    every rank then shares: :func:`score_intervals_everywhere`; the rows' probabilities, None without
    logits), the softmax computed once for both. A whole run's merge and a stopping run's rounds make
    their report this way, in a phase, so that a failure in it (a user's metric) fails every rank.
    """
    probs = None if merged.logits is None else mapped_softmax(merged.logits)
    return rows_report(merged, num_labels, label_names, user_metrics, scoring, score_intervals=False,
                       probs=probs), probs


def score_intervals_everywhere(report: dict, labels: Optional[np.ndarray], probs: Optional[np.ndarray],
                               bootstrap) -> Optional[dict]:
    """Every rank, once :func:`main_report`'s report is on every rank: its probability scores' intervals,
    in the phase "the score intervals" (:func:`shared_score_intervals`), when the report has scores and
    intervals; returns what the exact bootstrap cost (None: none computed, or rank 0 drew them alone).
    """
    if not (bootstrap and bootstrap[0] and report.get("confidence_intervals") and "top_k" in report):
        return None
    with ranks.phase("the score intervals"):
        return shared_score_intervals(report, labels, probs, bootstrap)


def shared_score_intervals(report: dict, labels: Optional[np.ndarray], probs: Optional[np.ndarray],
                           bootstrap) -> Optional[dict]:
    """Every rank: the probability scores' intervals of the run's merged rows, their resamples shared
    over the ranks (rank 0 sends ``probs``, the softmax of its merged rows' logits, and ``labels``;
    None elsewhere; each rank computes every N-th chunk of resamples; the values are all-gathered),
    added to ``report``'s ``confidence_intervals`` (the report :func:`row_metrics` gave without them,
    on every rank). The same bits for any N: each resample is computed as one process computes it. A
    set whose rows are drawn grouped (:func:`dist_eval.intervals.grouped_score_intervals`): rank 0
    computes them and sends them. Returns what the exact bootstrap cost
    (:func:`~dist_eval.intervals.exact_score_cost`; None where rank 0 computed them):
    :attr:`dist_eval.loop_facts.LoopFacts.exact_score_intervals`.
    """
    shared = None
    if ranks.is_main_process():
        if grouped_score_intervals(probs, labels):  # drawn grouped: a moment's work, rank 0's alone
            shared = drawn_score_intervals(probs, labels, bootstrap[0], bootstrap[1], top_k=report["top_k"],
                                           bins=CALIBRATION_BINS)  # the rows the report's scores checked
        else:  # exact: every rank holds every row's probabilities (the report says what that costs)
            shared = (probs, labels, exact_score_cost(probs, labels, bootstrap[0]))
    shared, cost = ranks.broadcast_object(shared), None
    if isinstance(shared, dict):
        intervals = shared
    else:
        probs, labels, cost = shared
        part = score_resamples_part(probs, labels, bootstrap[0], bootstrap[1], report["top_k"], CALIBRATION_BINS,
                                    (ranks.get_rank(), ranks.get_world_size()))
        intervals = score_percentiles(join_score_resamples(ranks.all_gather_object(part), bootstrap[0]), bootstrap[1])
    report["confidence_intervals"].update(kept_score_intervals(intervals, report))
    return cost
