"""The no-grad loop over this rank's batches."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Optional, Tuple

import numpy as np
import torch

from dist_eval.metrics import per_sample_cross_entropy

# One batch: (global row indices [B], input_ids [B, T], labels [B])
Batch = Tuple[np.ndarray, torch.Tensor, np.ndarray]


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

    @property
    def num_samples(self) -> int:
        return int(self.indices.shape[0])

    def as_payload(self) -> dict:
        """What crosses the network to rank 0: plain numpy arrays."""
        return {
            "indices": self.indices,
            "labels": self.labels,
            "preds": self.preds,
            "losses": self.losses,
            "logits": self.logits,
            "sample_values": self.sample_values,
        }


def _logits_of(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def predict_shard(
    model: Callable[[torch.Tensor], torch.Tensor],
    batches: Iterable[Batch],
    num_labels: int,
    keep_logits: bool,
    sample_metrics: Optional[Dict[str, Callable]] = None,
) -> ShardResults:
    """Run every batch under ``torch.no_grad()`` and keep per-sample results."""
    indices, labels, preds, losses, logits_kept = [], [], [], [], []
    sample_values: Dict[str, list] = {name: [] for name in (sample_metrics or {})}
    forward_seconds = 0.0
    with torch.no_grad():
        for rows, input_ids, batch_labels in batches:
            start = time.perf_counter()
            logits = _logits_of(model(input_ids)).float().cpu()
            forward_seconds += time.perf_counter() - start
            if logits.shape != (len(rows), num_labels):
                raise RuntimeError(
                    f"the model returned logits of shape {list(logits.shape)} for a batch of {len(rows)}; "
                    f"expected [{len(rows)}, {num_labels}]"
                )
            batch_logits = logits.numpy()
            indices.append(np.asarray(rows, dtype=np.int64))
            labels.append(np.asarray(batch_labels, dtype=np.int64))
            # argmax picks the first maximum on ties, the same on every rank
            preds.append(batch_logits.argmax(axis=1).astype(np.int64))
            losses.append(per_sample_cross_entropy(batch_logits, batch_labels))
            if keep_logits:
                logits_kept.append(batch_logits)
            for name, fn in (sample_metrics or {}).items():
                value = np.asarray(fn(batch_logits, np.asarray(batch_labels)), dtype=np.float64)
                if value.shape != (len(rows),):
                    raise ValueError(f"sample metric {name!r} returned shape {value.shape}, expected ({len(rows)},)")
                sample_values[name].append(value)

    def cat(parts, dtype, shape=(0,)):
        return np.concatenate(parts) if parts else np.zeros(shape, dtype=dtype)

    return ShardResults(
        indices=cat(indices, np.int64),
        labels=cat(labels, np.int64),
        preds=cat(preds, np.int64),
        losses=cat(losses, np.float64),
        logits=cat(logits_kept, np.float32, (0, num_labels)) if keep_logits else None,
        sample_values={name: cat(parts, np.float64) for name, parts in sample_values.items()},
        forward_seconds=forward_seconds,
    )
