"""The task's columns and labels: checked, and read as class ids in [0, num_labels)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from dist_eval.errors import UsageError


def column_values(dataset, columns: Sequence[str], rows=None) -> list:
    """The values of each of ``columns`` of a ``datasets.Dataset`` (of ``rows`` only, in their
    order, when given: indices or a slice), row by row. A dataset without a format or transform:
    one read of just those rows and columns, as Python lists (iterating a Column reads it a row at a time, and
    ``select()`` then a column read is several times slower: benchmarks/RESULTS.md); a run of rows of plain
    columns, a slice of the Arrow columns (:func:`_arrow_values`). With a format or a transform (which may read other
    columns), the Columns of ``select(rows)``: their format decides the values.
    """
    if dataset.format["type"] is None:
        index = rows if isinstance(rows, slice) else slice(None) if rows is None else rows
        taken = _arrow_values(dataset, columns, index)
        if taken is not None:
            return taken
        index = index if isinstance(index, slice) else index.tolist()
        values = dataset.select_columns(list(dict.fromkeys(columns)))[index]
        return [values[name] for name in columns]
    if isinstance(rows, slice):
        rows = np.arange(*rows.indices(len(dataset)))
    picked = dataset if rows is None else dataset.select(rows.tolist())
    return [picked[name] for name in columns]


def _arrow_values(dataset, columns: Sequence[str], index) -> Optional[list]:
    """The values of ``columns`` at ``index`` (a slice or an array of row indices), a run of consecutive rows,
    read as a slice of the Arrow column; None where that would not give what ``dataset[index]`` gives, or
    would not be faster: rows behind an indices mapping (a ``select`` or ``shuffle`` not flattened), a
    column whose feature decodes its values (an image, audio, ...), rows not one run, a row out of range.
    The same values as datasets' own read (its Python formatter is the column's ``to_pylist`` too), without
    its row-by-row gather: a rank's block of 500k rows of text read in chunks of 4096, 2.7 CPU-s -> 0.09
    (benchmarks/RESULTS.md).
    """
    import datasets

    # datasets keeps the mapping in a private attribute: without it, no fast path (never the wrong rows)
    if not hasattr(dataset, "_indices") or dataset._indices is not None or dataset.data.num_rows != len(dataset):
        return None
    plain = (datasets.Value, datasets.ClassLabel)
    if not all(isinstance(dataset.features.get(name), plain) for name in columns):
        return None
    # a run of rows (how rows are tokenized and keyed); rows picked one by one are not (pyarrow's take joins a
    # column's record batches at each call: slower than datasets' read)
    if isinstance(index, slice):
        first, stop, step = index.indices(len(dataset))
        count = stop - first if step == 1 else 0
    else:
        index = np.asarray(index, dtype=np.int64)
        run = index.size and bool(np.all(np.diff(index) == 1))
        first, count = (int(index[0]), int(index.size)) if run else (0, 0)
    if count <= 0 or first < 0 or first + count > len(dataset):
        return None  # no run, or a row out of range (datasets' own read names it)
    return [dataset.data.column(name).slice(first, count).to_pylist() for name in columns]


@dataclass
class TaskColumns:
    """The columns the task reads (their parameters: text_column, label_column, text_pair_column)."""

    text: str
    label: str
    text_pair: Optional[str] = None
    template: Optional[str] = None  # the text given to the tokenizer: "{text}" (and "{text_pair}") filled in

    @classmethod
    def of(cls, settings) -> TaskColumns:
        """The columns of a :class:`dist_eval.config.Settings` (and its template)."""
        return cls(settings.text_column, settings.label_column, settings.text_pair_column,
                   getattr(settings, "template", None))

    def named(self):
        """(parameter, column name) of each column given."""
        pairs = (("text_column", self.text), ("label_column", self.label), ("text_pair_column", self.text_pair))
        return [(param, name) for param, name in pairs if name is not None]


def check_columns(dataset, columns: TaskColumns) -> None:
    for param, name in columns.named():
        if name not in dataset.column_names:
            raise UsageError(
                f"no such column; the dataset has {dataset.column_names}. Pass one of those.", param=param, value=name
            )


def label_names_of(dataset, label_column: str) -> Optional[List[str]]:
    """Class names: a ``datasets.ClassLabel``'s names, or for a column of text labels
    the sorted distinct texts (the ids :func:`read_labels` gives them when the model
    has no class names of its own).
    """
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


def is_generic_names(names: Sequence[str]) -> bool:
    """Transformers' placeholder names (LABEL_0, LABEL_1, ...): no real class names."""
    return all(str(name) == f"LABEL_{i}" for i, name in enumerate(names))


def read_labels(dataset, label_column: str, num_labels: int, label_names: Optional[Sequence[str]] = None,
                label_words: Optional[Sequence[str]] = None) -> np.ndarray:
    """All labels as int64 class ids, checked to lie in [0, num_labels).

    Integer labels are used as they are (floats only when whole numbers). Text labels:
    - texts that are all integers ("0", "2") are those integers;
    - else, with ``label_names`` (the model's class names in id order, config.json
      ``id2label``), each text is mapped to the id of the class of that name; every
      text must be one of the names;
    - else (no names, or transformers' placeholder LABEL_k names), when there are
      exactly ``num_labels`` distinct texts they get ids in sorted order (as
      ``Dataset.class_encode_column`` does; :func:`label_names_of` reports the names);
    - anything else is refused, naming the labels found and what was expected (with a zero-shot
      model's ``label_words``, one per class, as a mismatch with them).
    """
    # pyarrow -> numpy in one go (``dataset[col]`` is a lazy Column in datasets >= 4)
    values = np.asarray(dataset.select_columns([label_column]).with_format("numpy")[label_column][:])
    if values.size == 0:
        raise UsageError(
            "the evaluated split is empty: nothing to evaluate. Check --data-files and --split.", param="data"
        )
    if values.dtype.kind in "OUS":  # text labels (object: text, maybe with missing values)
        values = _text_labels_to_ids(values, label_column, num_labels, label_names, label_words)
    if values.dtype.kind not in "iu":
        whole = (
            np.isfinite(values) & (values == np.round(values))
            if values.dtype.kind == "f"
            else np.zeros(values.shape, bool)
        )
        if values.dtype.kind == "f" and whole.all():
            values = values.astype(np.int64)
        else:
            row = int(np.flatnonzero(~whole)[0])
            value = values[row].item() if hasattr(values[row], "item") else values[row]
            shown = "no label (an empty value)" if isinstance(value, float) and np.isnan(value) else repr(value)
            raise UsageError(
                f"expected integer class ids in [0, {num_labels}), but row {row} "
                f"has {shown} ({(~whole).sum()} such rows). Fill in or drop rows without a label, or map "
                "the labels to ids first (e.g. dataset.class_encode_column).",
                param="label_column",
                value=label_column,
            )
    values = values.astype(np.int64)
    bad = np.flatnonzero((values < 0) | (values >= num_labels))
    if bad.size:
        row = int(bad[0])
        raise _unfit(f"row {row} has label {values[row]}", f", outside [0, {num_labels}) ({bad.size} such rows). "
                     "Fix the data, or pass the checkpoint/--num-labels that match it.", label_column, label_words)
    return values


def classes_of(dataset, label_column: str, num_labels: int, label_names: Optional[Sequence[str]] = None,
               label_words: Optional[Sequence[str]] = None, whole_set=None) -> Tuple[np.ndarray, Optional[List[str]]]:
    """(every row's class id, :func:`read_labels`; the class names the report gives: ``label_names``, else
    the data's own, :func:`label_names_of`). ``whole_set``: the set ``dataset`` is a round of (its
    :class:`~dist_eval.data.sample.Rows`), when the caller named no classes: unless the model's names
    (``label_names``) are real ones, the classes are the whole set's (``whole_set.class_names``): text labels
    get the ids the whole set gives them, not those of the texts one round happens to hold.
    """
    if whole_set is not None and not (label_names and not is_generic_names(label_names)):
        label_names = whole_set.class_names(label_column) or label_names
    labels = read_labels(dataset, label_column, num_labels, label_names, label_words)
    return labels, label_names or label_names_of(dataset, label_column)


def _unfit(found: str, why: str, label_column: str, label_words) -> UsageError:
    """Labels that do not fit the classes: ``found`` and ``why`` (naming the column), or, with a
    zero-shot model's ``label_words``, ``found`` as a mismatch with the words (naming them).
    """
    if label_words is None:
        return UsageError(found + why, param="label_column", value=label_column)
    count = len(label_words)
    return UsageError(f"{count} words given, one per class (ids 0..{count - 1}), but the data does not fit them: "
                      f"{found} (column {label_column!r}). Give one word per class, in class-id order.",
                      param="label_words", value=list(label_words))


def _text_labels_to_ids(values: np.ndarray, label_column: str, num_labels: int, label_names,
                        label_words=None) -> np.ndarray:
    not_text = [i for i, v in enumerate(values.tolist()) if not isinstance(v, str)]
    if not_text:
        row = not_text[0]
        raise UsageError(
            f"row {row} has no text label ({values[row]!r}) among text labels "
            f"({len(not_text)} such rows). Fill in or drop rows without a label.",
            param="label_column",
            value=label_column,
        )
    texts = values.astype(str)
    distinct = sorted(set(texts.tolist()))
    if all(_INT_TEXT.match(t) for t in distinct):
        return np.array([int(t) for t in texts.tolist()], dtype=np.int64)
    shown = distinct[:8] + (["..."] if len(distinct) > 8 else [])
    names = [str(n) for n in label_names] if label_names and not is_generic_names(label_names) else None
    if names is not None:
        unknown = [t for t in distinct if t not in names]
        if unknown:
            raise UsageError(
                f"text labels {unknown[:8]} are not among the model's class "
                f"names {names} (config.json id2label), which map text labels to ids. Fix the labels or "
                "id2label, or map the labels to ids first.",
                param="label_column",
                value=label_column,
            )
        mapping = {name: i for i, name in enumerate(names)}
    elif len(distinct) == num_labels:
        mapping = {name: i for i, name in enumerate(distinct)}  # sorted: documented in README
    else:
        raise _unfit(f"{len(distinct)} distinct text labels {shown}",
                     f", but the classifier head has {num_labels} classes, so they cannot be given ids in sorted "
                     f"order (that needs exactly {num_labels}). Map them to ids first (e.g. "
                     "dataset.class_encode_column), or give the model's config.json an id2label with these names.",
                     label_column, label_words)
    lookup = np.vectorize(mapping.__getitem__, otypes=[np.int64])
    return lookup(texts)
