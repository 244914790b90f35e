"""``evaluate()``: the whole flow, in data-flow order.

    batches of this rank -> no-grad forward -> per-sample results
      -> all_reduce (samples, correct, loss sum)      every rank: global totals
      -> gather per-sample arrays to rank 0           rank 0: merge, de-dup, coverage
      -> metrics on rank 0 -> broadcast               every rank: the same metrics dict
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from dist_eval import distributed as D
from dist_eval.data import DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCH_TOKENS, TaskColumns, check_columns, label_names_of, plan_batches, read_labels, right_pad, shard_batch_ids, tokenize_rows
from dist_eval.errors import UsageError
from dist_eval.intervals import bootstrap_intervals
from dist_eval.metrics import confusion_matrix, mean_of, metrics_from_confusion
from dist_eval.partial import PartialWriter
from dist_eval.partial import load as load_partial
from dist_eval.predict import DEFAULT_IN_FLIGHT, Batch, ShardResults, predict_shard
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


def _row_block(num_rows: int, rank: int, world_size: int) -> np.ndarray:
    """Rows [rank*n/N, (rank+1)*n/N): each rank measures one contiguous block of lengths."""
    return np.arange(rank * num_rows // world_size, (rank + 1) * num_rows // world_size, dtype=np.int64)


def _dataset_shard(
    dataset, tokenizer, columns: TaskColumns, labels: np.ndarray, *, batch_size: int, max_length: int,
    pad_token_id: int, length_buckets: bool, max_batch_tokens: Optional[int], prefix_tokens: int = 0,
) -> tuple:
    """This rank's batches of a Dataset: (iterator of right-padded batches, rows truncated
    here, {batch id: row indices} of this rank's batches).

    Every rank calls it (it holds collectives). Tokenisation happens once, up front, so
    it never stalls the forwards. With length buckets or a token budget the global batch
    plan needs every row's token count: each rank tokenizes one contiguous block of rows,
    the lengths are all-gathered (4-8 bytes a row), and each rank then tokenizes only the
    rows of its own batches that its block did not cover.
    """
    world_size, rank = D.get_world_size(), D.get_rank()
    num_rows = len(labels)
    known_ids: Dict[int, List[int]] = {}
    lengths = None
    num_truncated = 0
    if length_buckets or max_batch_tokens is not None:
        block = _row_block(num_rows, rank, world_size)
        ids, num_truncated, error = [], 0, None
        try:
            ids, num_truncated = tokenize_rows(tokenizer, dataset, block, columns, max_length, pad_token_id)
        except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
            error = e
        D.agree_on_failure("tokenizing the data", error)
        known_ids = dict(zip(block.tolist(), ids))
        local_lengths = np.fromiter((len(x) for x in ids), dtype=np.int32, count=len(ids))
        lengths = np.concatenate(D.all_gather_object(local_lengths))  # blocks are in rank order
    planned = plan_batches(
        num_rows, batch_size, lengths, max_batch_tokens, length_buckets=length_buckets, prefix_tokens=prefix_tokens
    )
    batch_ids = shard_batch_ids(len(planned), rank, world_size)
    rows = np.concatenate([planned[b] for b in batch_ids]) if batch_ids else np.zeros(0, np.int64)
    todo = np.array([r for r in rows.tolist() if r not in known_ids], dtype=np.int64)
    ids, truncated_here = tokenize_rows(tokenizer, dataset, todo, columns, max_length, pad_token_id)
    if lengths is None:  # else each row's truncation was counted once, in its block
        num_truncated = truncated_here
    by_row = {r: known_ids.get(r) for r in rows.tolist()}
    by_row.update(zip(todo.tolist(), ids))
    known_ids.clear()

    def generate() -> Iterator[Batch]:
        for b in batch_ids:
            batch_rows = planned[b]
            yield b, batch_rows, right_pad([by_row[r] for r in batch_rows.tolist()], pad_token_id), labels[batch_rows]

    return generate(), num_truncated, {b: planned[b] for b in batch_ids}


def _stored_logits(folder: str, own_batches: Dict[int, np.ndarray], num_labels: int) -> Dict[int, np.ndarray]:
    """{batch id: logits} of this rank's batches that an interrupted run stored. A stored
    batch whose rows or shape do not match the plan is ignored (run again), never used."""
    stored = {}
    for batch_id, (rows, logits) in load_partial(folder, own_batches).items():
        if np.array_equal(rows, own_batches[batch_id]) and logits.shape == (len(rows), num_labels):
            stored[batch_id] = logits
    return stored


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
    for batch_number, batch in enumerate(loader):
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
        yield batch_number, rows[keep], input_ids, np.asarray(batch["labels"], dtype=np.int64)[keep]


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
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_length: int = 512,
    pad_token_id: Optional[int] = None,
    return_logits: bool = False,
    metrics: Optional[Dict[str, MergedMetric]] = None,
    sample_metrics: Optional[Dict[str, SampleMetric]] = None,
    on_batch_done: Optional[Callable[[int], None]] = None,
    length_buckets: bool = True,
    max_batch_tokens: Optional[int] = DEFAULT_MAX_BATCH_TOKENS,
    in_flight: int = DEFAULT_IN_FLIGHT,
    bootstrap_resamples: int = 1000,
    bootstrap_seed: int = 0,
    resume_folder: Optional[str] = None,
    save_interval: float = 10.0,
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
    ``on_batch_done(num_rows)`` is called on each rank after each of its batches.

    Throughput (none of these changes any result): ``length_buckets`` batches rows of
    similar token length together (less padding); ``max_batch_tokens`` caps a batch's
    padded tokens (rows x (longest row + prompt vectors); None: no cap) besides its
    ``batch_size`` rows; ``in_flight`` keeps that many batches
    in flight at once on each rank (their results are put back in order).

    ``resume_folder`` (Dataset input only): each rank stores the logits of finished
    batches there, atomically, at most every ``save_interval`` seconds; batches already
    stored there are not run again. The folder must belong to this exact model, data and
    settings (the CLI keys it by a hash of them; see :mod:`dist_eval.partial`).

    ``bootstrap_resamples`` (0 disables) and ``bootstrap_seed``: 95% percentile bootstrap
    intervals for accuracy, macro-F1 and loss, computed on rank 0 from the merged set
    (:func:`dist_eval.intervals.bootstrap_intervals`, about 1 s per 1000 resamples),
    in ``metrics["confidence_intervals"]``; the same for any world size.
    """
    from dist_eval.backends import LoadedModel

    start, start_cpu = time.perf_counter(), time.process_time()
    rank = D.get_rank()
    forward = model.module if isinstance(model, LoadedModel) else model
    if isinstance(model, LoadedModel):
        num_labels = num_labels or model.num_labels
        pad_token_id = model.pad_token_id if pad_token_id is None else pad_token_id
        label_names = label_names or (list(model.id2label.values()) if model.id2label else None)
    if pad_token_id is None:
        pad_token_id = getattr(getattr(model, "config", None), "pad_token_id", None)
    if num_labels is None:
        num_labels = getattr(getattr(model, "config", None), "num_labels", None)
    for name, value in (("batch_size", batch_size), ("max_length", max_length), ("in_flight", in_flight),
                        ("max_batch_tokens", 1 if max_batch_tokens is None else max_batch_tokens)):
        if not isinstance(value, int) or value < 1:
            raise UsageError(f"{name}={value!r}: expected a positive integer.")
    if not isinstance(bootstrap_resamples, int) or bootstrap_resamples < 0:
        raise UsageError(f"bootstrap_resamples={bootstrap_resamples!r}: expected an integer >= 0 (0 disables the intervals).")

    # 1. this rank's batches (errors are agreed on, so no rank is left waiting)
    error, batches, num_rows, num_truncated, own_batches = None, iter(()), 0, 0, None
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
            labels = read_labels(data, label_column, num_labels, label_names=label_names)
            label_names = label_names or label_names_of(data, label_column)
            num_rows = len(data)
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        error = e
    D.agree_on_failure("preparing the data", error)
    if not isinstance(data, torch.utils.data.DataLoader):
        error = None
        try:
            batches, num_truncated, own_batches = _dataset_shard(
                data, tokenizer, columns, labels, batch_size=batch_size, max_length=max_length,
                pad_token_id=pad_token_id, length_buckets=length_buckets, max_batch_tokens=max_batch_tokens,
                prefix_tokens=model.prompt_tokens if isinstance(model, LoadedModel) else 0,
            )
        except Exception as e:  # noqa: BLE001
            error = e
        D.agree_on_failure("tokenizing the data", error)

    # 2. what an interrupted run already stored, then the no-grad forwards over the rest
    error, stored, writer = None, {}, None
    if resume_folder is not None and own_batches is not None:
        try:
            stored = _stored_logits(resume_folder, own_batches, num_labels)
            writer = PartialWriter(resume_folder, rank, save_interval)
        except Exception as e:  # noqa: BLE001
            error = e
    D.agree_on_failure("reading the stored partial results", error)
    error, local = None, None
    failed = D.FailureFlag("forward-failed")  # one rank's failure stops the others at their next batch

    def after_batch(num_rows: int) -> None:
        if on_batch_done is not None:
            on_batch_done(num_rows)
        failed.check()

    try:
        local = predict_shard(
            forward, batches, num_labels, keep_logits=return_logits, sample_metrics=sample_metrics,
            on_batch_done=after_batch, in_flight=in_flight, stored=stored,
            on_batch_logits=writer.add if writer is not None else None,
        )
    except Exception as e:  # noqa: BLE001
        error = e
        if not isinstance(e, D.StoppedForAnotherRank):
            failed.raise_()
    finally:
        if writer is not None:
            writer.flush()  # also on failure: finished batches are not lost
    D.agree_on_failure("the forward passes", error)
    loop_seconds = time.perf_counter() - start
    local.loop_cpu_seconds = time.process_time() - start_cpu  # this rank's CPU (all its threads) in the loop

    report, merged = merge_on_main(
        local, num_rows, num_labels, label_names=label_names, user_metrics=metrics,
        num_truncated=num_truncated, loop_seconds=loop_seconds, bootstrap=(bootstrap_resamples, bootstrap_seed),
    )
    return EvalResult(metrics=report, predictions=merged)


def merge_on_main(
    local: ShardResults,
    num_rows: int,
    num_labels: int,
    *,
    label_names: Optional[Sequence[str]] = None,
    user_metrics: Optional[Dict[str, MergedMetric]] = None,
    num_truncated: int = 0,
    loop_seconds: float = 0.0,
    bootstrap: Optional[Tuple[int, int]] = None,
) -> tuple:
    """Combine every rank's results: (the report on every rank, the merged per-sample
    arrays on rank 0 and None elsewhere). Every rank must call it.

    ``bootstrap`` = (resamples, seed) adds ``confidence_intervals`` to the report."""
    world_size, rank = D.get_world_size(), D.get_rank()
    # sample-weighted totals on every rank: reduce numerators and denominators, divide once
    sample_names = sorted(local.sample_values)
    local_totals = np.array(
        [local.num_samples, int((local.preds == local.labels).sum()), float(local.losses.sum()), num_truncated, local.forward_seconds,
         local.loop_cpu_seconds]
        + [float(local.sample_values[n].sum()) for n in sample_names],
        dtype=np.float64,
    )
    global_totals = D.all_reduce_sum(local_totals)
    global_num_samples = int(global_totals[0])

    # per-sample arrays to rank 0 only; rank 0 merges and computes the metrics
    gathered = D.gather_arrays_to_main(local.as_payload())
    rank_facts = D.all_gather_object((local.num_samples, loop_seconds, local.max_batch_seconds, local.num_resumed))
    per_rank_samples = [facts[0] for facts in rank_facts]
    loop_seconds_max = max(facts[1] for facts in rank_facts)
    report, merged, error = None, None, None
    if rank == 0:
        try:
            merged = merge_gathered([gathered], num_rows)  # consumes the arrays: one copy at a time
            del gathered
            report = _metrics_on_main(merged, num_labels, label_names, user_metrics, sample_names, global_totals)
            if bootstrap and bootstrap[0]:  # from the index-ordered merged set: the same for any N
                report["confidence_intervals"] = bootstrap_intervals(
                    merged.labels, merged.preds, merged.losses, num_labels, resamples=bootstrap[0], seed=bootstrap[1]
                )
            report["num_truncated"] = int(global_totals[3])
            report["run"] = {
                "world_size": world_size,
                "per_rank_samples": per_rank_samples,
                "eval_loop_seconds": loop_seconds_max,
                "forward_seconds_sum": float(global_totals[4]),
                # where the loop's time goes: client CPU of all ranks (their own processes;
                # not the p2pd daemons), next to ranks x loop seconds of wall time
                "loop_cpu_seconds_sum": float(global_totals[5]),
                "samples_per_second": merged.num_samples / loop_seconds_max if loop_seconds_max > 0 else None,
                "duplicates_dropped": merged.num_duplicates_dropped,
                "max_batch_seconds": max(facts[2] for facts in rank_facts),
                "resumed_samples": sum(facts[3] for facts in rank_facts),
            }
            if merged.num_samples != global_num_samples:
                raise RuntimeError(
                    f"internal: all_reduce counted {global_num_samples} samples but the merge holds {merged.num_samples}"
                )
        except Exception as e:  # noqa: BLE001
            error = e
    D.agree_on_failure("merging the results", error)
    report = D.broadcast_object(report)
    return report, merged


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
