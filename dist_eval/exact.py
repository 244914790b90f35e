"""One exact evaluation of every row of a dataset (or a DataLoader), on every rank:

    the model and its task's facts (dist_eval.backends.objects.evaluation_task)
      -> the task and the data checked, in one call, before anything is read
      -> this rank's batches and the known logits, opened together (dist_eval.known: the labels as
         class ids, the row store, the batch plan of dist_eval.data.shard, the resume folder)
      -> no-grad forwards (dist_eval.predict.forward_passes)
      -> merge (dist_eval.merge): all_reduce of totals, gather to rank 0, de-dup, coverage,
         metrics on rank 0 -> broadcast: every rank gets the same metrics

A run that does not stop early is one of them; a run that stops early, one per round
(:mod:`dist_eval.stopping`). Each step is a phase (:func:`dist_eval.ranks.phase`): a failure on
one rank is a failure on every rank, so no rank is left waiting in the next collective.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, Optional, Sequence

import numpy as np
import torch

from dist_eval import ranks
from dist_eval.backends.objects import Task, evaluation_task
from dist_eval.config import Options, Settings
from dist_eval.errors import UsageError
from dist_eval.known import batches_with_known
from dist_eval.loop_facts import LoopFacts
from dist_eval.merge import merge_on_main
from dist_eval.predict import forward_passes
from dist_eval.results import MergedResults

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
    # with slice_by, on rank 0: {column: each row's slice name, by row index} (the token-length
    # quartiles under TOKEN_LENGTH_SLICES); what predictions.jsonl's ``slice`` holds
    slices: Optional[dict] = None
    # what the loop measured, typed (metrics["run"] says it too): rounds add them up
    facts: Optional[LoopFacts] = None


@dataclass
class Request:
    """What :func:`dist_eval.evaluate` or :func:`dist_eval.evaluate_pair` was asked besides the models
    and the data, made once at the top (:mod:`dist_eval.evaluation`) and passed down whole: each stage
    takes what it needs.
    """

    tokenizer: object
    num_labels: Optional[int]
    label_names: Optional[Sequence[str]]
    pad_token_id: Optional[int]
    return_logits: bool
    metrics: Optional[Dict[str, MergedMetric]]
    sample_metrics: Optional[Dict[str, SampleMetric]]
    on_batch_done: Optional[Callable[[int], None]]
    resume_folders: Optional[Sequence[str]]
    settings: Settings
    options: Options
    # a round of a run in rounds whose caller named no classes: the set's Rows, whose class names the round's
    # text labels take (dist_eval.data.labels.classes_of), as the whole set would give them
    whole_set: Optional[object] = None


def evaluate_once(model, data, request: Request, resume_folder: Optional[str],
                  loops: Optional[list] = None) -> EvalResult:
    """One exact evaluation of every row of ``data`` (a Dataset of the rows drawn, or a DataLoader) by
    ``model``, with ``request``'s settings, which do not stop early: the whole run, or one round of a
    run that stops early (:mod:`dist_eval.stopping` calls it for each round; ``loops``: the earlier
    rounds' forward loops, this one's appended: batches of a swarm server blamed later are evaluated
    again there too). The task and the data are checked in one call, then this rank's batches and the
    known logits are opened (:func:`dist_eval.known.batches_with_known`: the labels, the row store, the
    batch plan, the resume folder), run (:func:`dist_eval.predict.forward_passes`) and merged.
    """
    options, on_batch_done = request.options, request.on_batch_done
    # a model object: adapted, in eval mode until the end
    with evaluation_task(model, request.num_labels, request.pad_token_id, request.label_names,
                         request.settings.label_words) as task:
        settings = replace(request.settings, label_words=task.label_words)
        start, start_cpu = time.perf_counter(), time.process_time()

        with ranks.phase("preparing the data"):  # before anything is read: every rank alike
            _check_task(data, request.tokenizer, settings, options, task)
        batches, num_truncated, known = batches_with_known(
            data, request.tokenizer, settings, options, task, resume_folder, _plan_hook(on_batch_done),
            request.whole_set)
        local = forward_passes(task.forward, task.num_labels, batches, known, options.in_flight,
                               request.sample_metrics, on_batch_done, loops)
    loop_seconds = time.perf_counter() - start
    local.loop_cpu_seconds = time.process_time() - start_cpu  # this rank's CPU (all its threads) in the loop
    store = known.store_facts()

    report, merged, facts = merge_on_main(
        local, known.num_rows, task.num_labels, label_names=task.label_names, user_metrics=request.metrics,
        num_truncated=num_truncated, loop_seconds=loop_seconds,
        bootstrap=(options.bootstrap_resamples, options.bootstrap_seed), top_k=options.top_k,
        rows=known.shard_rows,
    )
    facts.row_store = store
    report.update(facts.report())
    return EvalResult(metrics=report, predictions=merged if request.return_logits else without_logits(merged),
                      facts=facts)


def without_logits(merged: Optional[MergedResults]) -> Optional[MergedResults]:
    """The logits were kept for the probability scores; returned only when asked."""
    if merged is not None:
        merged.logits = None
    return merged


def _plan_hook(on_batch_done):
    """A GlobalProgress's ``set_plan`` when ``on_batch_done`` is its ``update``: its ETA then counts work."""
    from dist_eval.progress import GlobalProgress

    owner = getattr(on_batch_done, "__self__", None)
    return owner.set_plan if isinstance(owner, GlobalProgress) else None


def _check_task(data, tokenizer, settings: Settings, options: Options, task: Task) -> None:
    """What this evaluation refuses before it reads or loads anything: too many classes, a top-k that means
    nothing, rows past the model's attention window, data the task cannot read. The first point the classes
    are known: every rank checks alike.
    """
    _check_classes(task.num_labels)
    _check_top_k(options.top_k, task.num_labels)
    _check_window(task, settings.max_length)
    _check_data(data, tokenizer, settings, task)


def _check_window(task: Task, max_length: int) -> None:
    """Rows that may be longer than the model's sliding attention window (or another limit of its attention:
    ``task.attention_limit``), which no block here computes.
    """
    longest = max_length + task.prompt_tokens
    if task.attention_window and longest > task.attention_window:
        raise UsageError(
            f"rows of up to {max_length} tokens and {task.prompt_tokens} prompt or label-word positions may pass "
            f"the model's {task.attention_limit} of {task.attention_window} positions (config.json), which "
            f"dist_eval does not compute (a row within it is computed exactly). "
            f"Pass --max-length {task.attention_window - task.prompt_tokens} or less.",
            param="max_length", value=max_length)


# The most classes a run evaluates: rank 0 holds a K x K confusion matrix of int64 (512 MiB at this
# bound) beside every row's K logits; refused before any forward, not after the last one
MAX_CLASSES = 8192


def _check_classes(num_labels: Optional[int]) -> None:
    if num_labels is not None and num_labels > MAX_CLASSES:
        size = num_labels * num_labels * 8 / 2**30
        raise UsageError(f"expected at most {MAX_CLASSES} classes; {num_labels} would need a {size:.1f} GiB confusion "
                         "matrix on rank 0 alone. Evaluate a classifier of fewer classes (group rare ones).",
                         param="num_labels", value=num_labels)


def _check_top_k(top_k: Optional[int], num_labels: Optional[int]) -> None:
    """A k at or above the number of classes: every row is a top-k hit, a number that means nothing."""
    if top_k is not None and num_labels is not None and top_k >= num_labels:
        fix = f"pass at most {num_labels - 1}, or omit it" if num_labels > 2 else "omit it (no top-k with 2 classes)"
        raise UsageError(f"expected a k below the number of classes ({num_labels}); got {top_k}, with which every "
                         f"row is a hit. Fix: {fix}.", param="top_k", value=top_k)


def _check_data(data, tokenizer, settings: Settings, task: Task) -> None:
    """``data`` (a Dataset of the rows drawn already, or a DataLoader) can be evaluated by ``task``."""
    if task.num_labels is None:
        raise UsageError("cannot tell the number of classes from the model; pass num_labels=K.", param="num_labels")
    if isinstance(data, torch.utils.data.DataLoader):
        if not hasattr(data.dataset, "__len__"):
            raise UsageError("a DataLoader over a dataset without len(): its rows cannot be counted.", param="data")
        if settings.limit:
            raise UsageError("only with a Dataset (a DataLoader's rows are the user's to choose).", param="limit")
        return
    if tokenizer is None:
        raise UsageError("evaluate(data=Dataset) needs tokenizer=...; or pass a DataLoader of token ids.")
    if task.pad_token_id is None:
        raise UsageError("unknown (the model config has none); pass pad_token_id=...", param="pad_token_id")
