"""Merge the gathered per-rank results on rank 0: order by index, drop duplicates,
check that every row of the split was evaluated exactly once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np


class CoverageError(RuntimeError):
    """Some rows were never evaluated, or an index lies outside the split."""


@dataclass
class MergedResults:
    """The global, de-duplicated per-sample results, ordered by row index (``global_`` side)."""

    indices: np.ndarray
    labels: np.ndarray
    preds: np.ndarray
    losses: np.ndarray
    logits: Optional[np.ndarray] = None
    sample_values: Dict[str, np.ndarray] = field(default_factory=dict)
    num_duplicates_dropped: int = 0

    @property
    def num_samples(self) -> int:
        return int(self.indices.shape[0])


def merge_gathered(payloads: List[dict], num_rows: int) -> MergedResults:
    """Concatenate the ranks' payloads, keep the first result of each row index, and
    require exactly the rows 0..num_rows-1.

    Duplicates arise when a user DataLoader's DistributedSampler pads its last round;
    a duplicate must agree with the kept copy on the label (same row), or the data is
    inconsistent and we refuse to count it.
    """
    indices = np.concatenate([p["indices"] for p in payloads]) if payloads else np.zeros(0, np.int64)
    order = np.argsort(indices, kind="stable")
    sorted_indices = indices[order]
    keep = np.ones(len(sorted_indices), dtype=bool)
    keep[1:] = sorted_indices[1:] != sorted_indices[:-1]
    num_duplicates = int((~keep).sum())

    def take(key: str):
        parts = [p[key] for p in payloads]
        if any(part is None for part in parts):
            return None
        return np.concatenate(parts)[order]

    labels_sorted = take("labels")
    if num_duplicates:
        first_of_run = np.maximum.accumulate(np.where(keep, np.arange(len(keep)), 0))
        if np.any(labels_sorted != labels_sorted[first_of_run]):
            raise CoverageError("the same row index arrived twice with different labels; the batches are inconsistent")
    selection = order[keep]
    unique_indices = indices[selection]
    if len(unique_indices) != num_rows or (num_rows and (unique_indices[0] != 0 or unique_indices[-1] != num_rows - 1)):
        present = np.zeros(num_rows, dtype=bool)
        inside = unique_indices[(unique_indices >= 0) & (unique_indices < num_rows)]
        present[inside] = True
        missing = np.flatnonzero(~present)
        outside = unique_indices[(unique_indices < 0) | (unique_indices >= num_rows)]
        raise CoverageError(
            f"evaluated {len(unique_indices)} distinct rows, expected {num_rows}: "
            f"{len(missing)} missing (first {missing[:5].tolist()}), {len(outside)} outside the split "
            f"(first {outside[:5].tolist()}). A DataLoader with drop_last=True, or a sampler that skips rows, causes this."
        )

    def pick(key: str):
        parts = [p[key] for p in payloads]
        if any(part is None for part in parts):
            return None
        return np.concatenate(parts)[selection]

    names = payloads[0]["sample_values"].keys() if payloads else []
    return MergedResults(
        indices=unique_indices,
        labels=pick("labels"),
        preds=pick("preds"),
        losses=pick("losses"),
        logits=pick("logits"),
        sample_values={n: np.concatenate([p["sample_values"][n] for p in payloads])[selection] for n in names},
        num_duplicates_dropped=num_duplicates,
    )
