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

# The headline metrics, in the order every output shows them: the terminal summary,
# report.html's cards, the trackers' scalars and compare's table.
HEADLINE_METRICS = ("accuracy", "f1_macro", "f1_weighted", "precision_macro", "recall_macro", "loss")
# Those with a bootstrap confidence interval (dist_eval.intervals), in the same order.
INTERVAL_METRICS = ("accuracy", "f1_macro", "loss")


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
