"""Merge the gathered per-rank results on rank 0: order by index, drop duplicates,
check that every row of the split was evaluated exactly once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from dist_eval.predict import SAMPLE_VALUE_PREFIX


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


def _concat(payloads: List[dict], key: str) -> Optional[np.ndarray]:
    """One field of every payload, concatenated; the payloads let go of it (memory)."""
    parts = [p.pop(key, None) for p in payloads]
    if any(part is None for part in parts) or not parts:
        return None
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def merge_gathered(payloads: List[dict], num_rows: int) -> MergedResults:
    """Concatenate the ranks' payloads (:meth:`ShardResults.as_payload`; already
    concatenated by the gather, in which case there is one), keep the first result of each row index, and
    require exactly the rows 0..num_rows-1.

    The payloads are consumed field by field (each field is released once it has been
    merged), so rank 0 holds about one copy of the gathered per-sample arrays, not two.

    Duplicates arise when a user DataLoader's DistributedSampler pads its last round;
    a duplicate must agree with the kept copy on the label (same row), or the data is
    inconsistent and we refuse to count it.
    """
    names = [k for k in payloads[0] if k.startswith(SAMPLE_VALUE_PREFIX)] if payloads else []
    indices = _concat(payloads, "indices") if payloads else np.zeros(0, np.int64)
    order = np.argsort(indices, kind="stable")
    sorted_indices = indices[order]
    del indices
    keep = np.ones(len(sorted_indices), dtype=bool)
    keep[1:] = sorted_indices[1:] != sorted_indices[:-1]
    num_duplicates = int((~keep).sum())
    unique_indices = sorted_indices[keep]
    del sorted_indices
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
    labels_sorted = _concat(payloads, "labels")[order] if payloads else np.zeros(0, np.int64)
    if num_duplicates:
        first_of_run = np.maximum.accumulate(np.where(keep, np.arange(len(keep)), 0))
        if np.any(labels_sorted != labels_sorted[first_of_run]):
            raise CoverageError("the same row index arrived twice with different labels; the batches are inconsistent")
    labels = labels_sorted[keep] if num_duplicates else labels_sorted
    del labels_sorted
    selection = order[keep] if num_duplicates else order
    del order

    def pick(key: str) -> Optional[np.ndarray]:
        merged = _concat(payloads, key) if payloads else np.zeros(0, np.float64)
        return None if merged is None else merged[selection]

    preds = pick("preds")
    losses = pick("losses")
    logits = pick("logits")
    sample_values = {key[len(SAMPLE_VALUE_PREFIX):]: pick(key) for key in names}
    return MergedResults(
        indices=unique_indices, labels=labels, preds=preds if preds is not None else np.zeros(0, np.int64),
        losses=losses if losses is not None else np.zeros(0, np.float64), logits=logits,
        sample_values=sample_values, num_duplicates_dropped=num_duplicates,
    )
