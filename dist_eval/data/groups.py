"""Each row's slice names (``--slice-by COLUMN ...``) and cluster (``--cluster-by COLUMN``), read
from the data's columns once, when the rows are drawn (:func:`dist_eval.data.sample.draw_rows`):
a cell named as a category, or refused in one line naming the flag. The metrics per slice are
:mod:`dist_eval.slices`'.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from dist_eval import ranks
from dist_eval.chunks import chunk_rows
from dist_eval.data.labels import column_values
from dist_eval.errors import UsageError, warn

# More distinct values than this in a --slice-by column: a text or id column by mistake.
MAX_SLICE_VALUES = 100


# The slices of a cell without a value (null in JSON or parquet, an empty CSV cell) and of an
# empty text: names in brackets, so that the texts "None", "NA", "null" stay slices of their own
# (a data text spelled like one of these is refused: the two would be one slice).
MISSING = "<missing>"
EMPTY = "<empty>"


def slice_value(value) -> str:
    """A stored slice name as it is (None, a row without one: :data:`MISSING`)."""
    return MISSING if value is None else value if isinstance(value, str) else str(value)


def slice_name(value) -> Optional[str]:
    """A cell's slice name: a text as it is ("" is :data:`EMPTY`), an integer or a bool as
    written, a whole float as its integer (a CSV column of integers with empty cells reads as
    floats), None as :data:`MISSING`; None for what names no category (a fraction, NaN, inf,
    a list) or a text spelled like :data:`MISSING` or :data:`EMPTY`.
    """
    if value is None:
        return MISSING
    if isinstance(value, str):
        return None if value in (MISSING, EMPTY) else value or EMPTY
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)) and np.isfinite(value) and float(value).is_integer():
        return str(int(value))
    return None


def column_slices(column: str, cells, slice_by: Sequence[str], first_row: int = 0,
                  known: Optional[dict] = None) -> List[str]:
    """Each cell of ``column`` as its slice name; a cell that names no category refused in one line.
    ``cells`` are rows ``first_row`` on (a chunk of the column); ``known``: {(type, value): name} of
    the cells seen so far, so that the rows of a slice share one name (8 bytes a row, not a text each).
    """
    known = {} if known is None else known
    names = []
    for value in cells:
        try:
            name = known[(type(value), value)]
        except KeyError:
            name = known[(type(value), value)] = slice_name(value)
        except TypeError:  # unhashable (a list): names no category
            name = slice_name(value)
        names.append(name)
    if None not in names:
        return names
    offset = names.index(None)
    row, value = first_row + offset, cells[offset]
    if isinstance(value, str):
        why = (f"holds the text {value!r} (row {row}), the name of its slice of "
               f"{'missing values' if value == MISSING else 'empty texts'}. Rename that text in the data")
    elif isinstance(value, (float, np.floating)):
        why = (f"holds numbers that are no category ({value!r} in row {row}): a slice per float value would "
               "split the rows at random. Bin it first (a column of ranges, e.g. '0-10') and slice by that")
    else:
        why = (f"holds {type(value).__name__} values ({value!r} in row {row}), not categories. Pass a column of "
               "texts or integers")
    raise UsageError(f"column {column!r} {why}.", param="slice_by", value=list(slice_by))


def read_slice_values(dataset, slice_by: Optional[Sequence[str]]) -> Dict[str, List[str]]:
    """{column: each row's slice name, in row order} of a ``datasets.Dataset``. A missing
    column, one of more than MAX_SLICE_VALUES distinct values, or one holding what names no
    category (:func:`slice_name`) is refused in one line.
    """
    if not slice_by:
        return {}
    names = list(getattr(dataset, "column_names", None) or [])
    out = {}
    for column in slice_by:
        if column not in names:
            raise UsageError(f"no column {column!r} in the data (its columns: {', '.join(names)}). Pass one of them.",
                             param="slice_by", value=list(slice_by))
        values = _read_slices(dataset, column, slice_by)
        distinct = len(set(values))
        if distinct > MAX_SLICE_VALUES:
            raise UsageError(f"column {column!r} has {distinct} distinct values, more than {MAX_SLICE_VALUES} "
                             "slices (a text or id column?). Pass a column of categories (a language, a source).",
                             param="slice_by", value=list(slice_by))
        out[column] = values
    return out


def _read_slices(dataset, column: str, slice_by: Sequence[str]) -> List[str]:
    """:func:`column_slices` of a dataset's column, read a chunk of rows at a time (their cells are
    Python objects until named).
    """
    names: List[str] = []
    known: dict = {}
    chunk = chunk_rows("slice_read")
    for start in range(0, len(dataset), chunk):
        cells = column_values(dataset, [column], slice(start, start + chunk))[0]
        names += column_slices(column, list(cells), slice_by, start, known)
    return names


def read_cluster_names(dataset, column: str) -> List[str]:
    """Each row's cluster (``--cluster-by``): the cell of ``column`` named as a slice is
    (:func:`slice_name`), in row order. A missing column, a row without a value, a cell that
    names no category, or a single cluster is refused in one line.
    """
    names = list(getattr(dataset, "column_names", None) or [])
    if column not in names:
        raise UsageError(f"no column {column!r} in the data (its columns: {', '.join(names)}). Pass one of them.",
                         param="cluster_by", value=column)
    values = _read_slices(dataset, column, [column])
    if MISSING in values:
        raise UsageError(f"row {values.index(MISSING)} has no value in column {column!r}: every row needs its "
                         "cluster. Fill the column (a row of its own: a value no other row has).",
                         param="cluster_by", value=column)
    if len(set(values)) < 2 and values:
        raise UsageError(f"column {column!r} holds one value ({values[0]!r}) in every row: one cluster, nothing "
                         "to resample. Pass the column that groups the rows (a passage, a conversation).",
                         param="cluster_by", value=column)
    return values


def one_row_slices(values: Dict[str, List[str]]) -> List[str]:
    """``column=value`` of each slice of a single row (its metrics mean nothing)."""
    out = []
    for column, names_of_rows in values.items():
        names, counts = np.unique(np.array(names_of_rows, dtype=object).astype(str), return_counts=True)
        out += [f"{column}={name}" for name, count in zip(names.tolist(), counts.tolist()) if count == 1]
    return out




def warn_one_row_slices(values: Dict[str, List[str]]) -> None:
    """Rank 0: a warning naming the slices of a single row (their metrics mean little)."""
    single = one_row_slices(values)
    if single and ranks.is_main_process():
        warn(f"--slice-by: {len(single)} slice(s) of a single row ({', '.join(single[:5])}"
             f"{', ...' if len(single) > 5 else ''}): their metrics mean little, and they get no interval")
