"""Load a dataset split, check it, cut it into batches and shard the batches.

Data flow: load (datasets) -> check columns and labels -> plan global batches ->
DistributedSampler over batch ids -> tokenize this rank's rows -> right-pad.

Why batches are sharded, not rows: a batch's composition (and so its padded length)
is then the same whatever the world size, and every sample's logits are bitwise
identical for N = 1, 2, 3, ... (row sharding would change which rows are padded
together, and could change the last bits of the logits and loss with N).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from dist_eval.errors import UsageError

_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}


def load_split(data: Sequence[str] | str, split: Optional[str] = None):
    """A ``datasets.Dataset`` from local files, a ``save_to_disk`` folder or a hub name.

    - files (csv/tsv/json/jsonl/parquet/arrow): the split is ``split`` or "train"
      (``datasets`` names a split of loose files "train");
    - a folder written by ``save_to_disk``: a Dataset, or a DatasetDict + ``split``;
    - anything else is taken as a hub dataset name (needs network access).
    """
    import datasets

    paths = [data] if isinstance(data, str) else list(data)
    if not paths:
        raise UsageError("--data-files: no file given. Pass a csv/json/jsonl/parquet file or a save_to_disk folder.")
    first = paths[0]
    if len(paths) == 1 and os.path.isdir(first):
        return _load_from_disk(first, split)
    existing = [p for p in paths if os.path.exists(p)]
    looks_local = any(os.path.splitext(p)[1].lower() in _BUILDERS for p in paths) or existing
    if looks_local:
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise UsageError(f"--data-files: no such file {missing[0]!r}. Pass existing csv/json/jsonl/parquet files.")
        exts = {os.path.splitext(p)[1].lower() for p in paths}
        unknown = exts - set(_BUILDERS)
        if unknown or len({_BUILDERS[e] for e in exts}) != 1:
            raise UsageError(
                f"--data-files: expected files of one format among {sorted(_BUILDERS)}, got extensions {sorted(exts)}."
            )
        builder = _BUILDERS[exts.pop()]
        kwargs = {"delimiter": "\t"} if all(p.lower().endswith(".tsv") for p in paths) else {}
        empty = [p for p in paths if _has_no_rows(p, builder)]
        if len(empty) == len(paths):
            raise UsageError(
                f"--data-files {first}: no rows (an empty file{', or a header only' if builder == 'csv' else ''}): "
                "nothing to evaluate. Pass the file that holds the split's rows."
            )
        try:
            return datasets.load_dataset(builder, data_files=paths, split=split or "train", **kwargs)
        except ValueError as e:
            if "split" in str(e).lower() or "Unknown split" in str(e):
                raise UsageError(f"--split {split}: loose files form a single split named 'train'. Drop --split.") from e
            raise UsageError(f"--data-files {first}: cannot be read as {builder} ({_short(e)}). Fix or replace the file.") from e
        except Exception as e:  # pyarrow / json decode errors on a corrupt file
            raise UsageError(f"--data-files {first}: cannot be read as {builder} ({_short(e)}). Fix or replace the file.") from e
    try:
        return datasets.load_dataset(first, split=split or "test")
    except Exception as e:
        raise UsageError(
            f"--data-files {first}: not a local file or folder, and loading it as a hub dataset failed "
            f"({_short(e)}). Pass a local file, or run where the hub is reachable."
        ) from e


def _has_no_rows(path: str, builder: str) -> bool:
    """An empty file, or a csv/tsv with at most its header line: ``datasets`` fails on
    those with messages that do not say so ("Instruction 'train' corresponds to no data")."""
    if builder not in ("csv", "json"):
        return os.path.getsize(path) == 0
    with open(path, "rb") as f:
        lines = [line for line in (f.readline() for _ in range(3)) if line.strip()]
    return len(lines) <= (1 if builder == "csv" else 0)


def _short(error: Exception, limit: int = 200) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def _load_from_disk(path: str, split: Optional[str]):
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except Exception as e:
        raise UsageError(
            f"--data-files {path}: a folder, but not one written by Dataset.save_to_disk ({_short(e)})."
        ) from e
    if isinstance(loaded, datasets.DatasetDict):
        if split is None:
            raise UsageError(f"--split: {path} holds splits {sorted(loaded)}; pass --split NAME with one of them.")
        if split not in loaded:
            raise UsageError(f"--split {split}: not in {path}; it has {sorted(loaded)}.")
        return loaded[split]
    return loaded


@dataclass
class TaskColumns:
    text: str
    label: str
    text_pair: Optional[str] = None


def check_columns(dataset, columns: TaskColumns) -> None:
    for flag, name in (("--text-column", columns.text), ("--label-column", columns.label), ("--text-pair-column", columns.text_pair)):
        if name is not None and name not in dataset.column_names:
            raise UsageError(f"{flag} {name}: no such column; the dataset has {dataset.column_names}. Pass one of those.")


def label_names_of(dataset, label_column: str) -> Optional[List[str]]:
    """Class names: a ``datasets.ClassLabel``'s names, or for a column of text labels
    the sorted distinct texts (the ids :func:`read_labels` gives them when the model
    has no class names of its own)."""
    import datasets

    feature = dataset.features.get(label_column)
    if isinstance(feature, datasets.ClassLabel):
        return list(feature.names)
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        distinct = [v for v in dataset.unique(label_column) if isinstance(v, str)]
        if distinct and not all(_INT_TEXT.match(v) for v in distinct):
            return sorted(distinct)
    return None


_INT_TEXT = re.compile(r"^\s*[+-]?\d+\s*$")


def _is_generic_names(names: Sequence[str]) -> bool:
    """transformers' placeholder names (LABEL_0, LABEL_1, ...): no real class names."""
    return all(str(name) == f"LABEL_{i}" for i, name in enumerate(names))


def read_labels(dataset, label_column: str, num_labels: int, label_names: Optional[Sequence[str]] = None) -> np.ndarray:
    """All labels as int64 class ids, checked to lie in [0, num_labels).

    Integer labels are used as they are (floats only when whole numbers). Text labels:
    - texts that are all integers ("0", "2") are those integers;
    - else, with ``label_names`` (the model's class names in id order, config.json
      ``id2label``), each text is mapped to the id of the class of that name; every
      text must be one of the names;
    - else (no names, or transformers' placeholder LABEL_k names), when there are
      exactly ``num_labels`` distinct texts they get ids in sorted order (as
      ``Dataset.class_encode_column`` does; :func:`label_names_of` reports the names);
    - anything else is refused, naming the labels found and what was expected.
    """
    # pyarrow -> numpy in one go (``dataset[col]`` is a lazy Column in datasets >= 4)
    values = np.asarray(dataset.select_columns([label_column]).with_format("numpy")[label_column][:])
    if values.size == 0:
        raise UsageError("--data-files: the evaluated split is empty: nothing to evaluate. Check --data-files and --split.")
    if values.dtype.kind in "OUS":  # text labels (object: text, maybe with missing values)
        values = _text_labels_to_ids(values, label_column, num_labels, label_names)
    if values.dtype.kind not in "iu":
        whole = np.isfinite(values) & (values == np.round(values)) if values.dtype.kind == "f" else np.zeros(values.shape, bool)
        if values.dtype.kind == "f" and whole.all():
            values = values.astype(np.int64)
        else:
            row = int(np.flatnonzero(~whole)[0])
            value = values[row].item() if hasattr(values[row], "item") else values[row]
            shown = "no label (an empty value)" if isinstance(value, float) and np.isnan(value) else repr(value)
            raise UsageError(
                f"--label-column {label_column}: expected integer class ids in [0, {num_labels}), but row {row} "
                f"has {shown} ({(~whole).sum()} such rows). Fill in or drop rows without a label, or map "
                "the labels to ids first (e.g. dataset.class_encode_column)."
            )
    values = values.astype(np.int64)
    bad = np.flatnonzero((values < 0) | (values >= num_labels))
    if bad.size:
        row = int(bad[0])
        raise UsageError(
            f"--label-column {label_column}: row {row} has label {values[row]}, outside [0, {num_labels}) "
            f"({bad.size} such rows). Fix the data, or pass the checkpoint/--num-labels that match it."
        )
    return values


def _text_labels_to_ids(values: np.ndarray, label_column: str, num_labels: int, label_names) -> np.ndarray:
    not_text = [i for i, v in enumerate(values.tolist()) if not isinstance(v, str)]
    if not_text:
        row = not_text[0]
        raise UsageError(
            f"--label-column {label_column}: row {row} has no text label ({values[row]!r}) among text labels "
            f"({len(not_text)} such rows). Fill in or drop rows without a label."
        )
    texts = values.astype(str)
    distinct = sorted(set(texts.tolist()))
    if all(_INT_TEXT.match(t) for t in distinct):
        return np.array([int(t) for t in texts.tolist()], dtype=np.int64)
    shown = distinct[:8] + (["..."] if len(distinct) > 8 else [])
    names = [str(n) for n in label_names] if label_names and not _is_generic_names(label_names) else None
    if names is not None:
        unknown = [t for t in distinct if t not in names]
        if unknown:
            raise UsageError(
                f"--label-column {label_column}: text labels {unknown[:8]} are not among the model's class "
                f"names {names} (config.json id2label), which map text labels to ids. Fix the labels or "
                "id2label, or map the labels to ids first."
            )
        mapping = {name: i for i, name in enumerate(names)}
    elif len(distinct) == num_labels:
        mapping = {name: i for i, name in enumerate(distinct)}  # sorted: documented in README
    else:
        raise UsageError(
            f"--label-column {label_column}: {len(distinct)} distinct text labels {shown}, but the classifier "
            f"head has {num_labels} classes, so they cannot be given ids in sorted order (that needs exactly "
            f"{num_labels}). Map them to ids first (e.g. dataset.class_encode_column), or give the model's "
            "config.json an id2label with these names."
        )
    lookup = np.vectorize(mapping.__getitem__, otypes=[np.int64])
    return lookup(texts)


# Defaults chosen from benchmarks/RESULTS.md: on a swarm, fewer and bigger forwards win
# (each one pays a round trip and per-request work on every server), and a token cap
# keeps a batch of long rows under a Petals server's --max_batch_size (2048 tokens by
# default, prompt vectors included) while rows of similar length fill it.
DEFAULT_BATCH_SIZE = 64
DEFAULT_MAX_BATCH_TOKENS = 1536


def plan_batches(
    num_rows: int,
    batch_size: int,
    lengths: Optional[np.ndarray] = None,
    max_batch_tokens: Optional[int] = None,
    *,
    length_buckets: bool = True,
    prefix_tokens: int = 0,
) -> List[np.ndarray]:
    """Global batches of row indices, the same on every rank whatever the world size.

    - at most ``batch_size`` rows per batch;
    - ``max_batch_tokens``: and at most that many padded tokens, i.e. rows x (longest
      row + ``prefix_tokens``, the prompt vectors the servers also compute); a row longer
      than the budget goes alone. Needs ``lengths`` (the token count of every row);
    - ``length_buckets`` (with ``lengths``): rows sorted longest first, ties in row
      order, so a batch holds rows of similar length and pads little; else dataset order.

    The plan depends only on the data and these settings, never on the rank or world
    size: that is what keeps every row's logits bitwise identical for any N.
    """
    if lengths is None:
        if max_batch_tokens is not None:
            raise ValueError("max_batch_tokens needs the token lengths of the rows")
        return [np.arange(start, min(start + batch_size, num_rows), dtype=np.int64) for start in range(0, num_rows, batch_size)]
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.shape != (num_rows,):
        raise ValueError(f"lengths has shape {lengths.shape}, expected ({num_rows},)")
    rows = np.arange(num_rows, dtype=np.int64)
    order = np.lexsort((rows, -lengths)) if length_buckets else rows  # longest first; ties keep row order
    if max_batch_tokens is None:
        return [order[start : start + batch_size] for start in range(0, num_rows, batch_size)]
    batches, current, longest = [], [], 0
    for row, length in zip(order.tolist(), lengths[order].tolist()):
        grown = max(longest, length)
        if current and (len(current) >= batch_size or (len(current) + 1) * (grown + prefix_tokens) > max_batch_tokens):
            batches.append(np.array(current, dtype=np.int64))
            current, grown = [], length
        current.append(row)
        longest = grown
    if current:
        batches.append(np.array(current, dtype=np.int64))
    return batches


class _Length:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def shard_batch_ids(num_batches: int, rank: int, world_size: int) -> List[int]:
    """This rank's batch ids: a ``DistributedSampler`` shard without its padding.

    DistributedSampler (drop_last=False) pads the id list to a multiple of the world
    size by repeating ids from its start; the padding lands at the end of each rank's
    shard. Those repeats are dropped here, before anything runs or is counted. A rank
    may get no batch at all (fewer batches than ranks); it still joins every collective.
    """
    if num_batches == 0:
        return []
    sampler = DistributedSampler(_Length(num_batches), num_replicas=world_size, rank=rank, shuffle=False, drop_last=False)
    padded_shard = list(sampler)
    # Position of shard element k in the padded list is rank + k * world_size.
    num_real = len(range(rank, num_batches, world_size))
    return padded_shard[:num_real]


def tokenize_rows(tokenizer, dataset, rows: np.ndarray, columns: TaskColumns, max_length: int, pad_token_id: int):
    """Token ids of ``rows`` (lists, unpadded), and how many were truncated to max_length."""
    subset = dataset.select(rows.tolist()) if len(rows) else None
    if subset is None:
        return [], 0
    texts = list(subset[columns.text])
    pairs = list(subset[columns.text_pair]) if columns.text_pair else None
    for flag, name, values in (("--text-column", columns.text, texts), ("--text-pair-column", columns.text_pair, pairs)):
        if values is None:
            continue
        for offset, value in enumerate(values):
            if not isinstance(value, str):
                raise UsageError(
                    f"{flag} {name}: row {int(rows[offset])} holds {type(value).__name__} {value!r}, expected text. "
                    "Fix the data or pick the text column."
                )
    encoded = tokenizer(texts, pairs, truncation=False, add_special_tokens=True)["input_ids"]
    num_truncated = 0
    out = []
    for offset, ids in enumerate(encoded):
        if len(ids) > max_length:
            ids = ids[:max_length]
            num_truncated += 1
        if not ids:
            raise UsageError(
                f"--text-column {columns.text}: row {int(rows[offset])} is empty after tokenization; the model "
                "has no token to classify. Drop empty rows from the data."
            )
        if pad_token_id in ids:
            raise UsageError(
                f"--model: row {int(rows[offset])} contains the pad token id {pad_token_id} inside its text; with "
                "right padding and no attention mask the model would classify the wrong position. Use a tokenizer "
                "whose pad token never occurs in text (set pad_token_id in config.json)."
            )
        out.append(ids)
    return out, num_truncated


def right_pad(sequences: List[List[int]], pad_token_id: int) -> torch.Tensor:
    """[batch, longest] int64, padded on the right. No attention mask is built: the
    petals client refuses any mask that is not all ones, and causal attention means
    pads after a sequence do not change its earlier positions."""
    longest = max(len(s) for s in sequences)
    batch = torch.full((len(sequences), longest), pad_token_id, dtype=torch.long)
    for i, ids in enumerate(sequences):
        batch[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return batch
