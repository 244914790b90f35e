"""One exact evaluation of every row of a dataset (or a DataLoader), on every rank:

    this rank's batches (dist_eval.data.shard; the known logits: dist_eval.known)
      -> no-grad forwards (dist_eval.predict)
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
from dist_eval.backends.arguments import read_label_words
from dist_eval.backends.objects import evaluation_model
from dist_eval.config import Options, Settings
from dist_eval.data.labels import is_generic_names, label_names_of, read_labels
from dist_eval.data.loader import loader_batches
from dist_eval.errors import UsageError
from dist_eval.known import KnownLogits, dataset_batches_with_known
from dist_eval.loop_facts import LoopFacts
from dist_eval.merge import MergedResults, merge_on_main
from dist_eval.predict import ShardLoop, redo_blamed_on_other_ranks

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
class _Task:
    """What the model tells about the task, completed by the arguments."""

    forward: Callable
    num_labels: Optional[int]
    pad_token_id: Optional[int]
    label_names: Optional[Sequence[str]]
    prompt_tokens: int  # tokens a forward adds to each row: prompt vectors, appended label-word tokens
    label_words: Optional[tuple] = None  # a zero-shot model's
    attention_window: int = 0  # positions a row may span, prompts included (0: any)


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

    def model_names(self, model) -> Optional[Sequence[str]]:
        """``model``'s class names (its own, or ``label_names``), or None."""
        with evaluation_model(model) as adapted:
            return task_of(adapted, self.num_labels, self.pad_token_id, self.label_names).label_names

    def class_names(self, model, data) -> Optional[Sequence[str]]:
        """The class names each round of a run in rounds over ``data`` (the whole set) is given: text
        labels get the ids the whole set gives them (sorted distinct texts, when the model has no names
        of its own), not those of the texts one round happens to hold.
        """
        model_names = self.model_names(model)
        if self.label_names is not None:
            return self.label_names
        if model_names and not is_generic_names(model_names):
            return None  # each round maps the texts through the model's names, as the whole set would
        return label_names_of(data, self.settings.label_column)


def evaluate_once(model, data, request: Request, resume_folder: Optional[str],
                  loops: Optional[list] = None) -> EvalResult:
    """One exact evaluation of every row of ``data`` (a Dataset of the rows drawn, or a DataLoader) by
    ``model``, with ``request``'s settings, which do not stop early: the whole run, or one round of a
    run that stops early (:mod:`dist_eval.stopping` calls it for each round; ``loops``: the earlier
    rounds' forward loops, this one's appended: batches of a swarm server blamed later are evaluated
    again there too).
    """
    options, on_batch_done = request.options, request.on_batch_done
    with evaluation_model(model) as model:  # a model object: adapted, in eval mode until the end
        task = task_of(model, request.num_labels, request.pad_token_id, request.label_names)
        settings = replace(request.settings, label_words=_label_words_of(task, request.settings.label_words))
        start, start_cpu = time.perf_counter(), time.process_time()

        # the known logits: the row store's rows before the plan (which leaves them out), the
        # resume folder's batches after it (keyed by the plan's batches)
        num_rows, batches, num_truncated, own_batches, known = _this_rank_batches(
            model, data, request.tokenizer, settings, options, task, _plan_hook(on_batch_done))
        with ranks.phase("reading the stored partial results"):
            known.resume_from(resume_folder, own_batches, task.num_labels, options.save_interval)
        local = _forward_passes(task, batches, known, options.in_flight, request.sample_metrics, on_batch_done, loops)
    loop_seconds = time.perf_counter() - start
    local.loop_cpu_seconds = time.process_time() - start_cpu  # this rank's CPU (all its threads) in the loop
    store = known.store_facts(num_rows if known.shard_rows is None else len(known.shard_rows))

    report, merged = merge_on_main(
        local, num_rows, task.num_labels, label_names=task.label_names, user_metrics=request.metrics,
        num_truncated=num_truncated, loop_seconds=loop_seconds,
        bootstrap=(options.bootstrap_resamples, options.bootstrap_seed), top_k=options.top_k,
        rows=known.shard_rows,
    )
    facts = LoopFacts.from_report(report)
    facts.row_store = store
    report.update(facts.report())
    return EvalResult(metrics=report, predictions=merged if request.return_logits else without_logits(merged),
                      facts=facts)


def without_logits(merged: Optional[MergedResults]) -> Optional[MergedResults]:
    """The logits were kept for the probability scores; returned only when asked."""
    if merged is not None:
        merged.logits = None
    return merged


def _forward_passes(task: _Task, batches, known: KnownLogits, in_flight, sample_metrics, on_batch_done, loops=None):
    """This rank's forwards (a phase): finished batches are stored as they come, and kept
    when the phase fails; one rank's failure stops the others at their next batch. Then the
    batches of swarm servers any rank's audit blamed, evaluated again (:func:`redo_blamed_on_other_ranks`).
    """
    loop = ShardLoop(task.forward, task.num_labels, keep_logits=True, sample_metrics=sample_metrics, known=known)
    with ranks.phase("the forward passes", stop_early=True) as failed:

        def after_batch(num_rows: int) -> None:
            if on_batch_done is not None:
                on_batch_done(num_rows)
            failed.check()

        try:
            loop.run(batches, on_batch_done=after_batch, in_flight=in_flight)
        finally:
            known.flush()  # also on failure: finished batches are not lost
    redo_blamed_on_other_ranks(loop, loops or ())
    if loops is not None:  # kept only where a swarm audit may blame a server later
        loops.append(loop if loop.redo.ledgers else None)
    return loop.results()


def _label_words_of(task: _Task, label_words) -> Optional[tuple]:
    """The model's label words; ``label_words`` given must be them."""
    given = read_label_words(label_words)
    if given is not None and task.label_words is None:
        raise UsageError("the model scores the classes with a classifier head, not label words. Load it with "
                         "load_model(..., label_words=...) to score words.", param="label_words", value=list(given))
    if given is not None and given != task.label_words:
        raise UsageError(f"the model was loaded to score {list(task.label_words)}; pass those or none.",
                         param="label_words", value=list(given))
    return task.label_words


def task_of(model, num_labels, pad_token_id, label_names) -> _Task:
    """The forward callable and the task's facts: from a LoadedModel, else from ``model.config``."""
    from dist_eval.backends.classifier import LoadedModel

    if isinstance(model, LoadedModel):
        return _Task(
            forward=model.module,
            num_labels=num_labels or model.num_labels,
            pad_token_id=model.pad_token_id if pad_token_id is None else pad_token_id,
            label_names=label_names or (list(model.id2label.values()) if model.id2label else None),
            prompt_tokens=model.prompt_tokens + model.appended_tokens,
            label_words=model.label_words,
            attention_window=model.attention_window,
        )
    config = getattr(model, "config", None)
    return _Task(
        forward=model,
        num_labels=num_labels if num_labels is not None else getattr(config, "num_labels", None),
        pad_token_id=pad_token_id if pad_token_id is not None else getattr(config, "pad_token_id", None),
        label_names=label_names,
        prompt_tokens=0,
    )


def _plan_hook(on_batch_done):
    """A GlobalProgress's ``set_plan`` when ``on_batch_done`` is its ``update``: its ETA then counts work."""
    from dist_eval.progress import GlobalProgress

    owner = getattr(on_batch_done, "__self__", None)
    return owner.set_plan if isinstance(owner, GlobalProgress) else None


def _this_rank_batches(model, data, tokenizer, settings: Settings, options: Options, task: _Task, on_plan=None):
    """(rows in the data, this rank's batches, rows truncated here, {batch id: rows} of this
    rank's batches or None for a DataLoader, the :class:`KnownLogits`). Every rank must call it.
    A Dataset goes whole to the known logits' stage (:func:`dist_eval.known.dataset_batches_with_known`:
    the row store read, the batch plan without its rows, ``options.shard_part``'s rows only); a
    DataLoader's batches are the user's.
    """
    with ranks.phase("preparing the data"):
        _check_classes(task.num_labels)  # the first point the classes are known: every rank alike
        _check_top_k(options.top_k, task.num_labels)
        _check_window(task, settings.max_length)
        labels, task.label_names = _check_data(data, tokenizer, settings, task)
    if labels is not None:
        batches, num_truncated, own_batches, known = dataset_batches_with_known(
            model, data, labels, tokenizer, settings, options, task, on_plan)
        return len(data), batches, num_truncated, own_batches, known
    with ranks.phase("tokenizing the data"):
        batches = loader_batches(data)
    return len(data.dataset), batches, 0, None, KnownLogits()


def _check_window(task: _Task, max_length: int) -> None:
    """Rows that may be longer than the model's sliding attention window, which no block here computes."""
    longest = max_length + task.prompt_tokens
    if task.attention_window and longest > task.attention_window:
        raise UsageError(
            f"rows of up to {max_length} tokens and {task.prompt_tokens} prompt or label-word positions may pass "
            f"the model's sliding attention window of {task.attention_window} positions (config.json), which "
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


def _check_data(data, tokenizer, settings: Settings, task: _Task):
    """(the labels of ``data``, a Dataset of the rows drawn already, as class ids, or None for a DataLoader;
    the class names).
    """
    if task.num_labels is None:
        raise UsageError("cannot tell the number of classes from the model; pass num_labels=K.", param="num_labels")
    if isinstance(data, torch.utils.data.DataLoader):
        if not hasattr(data.dataset, "__len__"):
            raise UsageError("a DataLoader over a dataset without len(): its rows cannot be counted.", param="data")
        if settings.limit:
            raise UsageError("only with a Dataset (a DataLoader's rows are the user's to choose).", param="limit")
        return None, task.label_names
    if tokenizer is None:
        raise UsageError("evaluate(data=Dataset) needs tokenizer=...; or pass a DataLoader of token ids.")
    if task.pad_token_id is None:
        raise UsageError("unknown (the model config has none); pass pad_token_id=...", param="pad_token_id")
    labels = _read_labels(data, settings, task)  # the rows are drawn already (draw_rows: evaluate's)
    return labels, task.label_names or label_names_of(data, settings.label_column)


def _read_labels(data, settings: Settings, task: _Task) -> np.ndarray:
    """The labels as class ids; with label words, a label beyond them names ``label_words``."""
    try:
        return read_labels(data, settings.label_column, task.num_labels, label_names=task.label_names)
    except UsageError as e:
        if task.label_words is None or e.param != "label_column" or not (
                "outside [0," in e.detail or "distinct text labels" in e.detail):
            raise
        count = len(task.label_words)
        found = e.detail.split(", outside")[0].split(", but")[0]  # "row 5 has label 3" / "4 distinct text labels"
        raise UsageError(
            f"{count} words given, one per class (ids 0..{count - 1}), but the data does not fit them: {found} "
            f"(column {settings.label_column!r}). Give one word per class, in class-id order.",
            param="label_words", value=list(task.label_words),
        ) from e
