"""``evaluate()``: the Python API, in data-flow order.

    this rank's batches (dist_eval.data.shard) -> no-grad forwards (dist_eval.predict)
      -> merge (dist_eval.merge): all_reduce of totals, gather to rank 0, de-dup,
         coverage, metrics on rank 0 -> broadcast: every rank gets the same metrics

Each step is a phase (:func:`dist_eval.ranks.phase`): a failure on one rank is a failure
on every rank, so no rank is left waiting in the next collective.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from dist_eval import ranks
from dist_eval.backends.arguments import read_label_words
from dist_eval.backends.objects import evaluation_model
from dist_eval.config import Options, Settings, settings_from, with_setting_keywords
from dist_eval.data.labels import label_names_of, read_labels
from dist_eval.data.loader import loader_batches
from dist_eval.data.sample import Rows, draw_rows
from dist_eval.data.shard import dataset_batches
from dist_eval.errors import UsageError
from dist_eval.known import KnownLogits, open_known_logits
from dist_eval.loop_facts import LoopFacts
from dist_eval.merge import MergedResults, merge_on_main
from dist_eval.predict import ShardLoop, redo_blamed_on_other_ranks
from dist_eval.slices import attach_slices

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


@with_setting_keywords
def evaluate(
    model,
    data,
    *,
    tokenizer=None,
    num_labels: Optional[int] = None,
    label_names: Optional[Sequence[str]] = None,
    pad_token_id: Optional[int] = None,
    return_logits: bool = False,
    metrics: Optional[Dict[str, MergedMetric]] = None,
    sample_metrics: Optional[Dict[str, SampleMetric]] = None,
    on_batch_done: Optional[Callable[[int], None]] = None,
    resume_folder: Optional[str] = None,
    settings: Optional[Settings] = None,
    options: Optional[Options] = None,
    **settings_keywords,
) -> EvalResult:
    """Evaluate a classifier on a dataset (or DataLoader), sharded over the current
    process group, exactly: every row counted once, whatever the world size.

    Works with no process group (one process) and inside one that a training loop
    already initialised; every rank of the group must call it. ``model`` is a
    :class:`dist_eval.backends.LoadedModel` (from ``load_model``), the model object a
    training loop holds, or any callable ``input_ids -> logits`` (a transformers model
    of another architecture works: its output's ``.logits`` is used). A model object is
    petals' ``Distributed*ForSequenceClassification`` of a family in
    :data:`dist_eval.backends.families.FAMILIES` (or what petals' Auto class built;
    "ptune"/"deep_ptune" prompts and head as trained; its client stays up) or
    transformers' ``*ForSequenceClassification`` of those families, also inside
    ``DistributedDataParallel``: it is run by the code of ``load_model``'s
    petals or local backend, with the same logits bit for bit as ``load_model`` on the
    same weights (:mod:`dist_eval.backends.objects`). It is evaluated in eval mode and
    no-grad; each module's ``training`` flag is put back afterwards::

        for epoch in range(epochs):
            model.train()
            train_one_epoch(model, ...)
            result = evaluate(model, val_dataset, tokenizer=tokenizer)  # model.training is True again
            print(epoch, result.metrics["accuracy"])

    ``data`` is a ``datasets.Dataset`` (then ``tokenizer``, the column names and
    ``batch_size``/``max_length`` apply) or a ``DataLoader`` yielding dicts with
    ``input_ids`` (right-padded), ``labels`` and optionally ``attention_mask`` (right
    padding; checked, never sent to the model; each batch is cut to its longest real row).
    Row indices come from its sampler: a ``DistributedSampler`` (drop_last=False; its
    padded repeats are dropped), or any sampler of a loader that every rank iterates
    whole (dist_eval then gives each rank its share of the batches). A loader whose
    indices cannot be known (IterableDataset, custom batch_sampler) needs ``index`` in
    each batch. See :mod:`dist_eval.data.loader`.

    ``metrics``: name -> fn(labels, preds, logits) computed once on rank 0 over the
    merged, de-duplicated set (the logits are always passed). ``sample_metrics``:
    name -> fn(logits, labels) -> one value per sample, reported as its sample-weighted
    mean. Both appear in ``metrics`` beside the built-ins.
    ``on_batch_done(num_rows)`` is called on each rank after each of its batches.

    The settings (listed below, from their declarations in :mod:`dist_eval.config`) are
    keywords, or the validated ``settings=Settings(...)`` / ``options=Options(...)``. Those of
    :class:`~dist_eval.config.Options` change no result. ``limit`` and ``template`` apply to
    a Dataset only. ``label_words`` are those of a zero-shot model (``load_model(...,
    label_words=...)``, which knows them: given here, they are checked against it).

    ``resume_folder`` (Dataset input only): each rank stores the logits of finished
    batches there, atomically, at most every ``save_interval`` seconds; batches already
    stored there are not run again. The folder must belong to this exact model, data and
    settings (the CLI keys it by a hash of them; see :mod:`dist_eval.resume`).

    Stopping early (``stop_at_width``, a Dataset only): the rows are evaluated in the
    ``limit`` order, ``stop_round_rows`` at a time, until the 95% interval of ``stop_metric``
    over the whole set is at most that wide (:mod:`dist_eval.stopping`; ``stop_rule``:
    "time-uniform", valid at every round at once, or "fixed-width", about the rows of a fixed
    sample, valid at its own stop only); the metrics are those of the rows used, and
    ``metrics["stopping"]`` says where and why it stopped, by which rule, and what its interval
    guarantees. Two models on the same rows: :func:`evaluate_pair`.

    Intervals (``bootstrap_resamples``, 0 disables): 95% percentile bootstrap intervals,
    computed on rank 0 from the merged set (:mod:`dist_eval.intervals`; those of the
    probability scores with their resamples shared over the ranks), in
    ``metrics["confidence_intervals"]``; the same for any world size.

    Probability scores, from the softmax of every row's logits (gathered to rank 0 with the
    other per-sample arrays: rows x classes x 4 bytes there): ``ece`` (15 equal-width
    bins), ``brier``, ``top{k}_accuracy`` (``top_k``; None: 2 with more than 2 classes,
    none with 2) and ``auroc_macro`` (one-vs-rest, macro over the classes present), with
    ``reliability`` (the per-bin table) and their intervals beside the others.
    """
    settings, options = settings_from(settings_keywords, settings, options)
    return _evaluate_models(
        [model], data, tokenizer=tokenizer, num_labels=num_labels, label_names=label_names,
        pad_token_id=pad_token_id, return_logits=return_logits, metrics=metrics, sample_metrics=sample_metrics,
        on_batch_done=on_batch_done, resume_folders=[resume_folder] if resume_folder else None,
        settings=settings, options=options,
    )[0]


def _evaluate_models(models, data, *, tokenizer, num_labels, label_names, pad_token_id, return_logits, metrics,
                     sample_metrics, on_batch_done, resume_folders, settings, options, on_model=None) -> list:
    """:func:`evaluate`'s and :func:`evaluate_pair`'s one path: the rows drawn once, then one
    exact evaluation (one model that does not stop early) or rounds of them until the interval
    says stop (:mod:`dist_eval.stopping`), then the slices, attached once to each model's result.
    """
    with ranks.phase("preparing the data"):  # checked before any work, on every rank
        rows = _rows_of(data, settings, options)
    # a slice's probability scores and the clustered intervals of the scores need the logits
    keep_logits = return_logits or options.slice_by is not None or options.cluster_by is not None
    if settings.stops_early or len(models) > 1:
        results = _evaluate_in_rounds(
            models, rows if rows is not None else data, tokenizer=tokenizer, num_labels=num_labels,
            label_names=label_names, pad_token_id=pad_token_id, return_logits=keep_logits, metrics=metrics,
            sample_metrics=sample_metrics, on_batch_done=on_batch_done, resume_folders=resume_folders,
            settings=settings, options=options, on_model=on_model,
        )
    else:
        results = [evaluate_once(models[0], rows.dataset if rows is not None else data, tokenizer=tokenizer,
                                 num_labels=num_labels, label_names=label_names, pad_token_id=pad_token_id,
                                 return_logits=keep_logits, metrics=metrics, sample_metrics=sample_metrics,
                                 on_batch_done=on_batch_done, resume_folder=(resume_folders or [None])[0],
                                 settings=settings, options=options)]
    if rows is not None:
        attach_slices(results, rows, tokenizer, settings, options)
    for result in results if not return_logits else ():
        result.predictions = _without_logits(result.predictions)
    return results


def _rows_of(data, settings: Settings, options: Options) -> Optional[Rows]:
    """The rows of a Dataset (or the Rows the CLI drew), drawn once here with their slices and clusters;
    None for a DataLoader.
    """
    if isinstance(data, torch.utils.data.DataLoader):
        if options.shard is not None:
            raise UsageError("a shard is a part of a Dataset's batch plan; a DataLoader's batches are the "
                             "caller's. Pass a datasets.Dataset, or drop the shard.", param="shard",
                             value=options.shard)
        if options.slice_by is not None:
            raise UsageError(f"slices need a datasets.Dataset (its columns), not {type(data).__name__}.",
                             param="slice_by", value=list(options.slice_by))
        if options.cluster_by is not None:
            raise UsageError("clusters need a datasets.Dataset (its columns), not a DataLoader.", param="cluster_by",
                             value=options.cluster_by)
        return None
    return draw_rows(data, settings, options, in_key_order=settings.stops_early)


def evaluate_once(model, data, *, tokenizer, num_labels, label_names, pad_token_id, return_logits, metrics,
                  sample_metrics, on_batch_done, resume_folder, settings: Settings, options: Options,
                  loops: Optional[list] = None) -> EvalResult:
    """One exact evaluation of every row of ``data`` (:func:`evaluate`'s, validated ``settings``
    that do not stop early): the whole run, or one round of a run that stops early
    (:mod:`dist_eval.stopping` calls it for each round, never :func:`evaluate` back; ``loops``: the
    earlier rounds' forward loops, this one's appended: batches of a swarm server blamed later are
    evaluated again there too).
    """
    with evaluation_model(model) as model:  # a model object: adapted, in eval mode until the forwards end
        task = _task_of(model, num_labels, pad_token_id, label_names)
        settings = replace(settings, label_words=_label_words_of(task, settings.label_words))
        start, start_cpu = time.perf_counter(), time.process_time()

        # the known logits: the row store's rows before the plan (which leaves them out), the
        # resume folder's batches after it (keyed by the plan's batches)
        num_rows, batches, num_truncated, own_batches, known = _this_rank_batches(
            data, tokenizer, settings, task, options.top_k, _plan_hook(on_batch_done),
            partial(open_known_logits, model, tokenizer, settings, options, task.num_labels, task.pad_token_id),
            options.shard_part)
        with ranks.phase("reading the stored partial results"):
            known.resume_from(resume_folder, own_batches, task.num_labels, options.save_interval)
        local = _forward_passes(task, batches, known, options.in_flight, sample_metrics, on_batch_done, loops)
    loop_seconds = time.perf_counter() - start
    local.loop_cpu_seconds = time.process_time() - start_cpu  # this rank's CPU (all its threads) in the loop

    report, merged = merge_on_main(
        local, num_rows, task.num_labels, label_names=task.label_names, user_metrics=metrics,
        num_truncated=num_truncated, loop_seconds=loop_seconds,
        bootstrap=(options.bootstrap_resamples, options.bootstrap_seed), top_k=options.top_k,
        rows=known.shard_rows,
    )
    facts = LoopFacts.from_report(report)
    facts.row_store = known.store_facts(num_rows if known.shard_rows is None else len(known.shard_rows),
                                        facts.resumed_samples)
    report.update(facts.report())
    return EvalResult(metrics=report, predictions=merged if return_logits else _without_logits(merged), facts=facts)


@with_setting_keywords
def evaluate_pair(
    first,
    second,
    data,
    *,
    tokenizer=None,
    num_labels: Optional[int] = None,
    label_names: Optional[Sequence[str]] = None,
    pad_token_id: Optional[int] = None,
    return_logits: bool = False,
    metrics: Optional[Dict[str, MergedMetric]] = None,
    sample_metrics: Optional[Dict[str, SampleMetric]] = None,
    on_batch_done: Optional[Callable[[int], None]] = None,
    resume_folders: Optional[Sequence[str]] = None,
    settings: Optional[Settings] = None,
    options: Optional[Options] = None,
    on_model: Optional[Callable[[int], None]] = None,
    **settings_keywords,
) -> Tuple[EvalResult, EvalResult]:
    """Two models on the same rows, in rounds, until it is known which is better:
    ``(first's EvalResult, second's)``, each as :func:`evaluate` returns it for the rows used.

    Rows are evaluated in the --limit order, ``stop_round_rows`` at a time, by both models; after
    each round, the 95% time-uniform confidence sequence of the mean per-row difference in
    ``stop_metric`` (second - first) over the whole set says whether to stop:
    ``stop_when_decided=True`` stops once it excludes 0, ``stop_at_width=W`` once it is at
    most W wide; else at the end of the set. Both results' ``metrics["stopping"]`` say which
    (``reason``, ``better``: "first", "second" or None) and the interval. ``resume_folders``:
    one per model. ``on_model(i)``: called before each evaluation of model ``i`` (0: first, 1:
    second), e.g. to load that side's checkpoint into one model given twice (the CLI's two
    ``--checkpoint``'s: one model load). The other arguments are :func:`evaluate`'s, ``slice_by``
    included (the slices of the rows used, in each result).
    """
    settings, options = settings_from(settings_keywords, settings, options)
    first_result, second_result = _evaluate_models(
        [first, second], data, tokenizer=tokenizer, num_labels=num_labels, label_names=label_names,
        pad_token_id=pad_token_id, return_logits=return_logits, metrics=metrics, sample_metrics=sample_metrics,
        on_batch_done=on_batch_done, resume_folders=resume_folders, settings=settings, options=options,
        on_model=on_model,
    )
    return first_result, second_result


def _evaluate_in_rounds(models, data, *, tokenizer, num_labels, label_names, pad_token_id, return_logits, metrics,
                        sample_metrics, on_batch_done, resume_folders, settings, options, on_model=None) -> list:
    """:func:`evaluate` with ``stop_at_width``, :func:`evaluate_pair`: exact evaluate() calls on
    rounds of rows (:mod:`dist_eval.stopping`) until the interval says stop; an EvalResult per model.
    """
    from dist_eval.stopping import evaluate_in_rounds

    with evaluation_model(models[0]) as adapted:
        model_names = _task_of(adapted, num_labels, pad_token_id, label_names).label_names

    def evaluator(index: int):
        def evaluate_rows(data, **keywords) -> EvalResult:
            if on_model is not None:
                on_model(index)
            return evaluate_once(models[index], data, tokenizer=tokenizer, num_labels=num_labels,
                                 pad_token_id=pad_token_id, metrics=None, **keywords)
        return evaluate_rows

    results = evaluate_in_rounds(
        [evaluator(index) for index in range(len(models))], data, settings, options, label_names=label_names,
        model_names=model_names, user_metrics=metrics, sample_metrics=sample_metrics, on_batch_done=on_batch_done,
        resume_folders=resume_folders,
    )
    return [EvalResult(metrics=report, predictions=merged if return_logits else _without_logits(merged))
            for report, merged in results]


def _without_logits(merged: Optional[MergedResults]) -> Optional[MergedResults]:
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


def _task_of(model, num_labels, pad_token_id, label_names) -> _Task:
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


def _this_rank_batches(data, tokenizer, settings: Settings, task: _Task, top_k: Optional[int] = None, on_plan=None,
                       open_known=None, shard: Optional[Tuple[int, int]] = None):
    """(rows in the data, this rank's batches, rows truncated here, {batch id: rows} of this
    rank's batches or None for a DataLoader, the :class:`KnownLogits` ``open_known(data)`` opened).
    Every rank must call it. The rows the row store holds are left out of the batch plan; rank 0
    reports them, as batches whose logits are known. ``shard`` = (I, K): the rows of shard I of K
    only (:func:`dist_eval.data.shard.shard_of_plan`; ``known.shard_rows``), a Dataset only.
    """
    from dist_eval.backends.families import tokenizers_calling_the_base

    with ranks.phase("preparing the data"):
        _check_classes(task.num_labels)  # the first point the classes are known: every rank alike
        _check_top_k(top_k, task.num_labels)
        _check_window(task, settings.max_length)
        data, labels, task.label_names = _check_data(data, tokenizer, settings, task)
        num_rows = len(data.dataset) if labels is None else len(data)
    known = KnownLogits()
    if labels is not None and open_known is not None:
        with ranks.phase("reading the row store"):
            known = open_known(data)
    own_batches = None
    with ranks.phase("tokenizing the data"):
        if labels is None:  # a DataLoader: its batches are the user's
            batches, num_truncated = loader_batches(data), 0
        else:
            batches, num_truncated, own_batches = dataset_batches(
                data, tokenizer, labels, settings, pad_token_id=task.pad_token_id, prefix_tokens=task.prompt_tokens,
                on_plan=on_plan, skip_rows=known.stored_rows,
                calling_the_base=tokenizers_calling_the_base(), shard=shard, on_shard=known.keep_rows,
            )
            batches = known.with_store_batches(labels, batches)
    return num_rows, batches, num_truncated, own_batches, known


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
    """(the data: a Dataset of the rows drawn already, or a DataLoader; the labels of a Dataset or
    None for a DataLoader; class names).
    """
    if task.num_labels is None:
        raise UsageError("cannot tell the number of classes from the model; pass num_labels=K.", param="num_labels")
    if isinstance(data, torch.utils.data.DataLoader):
        if not hasattr(data.dataset, "__len__"):
            raise UsageError("a DataLoader over a dataset without len(): its rows cannot be counted.", param="data")
        if settings.limit:
            raise UsageError("only with a Dataset (a DataLoader's rows are the user's to choose).", param="limit")
        return data, None, task.label_names
    if tokenizer is None:
        raise UsageError("evaluate(data=Dataset) needs tokenizer=...; or pass a DataLoader of token ids.")
    if task.pad_token_id is None:
        raise UsageError("unknown (the model config has none); pass pad_token_id=...", param="pad_token_id")
    labels = _read_labels(data, settings, task)  # the rows are drawn already (draw_rows: evaluate's)
    return data, labels, task.label_names or label_names_of(data, settings.label_column)


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
