"""Reading: a finished run's output folder (metrics.json, predictions.jsonl) as :class:`RunOutputs`, checked."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from dist_eval.errors import UsageError


@dataclass
class RunOutputs:
    """What compare needs from one output folder."""

    folder: str
    metrics: dict
    indices: np.ndarray
    labels: np.ndarray
    preds: np.ndarray
    losses: Optional[np.ndarray] = None  # each row's loss (runs before issue 14 have none)
    slices: Optional[list] = None  # each row's {column: value} (runs with --slice-by)
    clusters: Optional[list] = None  # each row's cluster (runs with --cluster-by)
    keys: Optional[list] = None  # each row's content key (runs since issue 52): how two runs' rows are paired

    def subset(self, rows: np.ndarray) -> RunOutputs:
        """These outputs of ``rows`` only (positions in this run), in their order."""
        pick = rows.tolist()

        def each(values):
            return None if values is None else [values[i] for i in pick]

        return RunOutputs(self.folder, self.metrics, self.indices[rows], self.labels[rows], self.preds[rows],
                          None if self.losses is None else self.losses[rows], each(self.slices), each(self.clusters),
                          each(self.keys))


def load_run(folder: str) -> RunOutputs:
    """metrics.json and predictions.jsonl of a finished run, checked for consistency."""
    if not os.path.isdir(folder):
        raise UsageError(f"{folder}: no such folder. Pass the --output-dir of a finished dist_eval run.")
    paths = {name: os.path.join(folder, name) for name in ("metrics.json", "predictions.jsonl")}
    missing = [name for name, path in paths.items() if not os.path.isfile(path)]
    if missing:
        raise UsageError(
            f"{folder}: missing {' and '.join(missing)} (not a finished dist_eval run). "
            "Pass the --output-dir of a finished run."
        )
    try:
        with open(paths["metrics.json"]) as f:
            metrics = json.load(f)
        with open(paths["predictions.jsonl"]) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        indices = np.array([r["index"] for r in rows], dtype=np.int64)
        labels = np.array([r["label"] for r in rows], dtype=np.int64)
        preds = np.array([r["pred"] for r in rows], dtype=np.int64)
        losses = np.array([r["loss"] for r in rows], dtype=np.float64) if all("loss" in r for r in rows) else None
        slices = [r["slice"] for r in rows] if rows and all("slice" in r for r in rows) else None
        clusters = [r["cluster"] for r in rows] if rows and all("cluster" in r for r in rows) else None
        keys = [r["key"] for r in rows] if rows and all("key" in r for r in rows) else None
        num_samples = int(metrics["num_samples"])
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(
            f"{folder}: metrics.json or predictions.jsonl is not a dist_eval output ({type(e).__name__}: {e})."
        ) from e
    # a run that stopped early holds the rows it used: their places in the set, not 0..n-1
    if len(rows) != num_samples or np.unique(indices).size != indices.size:
        raise UsageError(
            f"{folder}: predictions.jsonl has {len(rows)} rows but metrics.json counts {num_samples} samples "
            "(a partial or edited output). Re-run the evaluation."
        )
    return RunOutputs(folder, metrics, indices, labels, preds, losses, slices, clusters, keys)
