"""``evaluate()`` and ``evaluate_pair()``: the Python API, in data-flow order.

    the rows, drawn once (dist_eval.data.sample.draw_rows: the --limit sample, slices, clusters)
      -> the one loop of rounds (dist_eval.stopping.evaluate_rows; each round one
         dist_eval.exact.evaluate_once per model): one round of every row, or rounds of rows
         until the interval says stop
      -> the slices and clusters, attached once to each model's result (dist_eval.slices)

Every step runs on every rank, each in a phase (:func:`dist_eval.ranks.phase`).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from dist_eval import ranks
from dist_eval.config import Options, Settings, settings_from, with_setting_keywords
from dist_eval.data.sample import Rows, draw_rows
from dist_eval.errors import UsageError
from dist_eval.exact import (
    MAX_CLASSES,  # noqa: F401 (an API name, importable from here as before)
    EvalResult,
    MergedMetric,
    Request,
    SampleMetric,
)
from dist_eval.slices import attach_slices
from dist_eval.stopping import evaluate_rows


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
    return evaluate_models([model], data, Request(
        tokenizer, num_labels, label_names, pad_token_id, return_logits, metrics, sample_metrics, on_batch_done,
        [resume_folder] if resume_folder else None, settings, options,
    ))[0]


def evaluate_models(models: list, data, request: Request, on_model: Optional[Callable[[int], None]] = None) -> list:
    """:func:`evaluate`'s and :func:`evaluate_pair`'s one path (and the CLI's, with its validated
    :class:`~dist_eval.exact.Request`), an EvalResult per model: the rows drawn once, then the one loop of
    rounds (:func:`dist_eval.stopping.evaluate_rows`: one round of every row for one model that does not stop
    early, or rounds of rows until the interval says stop), then the slices, attached once to each model's
    result.
    ``on_model(i)``: called before each evaluation of model ``i``.
    """
    settings, options = request.settings, request.options
    with ranks.phase("preparing the data"):  # checked before any work, on every rank
        rows = _rows_of(data, settings, options)
    # a slice's probability scores and the clustered intervals of the scores need the logits
    return_logits = request.return_logits
    request.return_logits = return_logits or options.slice_by is not None or options.cluster_by is not None
    results = evaluate_rows(models, rows if rows is not None else data, request, on_model)
    if rows is not None:
        attach_slices(results, rows, request.tokenizer, settings, options)
    for result in results if not return_logits else ():
        if result.predictions is not None:  # kept for the slices and the clustered intervals: returned when asked
            result.predictions.logits = None
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
    first_result, second_result = evaluate_models([first, second], data, Request(
        tokenizer, num_labels, label_names, pad_token_id, return_logits, metrics, sample_metrics, on_batch_done,
        resume_folders, settings, options,
    ), on_model)
    return first_result, second_result
