"""A shard's own files (``--shard I/K``), beside its report: what ``python -m dist_eval.shard_merge``
needs to build the whole set's report from the shards, and nothing it must guess.

- ``shard.npz``: the shard's rows as the run merged them (row index in the set, label, prediction,
  loss, float32 logits), in row order: the exact values, no text round trip.
- ``shard.json``, written last (atomically): the shard (I/K), the run key (the model, checkpoint,
  data and settings: :func:`dist_eval.resume.run_key`, the same for every shard of one run, with
  the set identified by its rows' content in evaluation order, :func:`merge_key`), what names each
  part of it, the report's options (bootstrap, top-k, slices, saved logits and texts),
  the rows of the set, and the rows' slice values and texts (--save-text). Its presence says the
  shard finished: a shard killed before it holds none, and a new run into the folder removes it
  first (:func:`discard_shard`).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
from typing import TYPE_CHECKING, Optional, Tuple

import numpy as np

from dist_eval.atomic import atomic_write, read_regular
from dist_eval.loop_facts import RunFacts
from dist_eval.results import MergedResults

if TYPE_CHECKING:
    from dist_eval.plan import Pair
    from dist_eval.run_context import RunContext

MANIFEST, ARRAYS = "shard.json", "shard.npz"
FORMAT = 1
# the arrays of a shard (MergedResults' fields of the same names)
ARRAY_FIELDS = ("indices", "labels", "preds", "losses", "logits")
# the options that change the report built from the rows (not which rows, nor their logits)
REPORT_OPTIONS = ("bootstrap_resamples", "bootstrap_seed", "top_k", "slice_by", "cluster_by")
MAX_SHARD_BYTES = 64 << 30


def discard_shard(folder: str) -> None:
    """A run starting in ``folder``: an earlier shard's files there are not this run's."""
    for name in (MANIFEST, ARRAYS):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, name))


class _Content:
    """A set's rows as the run key sees a dataset, identified by their content in evaluation order
    (not by datasets' fingerprint, which follows the files and their order).
    """

    def __init__(self, dataset, identity: str):
        self._fingerprint, self.column_names, self._rows = identity, dataset.column_names, len(dataset)

    def __len__(self) -> int:
        return self._rows


def content_key(rows) -> str:
    """A hash of the rows' content keys (:attr:`dist_eval.data.sample.Rows.keys`: their text, text pair
    and label), row by row in evaluation order: the same for the same rows in the same order, whatever
    files and file order they came from.
    """
    import hashlib

    return hashlib.sha256(rows.keys.keys.tobytes()).hexdigest()[:16]


def columns_key(rows, slice_by, cluster_by) -> Optional[str]:
    """A hash of each row's slice names (``--slice-by``'s columns, as the report names a cell) and cluster
    (``--cluster-by``, as the clusters are told apart), row by row in evaluation order; None without such columns.
    Not in the content key (the rows' text, text pair and label): shards of files whose slice or cluster column
    differs hold the same rows in other slices or clusters.
    """
    import hashlib

    from dist_eval.data.groups import slice_name

    named = [(column, slice_name) for column in slice_by or ()] + ([(cluster_by, str)] if cluster_by else [])
    if not named:
        return None
    digest = hashlib.sha256()
    for column, name in named:
        digest.update(json.dumps([column, [name(v) for v in rows.dataset[column]]]).encode())
    return digest.hexdigest()[:16]


def merge_key(job, pair, model, rows) -> Tuple[str, str]:
    """(the run key with the set identified by its rows' content, that content key): what every
    shard of one run shares, from any files holding the same rows in the same order.
    """
    from dist_eval import resume

    content = content_key(rows)
    dataset = _Content(rows.dataset, content)
    return resume.run_key(job.model_dir, pair.checkpoint.path, dataset, job.split, model, job.settings,
                          job.head, libraries=False), content


def write_shard(folder: str, result, context: RunContext, pair: Pair, rows, texts: Optional[dict]) -> str:
    """Rank 0 of a shard's run: ``shard.npz`` then ``shard.json`` (last: the shard is finished) in
    ``folder``. ``result``: the run's EvalResult (logits kept); ``context``, ``pair``: the run's
    (:mod:`dist_eval.pipeline`); ``rows``: the set's Rows; ``texts``: what predictions.jsonl holds
    of each row beside its numbers (texts, slices; by row index).
    """
    from dist_eval.resume import device_kind

    config = context.config
    key, content = merge_key(context.job, pair, context.model, rows)
    merged: MergedResults = result.predictions
    mine = merged.indices  # this shard's rows of the set
    arrays = {name: getattr(merged, name) for name in ARRAY_FIELDS if getattr(merged, name) is not None}
    atomic_write(os.path.join(folder, ARRAYS), lambda f: np.savez(f, **arrays), binary=True)
    options = config.options
    manifest = {
        "format": FORMAT,
        "shard": options.shard,
        "run_key": key,  # the run key, the set by its content: the files may differ in order or place
        "rows_key": content,
        "columns_key": columns_key(rows, options.slice_by, options.cluster_by),
        # what the run key is made of, as the report names it (and where the weights were): a merge names what differs
        "named": {**RunFacts.of(result.metrics).key_facts(), "settings": config.settings.as_dict(),
                  "device": device_kind(context.model)},
        "report": {**{name: getattr(options, name, None) for name in REPORT_OPTIONS},
                   "save_logits": config.save_logits, "save_text": config.save_text},
        "rows_in_set": int(len(rows)),
        "rows": int(len(mine)),
        "texts": {name: [values[i] for i in mine.tolist()] for name, values in (texts or {}).items()},
    }
    return atomic_write(os.path.join(folder, MANIFEST), lambda f: json.dump(manifest, f, default=_plain))


def _plain(value):
    if isinstance(value, (tuple, np.generic)):
        return list(value) if isinstance(value, tuple) else value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def read_manifest(folder: str) -> Optional[dict]:
    """``folder``'s shard.json (None: there is none, the shard has not finished); a file that is
    not one raises ValueError saying so.
    """
    path = os.path.join(folder, MANIFEST)
    if not os.path.lexists(path):
        return None
    manifest = json.loads(read_regular(path, 1 << 30))
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a dist_eval shard's manifest of format {FORMAT}")
    return manifest


def read_rows(folder: str) -> dict:
    """The arrays of ``folder``'s shard.npz, by name (a regular file, read whole; no pickle)."""
    data = read_regular(os.path.join(folder, ARRAYS), MAX_SHARD_BYTES)
    with np.load(io.BytesIO(data), allow_pickle=False) as f:
        return {name: np.asarray(f[name]) for name in f.files}
