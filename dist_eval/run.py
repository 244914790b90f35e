"""``evaluate()``: the whole flow, in data-flow order.

    batches of this rank -> no-grad forward -> per-sample results
      -> all_reduce (samples, correct, loss sum)      every rank: global totals
      -> gather per-sample arrays to rank 0           rank 0: merge, de-dup, coverage
      -> metrics on rank 0 -> broadcast               every rank: the same metrics dict
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch

from dist_eval import distributed as D
from dist_eval.data import TaskColumns, check_columns, label_names_of, plan_batches, read_labels, right_pad, shard_batch_ids, tokenize_rows
from dist_eval.errors import UsageError
from dist_eval.metrics import confusion_matrix, mean_of, metrics_from_confusion
from dist_eval.predict import Batch, ShardResults, predict_shard
from dist_eval.results import MergedResults, merge_gathered

# A user metric over the merged set: fn(labels, preds, logits_or_None) -> float or dict
MergedMetric = Callable[[np.ndarray, np.ndarray, Optional[np.ndarray]], object]
# A user per-sample value: fn(logits [B, K], labels [B]) -> [B]; reported as its sample-weighted mean
SampleMetric = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass
class EvalResult:
    """What :func:`evaluate` returns.

    ``metrics`` is the same dict on every rank. ``predictions`` (per-sample arrays,
    ordered by row index, logits included when asked) is held by rank 0 only and is
    None on the other ranks, so that per-sample data exists once, not world_size times.
    """

    metrics: dict
    predictions: Optional[MergedResults]


def _dataset_batches(
    dataset, tokenizer, columns: TaskColumns, labels: np.ndarray, batch_ids: List[int], batches: List[np.ndarray],
    max_length: int, pad_token_id: int,
) -> tuple:
    """Tokenize this rank's rows once, up front, then yield right-padded batches."""
    if not batch_ids:
        return iter(()), 0
    rows = np.concatenate([batches[b] for b in batch_ids])
    ids, num_truncated = tokenize_rows(tokenizer, dataset, rows, columns, max_length, pad_token_id)
    by_row = dict(zip(rows.tolist(), ids))

    def generate() -> Iterator[Batch]:
        for b in batch_ids:
            batch_rows = batches[b]
            yield batch_rows, right_pad([by_row[r] for r in batch_rows.tolist()], pad_token_id), labels[batch_rows]

    return generate(), num_truncated


def _loader_batches(loader) -> Iterator[Batch]:
    """Batches of a user DataLoader: dicts with 'index', 'input_ids' and 'labels'.

    A DistributedSampler pads its last round with repeated rows; those are masked here
    by position (rank + k * num_replicas >= len(dataset)) before anything is counted.
    """
    from torch.utils.data import DistributedSampler

    sampler = getattr(loader, "sampler", None)
    padding_from = None
    if isinstance(sampler, DistributedSampler):
        n, world, rank = len(sampler.dataset), sampler.num_replicas, sampler.rank
        padding_from = len(range(rank, n, world))  # shard positions >= this are padding
    position = 0
    for batch in loader:
        missing = [k for k in ("index", "input_ids", "labels") if k not in batch]
        if missing:
            raise UsageError(
                f"evaluate(data=DataLoader): each batch must be a dict with 'index' (global row index), "
                f"'input_ids' (right-padded) and 'labels'; missing {missing}."
            )
        rows = np.asarray(batch["index"], dtype=np.int64)
        keep = np.ones(len(rows), dtype=bool)
        if padding_from is not None:
            keep = (position + np.arange(len(rows))) < padding_from
        position += len(rows)
        if not keep.any():
            continue
        input_ids = batch["input_ids"][torch.from_numpy(keep)]
        yield rows[keep], input_ids, np.asarray(batch["labels"], dtype=np.int64)[keep]


def evaluate(
    model,
    data,
    *,
    tokenizer=None,
    text_column: str = "text",
    text_pair_column: Optional[str] = None,
    label_column: str = "label",
    num_labels: Optional[int] = None,
    label_names: Optional[Sequence[str]] = None,
    batch_size: int = 16,
    max_length: int = 512,
    pad_token_id: Optional[int] = None,
    return_logits: bool = False,
    metrics: Optional[Dict[str, MergedMetric]] = None,
    sample_metrics: Optional[Dict[str, SampleMetric]] = None,
) -> EvalResult:
    """Evaluate a classifier on a dataset (or DataLoader), sharded over the current
    process group, exactly: every row counted once, whatever the world size.

    Works with no process group (one process) and inside one that a training loop
    already initialised; every rank of the group must call it. ``model`` is a
    :class:`dist_eval.backends.LoadedModel` or any callable ``input_ids -> logits``
    (a transformers model works: its output's ``.logits`` is used).

    ``data`` is a ``datasets.Dataset`` (then ``tokenizer``, the column names and
    ``batch_size``/``max_length`` apply) or a ``DataLoader`` yielding dicts with
    ``index``, ``input_ids`` (right-padded, no mask) and ``labels``.

    ``metrics``: name -> fn(labels, preds, logits) computed once on rank 0 over the
    merged, de-duplicated set (logits are passed when ``return_logits`` is set, else
    None). ``sample_metrics``: name -> fn(logits, labels) -> one value per sample,
    reported as its sample-weighted mean. Both appear in ``metrics`` beside the built-ins.
    """
    from dist_eval.backends import LoadedModel

    start = time.perf_counter()
    world_size, rank = D.get_world_size(), D.get_rank()
    forward = model.module if isinstance(model, LoadedModel) else model
    if isinstance(model, LoadedModel):
        num_labels = num_labels or model.num_labels
        pad_token_id = model.pad_token_id if pad_token_id is None else pad_token_id
        label_names = label_names or (list(model.id2label.values()) if model.id2label else None)
    if pad_token_id is None:
        pad_token_id = getattr(getattr(model, "config", None), "pad_token_id", None)
    if num_labels is None:
        num_labels = getattr(getattr(model, "config", None), "num_labels", None)
    if batch_size < 1 or max_length < 1:
        raise UsageError(f"batch_size and max_length must be >= 1; got batch_size={batch_size}, max_length={max_length}.")

    # 1. this rank's batches (errors are agreed on, so no rank is left waiting)
    error, batches, num_rows, num_truncated = None, iter(()), 0, 0
    try:
        if num_labels is None:
            raise UsageError("num_labels: cannot tell the number of classes from the model; pass num_labels=K.")
        if isinstance(data, torch.utils.data.DataLoader):
            num_rows = len(data.dataset)
            batches = _loader_batches(data)
        else:
            if tokenizer is None:
                raise UsageError("evaluate(data=Dataset) needs tokenizer=...; or pass a DataLoader of token ids.")
            if pad_token_id is None:
                raise UsageError("pad_token_id: unknown (the model config has none); pass pad_token_id=...")
            columns = TaskColumns(text_column, label_column, text_pair_column)
            check_columns(data, columns)
            labels = read_labels(data, label_column, num_labels)
            label_names = label_names or label_names_of(data, label_column)
            num_rows = len(data)
            planned = plan_batches(num_rows, batch_size)
            batch_ids = shard_batch_ids(len(planned), rank, world_size)
            batches, num_truncated = _dataset_batches(
                data, tokenizer, columns, labels, batch_ids, planned, max_length, pad_token_id
            )
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        error = e
    D.agree_on_failure("preparing the data", error)

    # 2. the no-grad forwards over this shard
    error, local = None, None
    try:
        local = predict_shard(forward, batches, num_labels, keep_logits=return_logits, sample_metrics=sample_metrics)
    except Exception as e:  # noqa: BLE001
        error = e
    D.agree_on_failure("the forward passes", error)
    loop_seconds = time.perf_counter() - start

    # 3. sample-weighted totals on every rank: reduce numerators and denominators, divide once
    sample_names = sorted(sample_metrics or {})
    local_totals = np.array(
        [local.num_samples, int((local.preds == local.labels).sum()), float(local.losses.sum()), num_truncated, local.forward_seconds]
        + [float(local.sample_values[n].sum()) for n in sample_names],
        dtype=np.float64,
    )
    global_totals = D.all_reduce_sum(local_totals)
    global_num_samples = int(global_totals[0])

    # 4. per-sample arrays to rank 0 only; rank 0 merges and computes the metrics
    gathered = D.gather_object_to_main(local.as_payload())
    rank_facts = D.all_gather_object((local.num_samples, loop_seconds))
    per_rank_samples = [n for n, _ in rank_facts]
    loop_seconds_max = max(s for _, s in rank_facts)
    report, merged, error = None, None, None
    if rank == 0:
        try:
            merged = merge_gathered(gathered, num_rows)
            del gathered  # hold one copy of the per-sample arrays, not two
            report = _metrics_on_main(merged, num_labels, label_names, metrics, sample_names, global_totals)
            report["num_truncated"] = int(global_totals[3])
            report["run"] = {
                "world_size": world_size,
                "per_rank_samples": per_rank_samples,
                "eval_loop_seconds": loop_seconds_max,
                "forward_seconds_sum": float(global_totals[4]),
                "samples_per_second": merged.num_samples / loop_seconds_max if loop_seconds_max > 0 else None,
                "duplicates_dropped": merged.num_duplicates_dropped,
            }
            if merged.num_samples != global_num_samples:
                raise RuntimeError(
                    f"internal: all_reduce counted {global_num_samples} samples but the merge holds {merged.num_samples}"
                )
        except Exception as e:  # noqa: BLE001
            error = e
    D.agree_on_failure("merging the results", error)
    report = D.broadcast_object(report)
    return EvalResult(metrics=report, predictions=merged if rank == 0 else None)


def _metrics_on_main(merged: MergedResults, num_labels, label_names, user_metrics, sample_names, global_totals) -> dict:
    if label_names is not None and len(label_names) != num_labels:
        label_names = None
    cm = confusion_matrix(merged.labels, merged.preds, num_labels)
    report = {"num_samples": merged.num_samples, "num_labels": num_labels}
    report.update(metrics_from_confusion(cm, label_names))
    # exactly rounded, in row order: the same bits for any world size
    report["loss"] = mean_of(merged.losses)
    reduced_loss = global_totals[2] / merged.num_samples
    if abs(reduced_loss - report["loss"]) > 1e-9 * max(1.0, abs(report["loss"])):
        raise RuntimeError(f"internal: all_reduced mean loss {reduced_loss} != merged mean loss {report['loss']}")
    for name in sample_names:
        report[name] = mean_of(merged.sample_values[name])
    for name, fn in (user_metrics or {}).items():
        value = fn(merged.labels, merged.preds, merged.logits)
        report[name] = value.item() if hasattr(value, "item") else value
    report["label_names"] = list(label_names) if label_names else None
    return report
