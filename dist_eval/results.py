"""The per-row results' types: one rank's, as the forward loop makes them and the merge takes them
(:class:`ShardResults`); the whole set's, as the merge gives them to rank 0 (:class:`MergedResults`); the
names they cross the network under, where a batch's logits came from when no forward ran, and
:func:`mapped_array`, the arrays on the local disk that hold rows beyond the heap (issue 51). Definitions
only: the loop (:mod:`dist_eval.predict`), the known logits (:mod:`dist_eval.known`), the merge, the
report and the row store share them from here.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np

# a user's per-sample metric crosses the network as SAMPLE_VALUE_PREFIX + its name
SAMPLE_VALUE_PREFIX = "sample_values/"
# where a batch's logits came from when no forward ran (dist_eval.known)
FROM_RESUME, FROM_STORE = "resume", "store"


@dataclass
class ShardResults:
    """Per-sample results of one rank, in the order its batches ran (``local_`` side)."""

    indices: np.ndarray  # int64 global row index
    labels: np.ndarray  # int64
    preds: np.ndarray  # int64
    losses: np.ndarray  # float64 cross-entropy per sample
    logits: Optional[np.ndarray] = None  # float32 [n, K], when kept
    sample_values: Dict[str, np.ndarray] = field(default_factory=dict)  # user per-sample metrics
    forward_seconds: float = 0.0
    max_batch_seconds: float = 0.0  # the slowest single forward
    num_resumed: int = 0  # samples whose logits came from stored partial results
    loop_cpu_seconds: float = 0.0  # CPU time of this rank's process during the evaluation loop

    @property
    def num_samples(self) -> int:
        return int(self.indices.shape[0])

    def as_payload(self) -> dict:
        """What crosses the network to rank 0: flat numpy arrays by name, the same names on every rank."""
        payload = {"indices": self.indices, "labels": self.labels, "preds": self.preds, "losses": self.losses}
        if self.logits is not None:
            payload["logits"] = self.logits
        for name, values in self.sample_values.items():
            payload[SAMPLE_VALUE_PREFIX + name] = values
        return payload


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


def mapped_array(shape: tuple, dtype) -> np.ndarray:
    """A zeroed array mapped from a temporary file of the local disk ($TMPDIR), unlinked as it is
    made (the kernel frees it when the process ends, however it ends): the page cache's, not the
    heap's, written back to disk under memory pressure.
    """
    size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if size == 0:
        return np.zeros(shape, dtype=dtype)
    with tempfile.TemporaryFile(prefix="dist_eval-merged-") as f:
        f.truncate(size)
        return np.asarray(np.memmap(f, dtype=dtype, mode="r+", shape=shape))  # the map keeps its own handle
