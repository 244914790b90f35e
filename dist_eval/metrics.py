"""Classification metrics as pure functions of counts.

No processes, no torch.distributed: the merge step hands these the global,
de-duplicated (labels, preds). Conventions follow scikit-learn with
``labels=range(num_labels)`` and ``zero_division=0``: a class absent from both labels
and predictions keeps its row/column in the confusion matrix and counts as 0 in
macro averages.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import numpy as np

from dist_eval.chunks import chunk_rows

# The headline metrics, in the order every output shows them: the terminal summary,
# report.html's cards, the trackers' scalars and compare's table. "top{k}_accuracy" is
# named by the run's k (metrics["top_k"]): see headline_names().
HEADLINE_METRICS = (
    "accuracy", "f1_macro", "f1_weighted", "precision_macro", "recall_macro", "loss",
    "ece", "brier", "top{k}_accuracy", "auroc_macro",
)
# Those with a bootstrap confidence interval (dist_eval.intervals), in the same order.
INTERVAL_METRICS = ("accuracy", "f1_macro", "loss", "ece", "brier", "top{k}_accuracy", "auroc_macro")
# Equal-width bins of the top-class probability for the ECE and the reliability diagram.
CALIBRATION_BINS = 15


def top_k_name(k: int) -> str:
    """The metrics.json key of the top-k accuracy: ``top2_accuracy``."""
    return f"top{k}_accuracy"


def headline_names(metrics: dict, names: Sequence[str] = HEADLINE_METRICS, within: Optional[dict] = None) -> list:
    """``names`` (HEADLINE_METRICS by default) as keys of this run's ``metrics``: the
    top-k name with the run's k, and only those ``within`` (default: ``metrics``) has: an
    older run, or a run with no top-k accuracy (2 classes), has fewer.
    """
    k = metrics.get("top_k")
    out = [top_k_name(k) if name == "top{k}_accuracy" and k else name for name in names]
    within = metrics if within is None else within
    return [name for name in out if name in within and within[name] is not None]


def confusion_matrix(labels: np.ndarray, preds: np.ndarray, num_labels: int) -> np.ndarray:
    """K x K int64 counts; rows = true label, columns = predicted label."""
    labels = np.asarray(labels, dtype=np.int64)
    preds = np.asarray(preds, dtype=np.int64)
    if labels.shape != preds.shape:
        raise ValueError(f"labels and preds differ in shape: {labels.shape} vs {preds.shape}")
    for name, values in (("labels", labels), ("preds", preds)):
        if values.size and (values.min() < 0 or values.max() >= num_labels):
            raise ValueError(f"{name} must lie in [0, {num_labels}); got [{values.min()}, {values.max()}]")
    flat = np.bincount(labels * num_labels + preds, minlength=num_labels * num_labels)
    return flat.reshape(num_labels, num_labels)


def _safe_div(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    numerator = np.asarray(numerator, dtype=np.float64)
    denominator = np.asarray(denominator, dtype=np.float64)
    out = np.zeros_like(numerator)
    np.divide(numerator, denominator, out=out, where=denominator != 0)
    return out


def metrics_from_confusion(cm: np.ndarray, label_names: Optional[Sequence[str]] = None) -> Dict:
    """accuracy, macro/micro/weighted precision-recall-F1 and per-class values from counts."""
    cm = np.asarray(cm, dtype=np.int64)
    num_labels = cm.shape[0]
    tp = np.diag(cm)
    support = cm.sum(axis=1)  # true count per class
    predicted = cm.sum(axis=0)  # predicted count per class
    total = int(cm.sum())
    fp = predicted - tp
    fn = support - tp
    precision = _safe_div(tp, predicted)
    recall = _safe_div(tp, support)
    f1 = _safe_div(2 * tp, 2 * tp + fp + fn)
    tp_sum = int(tp.sum())
    micro = tp_sum / total if total else 0.0  # single-label: micro P = micro R = micro F1 = accuracy
    names = list(label_names) if label_names is not None else [str(k) for k in range(num_labels)]
    return {
        "accuracy": micro,
        "precision_macro": float(precision.mean()) if num_labels else 0.0,
        "recall_macro": float(recall.mean()) if num_labels else 0.0,
        "f1_macro": float(f1.mean()) if num_labels else 0.0,
        "precision_micro": micro,
        "recall_micro": micro,
        "f1_micro": micro,
        "precision_weighted": float(_safe_div((precision * support).sum(), total)),
        "recall_weighted": float(_safe_div((recall * support).sum(), total)),
        "f1_weighted": float(_safe_div((f1 * support).sum(), total)),
        "per_class": {
            names[k]: {
                "label": k,
                "precision": float(precision[k]),
                "recall": float(recall[k]),
                "f1": float(f1[k]),
                "support": int(support[k]),
            }
            for k in range(num_labels)
        },
        "confusion_matrix": cm.tolist(),
    }


def weighted_sums(weights: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``weights @ values`` (each resample's counts or weights of the rows or clusters, times
    their values, summed) in the same bits for any number of BLAS threads: numpy's own loop
    (einsum, not optimized), not BLAS, whose threads split a long product in another order, so
    that rank 0 of torchrun's N>1 (one thread each) would differ in the last bits from N=1.
    Sums of integers (counts of hits, classes) are exact either way and may use ``@``.
    """
    return np.einsum("ij,j...->i...", weights, values)


def binned_sums(weights: np.ndarray, values: np.ndarray, bin_of: np.ndarray, bins: int) -> np.ndarray:
    """Each resample's weighted sum of ``values`` in each of ``bins`` bins (``bin_of``: each row's
    bin), ``[resamples, bins]``: :func:`weighted_sums` of a one-hot of the bins without the one-hot,
    a bincount per resample (its sums in row order: the same bits for any number of threads).
    """
    out = np.empty((weights.shape[0], bins))
    for i, row in enumerate(weights):
        out[i] = np.bincount(bin_of, weights=row * values, minlength=bins)
    return out


def per_sample_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Cross-entropy of each row in float64 (log-sum-exp computed stably)."""
    logits = np.asarray(logits, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    if logits.shape[0] == 0:
        return np.zeros(0, dtype=np.float64)
    shift = logits.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(logits - shift).sum(axis=1)) + shift[:, 0]
    return log_norm - logits[np.arange(len(labels)), labels]


def mean_of(values: np.ndarray) -> float:
    """Exactly rounded mean (math.fsum): independent of summation order, so of N."""
    values = np.asarray(values, dtype=np.float64)
    # map(float, ...) rather than tolist(): no list of a million Python floats on rank 0
    return math.fsum(map(float, values)) / len(values) if len(values) else float("nan")


# --- scores of probabilities: calibration and ranking ------------------------------------
# Pure numpy, float64, no scikit-learn import (tests compare against scikit-learn).


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64, computed stably (the row maximum subtracted first)."""
    logits = np.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"logits must be 2-D (rows x classes); got shape {logits.shape}")
    if logits.shape[0] == 0:
        return np.zeros(logits.shape, dtype=np.float64)
    # one float64 copy, each step in place (the same operations, so the same bits): rank 0 holds
    # one rows x classes array here, not four (issue 51)
    probs = np.array(logits, dtype=np.float64)
    probs -= probs.max(axis=1, keepdims=True)
    np.exp(probs, out=probs)
    probs /= probs.sum(axis=1, keepdims=True)
    return probs


def _scores_and_labels(scores, labels, what: str = "probs"):
    """Validated float64 (n, K) scores and int64 (n,) labels in [0, K)."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    if scores.ndim != 2:
        raise ValueError(f"{what} must be 2-D (rows x classes); got shape {scores.shape}")
    if labels.shape != (scores.shape[0],):
        raise ValueError(f"labels must have shape ({scores.shape[0]},); got {labels.shape}")
    num_labels = scores.shape[1]
    if labels.size and (labels.min() < 0 or labels.max() >= num_labels):
        raise ValueError(f"labels must lie in [0, {num_labels}); got [{labels.min()}, {labels.max()}]")
    return scores, labels


def calibration_bins(confidence: np.ndarray, bins: int = 15) -> np.ndarray:
    """Bin index in [0, bins) of each top-class probability.

    Edges are ``np.linspace(0, 1, bins + 1)``; bin m holds ``(e_m, e_{m+1}]`` (right-closed,
    as in Guo et al. 2017 and torchmetrics), and bin 0 also holds a confidence of exactly 0.
    """
    if not isinstance(bins, (int, np.integer)) or bins < 1:
        raise ValueError(f"bins must be an integer >= 1; got {bins!r}")
    inner_edges = np.linspace(0.0, 1.0, bins + 1)[1:-1]
    return np.searchsorted(inner_edges, np.asarray(confidence, dtype=np.float64), side="left")


def reliability_table(probs: np.ndarray, labels: np.ndarray, bins: int = 15) -> dict[str, np.ndarray]:
    """Per-bin ``count``, ``confidence`` (mean top-class probability) and ``accuracy``
    (fraction whose top class, the first maximum, is the label); 0 in empty bins.
    Bins as :func:`calibration_bins`; ``edges`` has ``bins + 1`` values.
    """
    probs, labels = _scores_and_labels(probs, labels)
    confidence = probs.max(axis=1) if probs.shape[0] else np.zeros(0)
    correct = (probs.argmax(axis=1) == labels) if probs.shape[0] else np.zeros(0, dtype=bool)
    which = calibration_bins(confidence, bins)
    count = np.bincount(which, minlength=bins)
    sum_confidence = np.bincount(which, weights=confidence, minlength=bins)
    sum_correct = np.bincount(which, weights=correct.astype(np.float64), minlength=bins)
    return {
        "edges": np.linspace(0.0, 1.0, bins + 1),
        "count": count,
        "confidence": _safe_div(sum_confidence, count),
        "accuracy": _safe_div(sum_correct, count),
    }


def expected_calibration_error(probs: np.ndarray, labels: np.ndarray, bins: int = 15) -> float:
    """ECE: ``sum_m (n_m / n) |accuracy_m - confidence_m|`` over ``bins`` equal-width bins of
    the top-class probability (edges and right-closed bins as :func:`calibration_bins`);
    the prediction is the first maximum of the row. Sums exactly rounded: the same for any
    order of the rows. NaN when there are no rows.
    """
    probs, labels = _scores_and_labels(probs, labels)
    n = probs.shape[0]
    if n == 0:
        return float("nan")
    confidence = probs.max(axis=1)
    gap = confidence - (probs.argmax(axis=1) == labels)
    which = calibration_bins(confidence, bins)
    # exactly rounded sums (math.fsum): independent of the order of the rows, so of N
    per_bin = [math.fsum(map(float, gap[which == m])) for m in np.unique(which)]
    return math.fsum(abs(v) for v in per_bin) / n


def brier_score(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean over rows of ``sum_k (p_k - y_k)^2`` with y one-hot (range [0, 2]; for two
    classes twice scikit-learn's ``brier_score_loss`` of the positive class). NaN when empty.
    """
    probs, labels = _scores_and_labels(probs, labels)
    if probs.shape[0] == 0:
        return float("nan")
    return mean_of(per_sample_brier(probs, labels))


def per_sample_brier(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """``sum_k (p_k - y_k)^2`` of each row, float64; ``chunk_rows("metrics")`` rows at a time (issue 51: the
    temporaries of a chunk, not of the set; a row's bits do not depend on the rows beside it).
    """
    probs, labels = _scores_and_labels(probs, labels)
    out, chunk = np.empty(probs.shape[0]), chunk_rows("metrics")
    for start in range(0, probs.shape[0], chunk):
        diff = probs[start:start + chunk].copy()
        diff[np.arange(diff.shape[0]), labels[start:start + chunk]] -= 1.0
        out[start:start + chunk] = (diff * diff).sum(axis=1)
    return out


def top_k_hits(scores: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """Whether each row's label is among its k highest scores (probabilities or logits: any
    order-preserving scores). Ties as scikit-learn's ``top_k_accuracy_score``: with more than
    two classes the higher class index ranks first among equal scores (so top-1 can differ
    from the argmax accuracy on exactly tied rows); with two classes class 1 ranks first only
    when its score is strictly higher (scikit-learn's binary rule ``p_1 > 0.5``, and argmax).
    """
    scores, labels = _scores_and_labels(scores, labels, "scores")
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an integer >= 1; got {k!r}")
    hits, chunk = np.empty(scores.shape[0], dtype=bool), chunk_rows("metrics")  # as per_sample_brier
    for start in range(0, scores.shape[0], chunk):
        part, part_labels = scores[start:start + chunk], labels[start:start + chunk]
        own = part[np.arange(part.shape[0]), part_labels][:, None]
        if scores.shape[1] == 2:
            higher_index = np.arange(2)[None, :] < part_labels[:, None]  # ties rank class 0 first
        else:
            higher_index = np.arange(scores.shape[1])[None, :] > part_labels[:, None]
        rank = (part > own).sum(axis=1) + ((part == own) & higher_index).sum(axis=1)
        hits[start:start + chunk] = rank < k
    return hits


def top_k_accuracy(scores: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Fraction of rows whose label is among the k highest scores (see :func:`top_k_hits`);
    1.0 when k >= the number of classes; NaN when there are no rows.
    """
    hits = top_k_hits(scores, labels, k)
    return float(hits.mean()) if hits.size else float("nan")


def binary_auroc(scores: np.ndarray, positive: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` for the boolean ``positive``: the
    Mann-Whitney statistic from average ranks (tied scores count 1/2, as scikit-learn's
    trapezoidal ROC). NaN when only one class is present.
    """
    scores = np.asarray(scores, dtype=np.float64)
    positive = np.asarray(positive, dtype=bool)
    num_pos = int(positive.sum())
    num_neg = positive.size - num_pos
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ordered = scores[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])  # the runs of tied scores
    del ordered
    positives_in_run = np.add.reduceat(positive[order].astype(np.int64), starts)
    del order
    # 1-based ranks, ties sharing their mean (start + end + 1) / 2: the positives' rank sum is half
    # an exact integer, divided once (correctly rounded, as math.fsum of the halves would round it)
    # (every integer below 2**63 for sets of fewer than 2**31 rows)
    twice = positives_in_run * (starts + 1)
    twice[:-1] += positives_in_run[:-1] * starts[1:]
    twice[-1] += positives_in_run[-1] * scores.size
    rank_sum = int(twice.sum(dtype=np.int64)) / 2
    return (rank_sum - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg)


def auroc_macro(probs: np.ndarray, labels: np.ndarray) -> float:
    """Macro one-vs-rest AUROC over the classes present in the labels; for two classes the
    AUROC of class 1 (scored by its probability). Ties count 1/2 (ranks), as scikit-learn.
    NaN when fewer than two classes are present.
    """
    probs, labels = _scores_and_labels(probs, labels)
    if probs.shape[1] == 2:
        return binary_auroc(probs[:, 1], labels == 1)
    present = np.unique(labels)
    if present.size < 2:
        return float("nan")
    return float(np.mean([binary_auroc(probs[:, c], labels == c) for c in present]))


def paired_rows(labels, preds_a, preds_b, losses_a, losses_b) -> tuple:
    """Two runs' rows, row i of A and row i of B the same input: (labels, preds_a, preds_b) as int64 and
    (losses_a, losses_b) as float64, refused unless 1-D of one length.
    """
    labels = np.asarray(labels, dtype=np.int64)
    preds_a = np.asarray(preds_a, dtype=np.int64)
    preds_b = np.asarray(preds_b, dtype=np.int64)
    losses_a = np.asarray(losses_a, dtype=np.float64)
    losses_b = np.asarray(losses_b, dtype=np.float64)
    if not labels.shape == preds_a.shape == preds_b.shape == losses_a.shape == losses_b.shape or labels.ndim != 1:
        raise ValueError("labels, preds and losses of A and B must be 1-D of one length; got "
                         f"{[x.shape for x in (labels, preds_a, preds_b, losses_a, losses_b)]}")
    return labels, preds_a, preds_b, losses_a, losses_b


def paired_differences(labels, preds_a, preds_b, losses_a, losses_b, num_labels: int) -> dict:
    """B - A in accuracy, macro-F1 (over all ``num_labels`` classes) and mean loss of two runs on the
    same rows (:func:`paired_rows`' arrays): the point of every paired interval, clustered or not.
    """
    metric_a = metrics_from_confusion(confusion_matrix(labels, preds_a, num_labels))
    metric_b = metrics_from_confusion(confusion_matrix(labels, preds_b, num_labels))
    return {"accuracy": metric_b["accuracy"] - metric_a["accuracy"],
            "f1_macro": metric_b["f1_macro"] - metric_a["f1_macro"],
            "loss": mean_of(losses_b) - mean_of(losses_a)}


def default_top_k(num_labels: int) -> int | None:
    """The k of ``top{k}_accuracy`` when none is asked for: 2 with more than two classes,
    else None (no top-k metric: with two classes top-2 is always 1).
    """
    return 2 if num_labels > 2 else None


def score_metrics(probs: np.ndarray, labels: np.ndarray, top_k: int | None = None, bins: int = 15) -> dict:
    """``{"ece", "brier", "top{k}_accuracy", "auroc_macro"}`` of probabilities (rows sum to
    1; :func:`softmax` of logits). ``top_k`` None: :func:`default_top_k`, and no top-k key
    when that is None. The keys :func:`dist_eval.intervals.bootstrap_score_intervals` uses.
    """
    probs, labels = _scores_and_labels(probs, labels)
    out = {"ece": expected_calibration_error(probs, labels, bins), "brier": brier_score(probs, labels)}
    k = default_top_k(probs.shape[1]) if top_k is None else top_k
    if k is not None:
        out[top_k_name(k)] = top_k_accuracy(probs, labels, k)
    out["auroc_macro"] = auroc_macro(probs, labels)
    return out
