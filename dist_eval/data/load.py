"""Load a dataset split: local files, a ``save_to_disk`` folder or a hub name."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from dist_eval.errors import UsageError, param_name, short_error

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
        raise UsageError("no file given. Pass a csv/json/jsonl/parquet file or a save_to_disk folder.", param="data")
    first = paths[0]
    if len(paths) == 1 and os.path.isdir(first):
        return _load_from_disk(first, split)
    existing = [p for p in paths if os.path.exists(p)]
    looks_local = any(os.path.splitext(p)[1].lower() in _BUILDERS for p in paths) or existing
    if looks_local:
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise UsageError(
                f"no such file {missing[0]!r}. Pass existing csv/json/jsonl/parquet files.", param="data"
            )
        exts = {os.path.splitext(p)[1].lower() for p in paths}
        unknown = exts - set(_BUILDERS)
        if unknown or len({_BUILDERS[e] for e in exts}) != 1:
            raise UsageError(
                f"expected files of one format among {sorted(_BUILDERS)}, got extensions {sorted(exts)}.",
                param="data",
            )
        builder = _BUILDERS[exts.pop()]
        kwargs = {"delimiter": "\t"} if all(p.lower().endswith(".tsv") for p in paths) else {}
        if builder == "csv":
            # only an empty cell is a missing value: pandas' default also turns the texts "NA" (North
            # America), "null", "n/a", "None", "nan" into missing ones, merging them with empty cells
            kwargs.update(keep_default_na=False, na_values=[""])
        empty = [p for p in paths if _has_no_rows(p, builder)]
        if len(empty) == len(paths):
            raise UsageError(
                f"no rows (an empty file{', or a header only' if builder == 'csv' else ''}): "
                "nothing to evaluate. Pass the file that holds the split's rows.",
                param="data", value=first,
            )
        try:
            return datasets.load_dataset(builder, data_files=paths, split=split or "train", **kwargs)
        except Exception as e:  # a ValueError naming the split; pyarrow / json decode errors on a corrupt file
            if isinstance(e, ValueError) and "split" in str(e).lower():
                raise UsageError(
                    "loose files form a single split named 'train'. Drop --split.", param="split", value=split
                ) from e
            raise UsageError(
                f"cannot be read as {builder} ({short_error(e)}). Fix or replace the file.", param="data", value=first
            ) from e
    try:
        return datasets.load_dataset(first, split=split or "test")
    except Exception as e:
        raise UsageError(
            f"not a local file or folder, and loading it as a hub dataset failed "
            f"({short_error(e)}). Pass a local file, or run where the hub is reachable.",
            param="data", value=first,
        ) from e


def fills_cache(data: Sequence[str] | str) -> bool:
    """Whether :func:`load_split` of ``data`` builds ``datasets``' cache (loose files, a hub
    name): then one rank should load first and the others read what it built. A
    ``save_to_disk`` folder is read as it is, by every rank at once.
    """
    paths = [data] if isinstance(data, str) else list(data)
    return not (len(paths) == 1 and os.path.isdir(paths[0]))


def _has_no_rows(path: str, builder: str) -> bool:
    """An empty file, or a csv/tsv with at most its header line: ``datasets`` fails on
    those with messages that do not say so ("Instruction 'train' corresponds to no data").
    """
    if builder not in ("csv", "json"):
        return os.path.getsize(path) == 0
    with open(path, "rb") as f:
        lines = [line for line in (f.readline() for _ in range(3)) if line.strip()]
    return len(lines) <= (1 if builder == "csv" else 0)


def _load_from_disk(path: str, split: Optional[str]):
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except Exception as e:
        raise UsageError(
            f"a folder, but not one written by Dataset.save_to_disk ({short_error(e)}).", param="data", value=path
        ) from e
    if isinstance(loaded, datasets.DatasetDict):
        if split is None:
            raise UsageError(
                f"{path} holds splits {sorted(loaded)}; pass {param_name('split', 'NAME')} with one of them.",
                param="split",
            )
        if split not in loaded:
            raise UsageError(f"not in {path}; it has {sorted(loaded)}.", param="split", value=split)
        return loaded[split]
    return loaded
