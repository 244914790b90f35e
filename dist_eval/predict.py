"""The no-grad loop over this rank's batches."""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Iterable, Iterator, Optional, Tuple

import numpy as np
import torch

from dist_eval.backends import audit
from dist_eval.backends.audit import NonFiniteAnswer
from dist_eval.data.batches import Batch
from dist_eval.metrics import per_sample_cross_entropy


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


class NonFiniteLogits(RuntimeError):
    """A forward returned NaN or inf logits: they never become predictions, losses or stored rows."""

    def __init__(self, batch_id: int, rows: np.ndarray, logits: np.ndarray):
        bad = rows[~np.isfinite(logits).all(axis=1)]
        shown = ", ".join(str(int(r)) for r in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        super().__init__(
            f"the model returned NaN or inf logits for {len(bad)} row(s) of batch {batch_id} (rows {shown}); "
            "none of them is counted or stored. A model or swarm server in float16 can overflow: serve the blocks "
            "in bfloat16 or float32 (python -m dist_eval.swarm --torch-dtype), or find the server at fault "
            "(python -m dist_eval.swarm status).")
        self.rows = bad


def _logits_of(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


# Batches in flight per rank. Measured (benchmarks/RESULTS.md): with a Petals swarm two
# batches in flight overlap one batch's RPC wait with the next one's client work.
DEFAULT_IN_FLIGHT = 2


def _timed_forward(model: Callable, input_ids: torch.Tensor, batch: Optional[Batch] = None) -> tuple:
    """(logits, seconds, None, the audited servers whose answers they come from or None: audit.Taken)."""
    # no_grad is thread-local: it must be entered in the thread that runs the forward
    with torch.no_grad():
        start = time.perf_counter()
        audit.begin_forward()
        try:
            logits = _logits_of(model(input_ids)).float().cpu()
        except NonFiniteAnswer as error:  # a swarm's, on every route: named by the batch's rows
            raise (error if batch is None else error.in_batch(batch[0], batch[1])) from None
        finally:
            taken = audit.end_forward()
        return logits, time.perf_counter() - start, None, taken


class _Ready:
    """A finished 'future' for a batch whose logits are known without a forward (``source``: where
    they came from, :mod:`dist_eval.known`).
    """

    def __init__(self, logits: np.ndarray, source: str):
        self.value = (torch.from_numpy(np.ascontiguousarray(logits)), None, source, None)

    def result(self):
        return self.value


def _start(model: Callable, batch: Batch, known, submit):
    """A future of (logits, seconds or None, where known logits came from or None, audit.Taken or None) for one batch;
    ``submit(fn, *args)`` runs a forward. A batch whose logits ``known`` holds runs none.
    """
    hit = known.of(batch[0], batch[1]) if known is not None else None
    if hit is not None:
        return _Ready(*hit)
    return submit(_timed_forward, model, batch[2], batch)


class _Now:
    """A 'future' run at once (one batch in flight)."""

    def __init__(self, fn, *args):
        self.value = fn(*args)

    def result(self):
        return self.value


def _forwards_in_order(
    model: Callable, batches: Iterable[Batch], in_flight: int, known=None,
) -> Iterator[Tuple[Batch, torch.Tensor, Optional[float], Optional[str], Optional[audit.Taken]]]:
    """(batch, logits, seconds, source, taken) for every batch, in the order the batches came; seconds
    is None and source says where the logits came from for a batch whose logits ``known`` (a
    :class:`dist_eval.known.KnownLogits`) holds (no forward ran); taken: the audited swarm servers
    whose answers the logits come from (:class:`dist_eval.backends.audit.Redo`), else None.

    With ``in_flight`` > 1 up to that many forwards run at once in worker threads (the
    petals client spends most of a forward waiting on the network); results are still
    yielded in batch order, so what follows is identical to a sequential run.
    """
    if in_flight <= 1:
        for batch in batches:
            yield (batch, *_start(model, batch, known, _Now).result())
        return
    pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="dist_eval-forward")
    pending: Deque = deque()
    try:
        for batch in batches:
            pending.append((batch, _start(model, batch, known, pool.submit)))
            if len(pending) >= in_flight:
                batch_done, future = pending.popleft()
                yield (batch_done, *future.result())
        while pending:
            batch_done, future = pending.popleft()
            yield (batch_done, *future.result())
    finally:
        # on an error, do not start queued forwards; running ones end within the client's timeouts
        pool.shutdown(wait=True, cancel_futures=True)


def _checked(logits: torch.Tensor, batch_id: int, rows: np.ndarray, num_labels: int) -> np.ndarray:
    if logits.shape != (len(rows), num_labels):
        raise RuntimeError(f"the model returned logits of shape {list(logits.shape)} for a batch of "
                           f"{len(rows)}; expected [{len(rows)}, {num_labels}]")
    batch_logits = logits.numpy()
    if not np.isfinite(batch_logits).all():
        raise NonFiniteLogits(batch_id, rows, batch_logits)
    return batch_logits


def _sample_value(name: str, fn: Callable, batch_logits: np.ndarray, batch_labels) -> np.ndarray:
    value = np.asarray(fn(batch_logits, np.asarray(batch_labels)), dtype=np.float64)
    if value.shape != (len(batch_logits),):
        raise ValueError(f"sample metric {name!r} returned shape {value.shape}, expected ({len(batch_logits)},)")
    return value


def _evaluate_again(model: Callable, redo: audit.Redo, put: Callable) -> None:
    """The batches of a swarm server blamed since, evaluated again on the others, their results put in place."""
    for position, again in redo.due():
        logits, _, _, taken = _timed_forward(model, again[2], again)
        redo.redone(position, again, taken, len(again[1]))
        put(position, again, logits, None, taken)


def predict_shard(
    model: Callable[[torch.Tensor], torch.Tensor],
    batches: Iterable[Batch],
    num_labels: int,
    keep_logits: bool,
    sample_metrics: Optional[Dict[str, Callable]] = None,
    on_batch_done: Optional[Callable[[int], None]] = None,
    in_flight: int = 1,
    known=None,
) -> ShardResults:
    """Run every batch under ``torch.no_grad()`` and keep per-sample results.

    ``in_flight``: batches run at once (results identical for any value).
    ``known`` (a :class:`dist_eval.known.KnownLogits`): a batch whose logits it holds (an
    interrupted run's, the row store's) is not run; every batch done is given back to it
    (:meth:`~dist_eval.known.KnownLogits.took`: the computed ones are kept for later runs).
    ``on_batch_done(num_rows)`` after every batch (progress).
    """
    indices, labels, preds, losses, logits_kept = [], [], [], [], []
    sample_values: Dict[str, list] = {name: [] for name in (sample_metrics or {})}
    forward_seconds, max_batch_seconds = 0.0, 0.0
    redo = audit.Redo()  # batches of a swarm server blamed later are evaluated again, in place

    def put(position: int, batch: Batch, logits: torch.Tensor, source: Optional[str], taken) -> None:
        batch_id, rows, _, batch_labels = batch
        rows = np.asarray(rows, dtype=np.int64)
        batch_logits = _checked(logits, batch_id, rows, num_labels)
        if known is not None:
            known.took(batch_id, rows, batch_logits, source, taken)  # a batch evaluated again: its newer copy wins
        # argmax picks the first maximum on ties, the same on every rank
        done = [(preds, batch_logits.argmax(axis=1).astype(np.int64)),
                (losses, per_sample_cross_entropy(batch_logits, batch_labels)),
                *([(logits_kept, batch_logits)] if keep_logits else []),
                *((sample_values[name], _sample_value(name, fn, batch_logits, batch_labels))
                  for name, fn in (sample_metrics or {}).items())]
        if position == len(indices):  # a new batch (else one evaluated again: its results replaced)
            indices.append(rows)
            labels.append(np.asarray(batch_labels, dtype=np.int64))
        for values, value in done:
            if position == len(values):
                values.append(value)
            else:
                values[position] = value

    for batch, logits, seconds, source, taken in _forwards_in_order(model, batches, in_flight, known):
        if seconds is not None:
            forward_seconds += seconds
            max_batch_seconds = max(max_batch_seconds, seconds)
        put(len(indices), batch, logits, source, taken)
        redo.watch(len(indices) - 1, batch, taken)
        _evaluate_again(model, redo, put)
        if on_batch_done is not None:
            on_batch_done(len(batch[1]))

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
        num_resumed=known.rows_resumed if known is not None else 0,
    )
