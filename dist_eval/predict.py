"""The no-grad loop over this rank's batches."""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Iterable, Iterator, Optional, Tuple

import numpy as np
import torch

from dist_eval.metrics import per_sample_cross_entropy

# One batch: (batch id in the global plan, global row indices [B], input_ids [B, T] or
# None when its logits are already stored (a resumed run), labels [B])
Batch = Tuple[int, np.ndarray, Optional[torch.Tensor], np.ndarray]


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
        """What crosses the network to rank 0: flat numpy arrays by name (the same
        names on every rank: see :func:`payload_fields`).
        """
        payload = {"indices": self.indices, "labels": self.labels, "preds": self.preds, "losses": self.losses}
        if self.logits is not None:
            payload["logits"] = self.logits
        for name, values in self.sample_values.items():
            payload[SAMPLE_VALUE_PREFIX + name] = values
        return payload


SAMPLE_VALUE_PREFIX = "sample_values/"


def _logits_of(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


# Batches in flight per rank. Measured (benchmarks/RESULTS.md): with a Petals swarm two
# batches in flight overlap one batch's RPC wait with the next one's client work.
DEFAULT_IN_FLIGHT = 2


def _timed_forward(model: Callable, input_ids: torch.Tensor) -> Tuple[torch.Tensor, float]:
    # no_grad is thread-local: it must be entered in the thread that runs the forward
    with torch.no_grad():
        start = time.perf_counter()
        logits = _logits_of(model(input_ids)).float().cpu()
        return logits, time.perf_counter() - start


class _Ready:
    """A finished 'future' for a batch whose logits are known without a forward: stored by an
    interrupted run, or every row of it in the row store.
    """

    def __init__(self, logits: np.ndarray):
        self.value = (torch.from_numpy(np.ascontiguousarray(logits)), None)

    def result(self):
        return self.value


def _known_rows(rows: np.ndarray, known: Dict[int, np.ndarray]) -> Optional[np.ndarray]:
    """Which rows of a batch the row store holds (a bool mask), or None when it holds none."""
    if not known:
        return None
    hits = np.fromiter((int(r) in known for r in rows), dtype=bool, count=len(rows))
    return hits if hits.any() else None


def _start(model: Callable, batch: Batch, stored: Dict[int, np.ndarray], known: Dict[int, np.ndarray], submit):
    """A future of (logits, seconds or None) for one batch; ``submit(fn, *args)`` runs a forward.
    A batch of rows the row store holds (rank 0's, outside the plan: the plan leaves them out)
    runs none.
    """
    batch_id, rows = batch[0], batch[1]
    if batch_id in stored:
        return _Ready(stored[batch_id])
    hits = _known_rows(rows, known)
    if hits is not None and hits.all():
        return _Ready(np.stack([known[int(r)] for r in rows]))
    return submit(_timed_forward, model, batch[2])


class _Now:
    """A 'future' run at once (one batch in flight)."""

    def __init__(self, fn, *args):
        self.value = fn(*args)

    def result(self):
        return self.value


def _forwards_in_order(
    model: Callable, batches: Iterable[Batch], in_flight: int, stored: Dict[int, np.ndarray],
    known: Optional[Dict[int, np.ndarray]] = None,
) -> Iterator[Tuple[Batch, torch.Tensor, Optional[float]]]:
    """(batch, logits, seconds) for every batch, in the order the batches came; seconds
    is None for a batch whose logits were all known (no forward ran). ``known``: {row:
    logits} of rows the row store holds (not evaluated again).

    With ``in_flight`` > 1 up to that many forwards run at once in worker threads (the
    petals client spends most of a forward waiting on the network); results are still
    yielded in batch order, so what follows is identical to a sequential run.
    """
    known = known or {}
    if in_flight <= 1:
        for batch in batches:
            yield (batch, *_start(model, batch, stored, known, _Now).result())
        return
    pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="dist_eval-forward")
    pending: Deque = deque()
    try:
        for batch in batches:
            pending.append((batch, _start(model, batch, stored, known, pool.submit)))
            if len(pending) >= in_flight:
                batch_done, future = pending.popleft()
                yield (batch_done, *future.result())
        while pending:
            batch_done, future = pending.popleft()
            yield (batch_done, *future.result())
    finally:
        # on an error, do not start queued forwards; running ones end within the client's timeouts
        pool.shutdown(wait=True, cancel_futures=True)


def _to_row_store(rows_source, rows: np.ndarray, logits: np.ndarray, seconds: Optional[float]) -> None:
    """A batch not resumed: served by the store (no forward: counted), or evaluated (to store)."""
    if rows_source is None:
        return
    if seconds is None:
        rows_source.served(rows)
    else:
        rows_source.add(rows, logits)


def predict_shard(
    model: Callable[[torch.Tensor], torch.Tensor],
    batches: Iterable[Batch],
    num_labels: int,
    keep_logits: bool,
    sample_metrics: Optional[Dict[str, Callable]] = None,
    on_batch_done: Optional[Callable[[int], None]] = None,
    in_flight: int = 1,
    stored: Optional[Dict[int, np.ndarray]] = None,
    on_batch_logits: Optional[Callable[[int, np.ndarray, np.ndarray], None]] = None,
    rows_source=None,
) -> ShardResults:
    """Run every batch under ``torch.no_grad()`` and keep per-sample results.

    ``in_flight``: batches run at once (results identical for any value).
    ``stored``: {batch id: logits} from an interrupted run; those batches are not run.
    ``on_batch_logits(batch_id, rows, logits)`` is called for each newly computed batch
    (to store partial results); ``on_batch_done(num_rows)`` after every batch (progress).
    ``rows_source`` (a :class:`dist_eval.rowstore.RowSource`): a batch of rows the row store
    holds is not evaluated; the rows evaluated go to it.
    """
    stored, known = stored or {}, (rows_source.logits if rows_source is not None else {})
    indices, labels, preds, losses, logits_kept = [], [], [], [], []
    sample_values: Dict[str, list] = {name: [] for name in (sample_metrics or {})}
    forward_seconds, max_batch_seconds, num_resumed = 0.0, 0.0, 0
    for (batch_id, rows, _, batch_labels), logits, seconds in _forwards_in_order(model, batches, in_flight, stored,
                                                                                  known):
        num_resumed += len(rows) if batch_id in stored else 0
        if seconds is not None:
            forward_seconds += seconds
            max_batch_seconds = max(max_batch_seconds, seconds)
        if logits.shape != (len(rows), num_labels):
            raise RuntimeError(f"the model returned logits of shape {list(logits.shape)} for a batch of "
                               f"{len(rows)}; expected [{len(rows)}, {num_labels}]")
        batch_logits = logits.numpy()
        if batch_id not in stored:
            _to_row_store(rows_source, np.asarray(rows, dtype=np.int64), batch_logits, seconds)
        if seconds is not None and on_batch_logits is not None:
            on_batch_logits(batch_id, np.asarray(rows, dtype=np.int64), batch_logits)
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
        if on_batch_done is not None:
            on_batch_done(len(rows))

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
        max_batch_seconds=max_batch_seconds,
        num_resumed=num_resumed,
    )
