"""``--limit N --limit-seed S``: a seeded random sample of N rows, without replacement.

Rows are chosen by a stable key of their content (a keyed hash of the task's columns:
text, text pair, label), never by position: the same rows for any number of ranks and
any order of the data files. The N rows with the smallest keys are kept, in key order,
so the sample is also in the same order whatever the order of the files. Rows with the
same content have the same key: which of two identical rows is kept does not matter.
"""
from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Sequence as SequenceABC
from dataclasses import asdict, dataclass, field, replace
from json.encoder import encode_basestring
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from dist_eval.chunks import chunk_rows
from dist_eval.data.groups import read_cluster_names, read_slice_values, warn_one_row_slices
from dist_eval.data.labels import TaskColumns, check_columns, column_values, label_names_of
from dist_eval.loop_facts import SampleFacts


def row_keys(columns: Sequence[Sequence], seed: int) -> np.ndarray:
    """uint64 key of each row: blake2b (8 bytes) of the row's values, keyed by ``seed``."""
    salt = int(seed).to_bytes(8, "little", signed=False)
    keyed = hashlib.blake2b(digest_size=8, key=salt)
    digests = digest_each(keyed, _encoded_rows(columns))
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64)


def _encoded_rows(columns: Sequence[Sequence]) -> List[bytes]:
    """Each row's bytes as ``json.dumps(values, ensure_ascii=False, default=str)`` gives them: a column
    of only texts (only ints) encoded by one C call over the column, then every row's text joined and
    encoded at once and split on the newlines JSON never leaves raw (issue 74: a call per row, and a
    ``str.encode`` per row, were most of the content keys' time). Any other value goes through the
    encoder itself, as before.
    """
    if not columns:
        return []
    encode = json.JSONEncoder(ensure_ascii=False, default=str).encode
    cells = []
    for values in columns:
        kinds = set(map(type, values))
        if kinds <= {str}:
            cells.append(map(encode_basestring, values))
        elif kinds <= {int}:  # exactly int: a bool (its subclass) is true/false
            cells.append(map(int.__repr__, values))
        else:
            cells.append(map(encode, values))
    template = "[" + ", ".join(["%s"] * len(columns)) + "]"
    joined = "\n".join(map(template.__mod__, zip(*cells)))
    return joined.encode().split(b"\n") if len(columns[0]) else []


def digest_each(base, rows: Iterable[bytes]) -> bytes:
    """The digests of ``base`` (a hashlib state, copied for each) updated with each row's bytes,
    joined: one state built once, not one per row.
    """
    copy = base.copy

    def digest(data: bytes) -> bytes:
        row = copy()
        row.update(data)
        return row.digest()

    return b"".join(map(digest, rows))


def sample_indices(columns: Sequence[Sequence], limit: int, seed: int) -> np.ndarray:
    """Positions of the ``limit`` rows with the smallest keys, in key order (ties, i.e.
    identical rows, by position); every row when ``limit`` is 0 or at least the row count.
    """
    num_rows = len(columns[0]) if columns else 0
    if not limit or limit >= num_rows:
        return np.arange(num_rows)
    return key_order(columns, seed)[:limit]


def key_order(columns: Sequence[Sequence], seed: int) -> np.ndarray:
    """Every row's position, in the seeded content-hash order the --limit sample takes its
    rows from (a sample of n rows is the first n): the order a sequential evaluation sees.
    """
    keys = row_keys(columns, seed)
    return np.lexsort((np.arange(len(keys)), keys))  # by key, then by position


def dataset_keys(dataset, names: Sequence[str], seed: int) -> np.ndarray:
    """:func:`row_keys` of every row of a ``datasets.Dataset`` (its columns ``names``), read a chunk at a time
    (a chunk's values are Python objects, 100 bytes and more a row): only the keys are kept, 8 bytes a row.
    Those the ranks computed of this very dataset beside its token lengths (:func:`remember_keys`), if any.
    """
    if _keyed is not None:
        ref, fingerprint, keyed_names, keyed_seed, keys = _keyed
        if ref() is dataset and fingerprint == getattr(dataset, "_fingerprint", None) and \
                keyed_names == tuple(names) and keyed_seed == seed and len(keys) == len(dataset):
            return keys
    return range_keys(dataset, names, seed, 0, len(dataset))


def range_keys(dataset, names: Sequence[str], seed: int, start: int, stop: int) -> np.ndarray:
    """:func:`row_keys` of the rows [start, stop) of a ``datasets.Dataset``, read a chunk at a time."""
    chunk = chunk_rows("keys")
    parts = [row_keys(column_values(dataset, names, slice(first, min(first + chunk, stop))), seed)
             for first in range(start, stop, chunk)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint64)


# The keys of every row of the last dataset whose rows the ranks keyed beside their token lengths (issue 74:
# each rank its block, rank 0 gathering them): (the dataset, its fingerprint, the columns, the seed, the keys)
_keyed: Optional[tuple] = None


def remember_keys(dataset, names: Sequence[str], seed: int, keys: np.ndarray) -> None:
    """``keys`` are :func:`dataset_keys` of ``dataset``: what it returns for it from now on."""
    global _keyed
    _keyed = (weakref.ref(dataset), getattr(dataset, "_fingerprint", None), tuple(names), seed,
              np.asarray(keys, dtype=np.uint64))


def _dataset_key_order(dataset, names: Sequence[str], seed: int) -> np.ndarray:
    """:func:`key_order` of a dataset's rows, its values read a chunk at a time."""
    keys = dataset_keys(dataset, names, seed)
    return np.lexsort((np.arange(len(keys)), keys))


def sample_rows(dataset, limit: int, seed: int, columns: Sequence[str]):
    """The ``datasets.Dataset`` of the sampled rows (``dataset`` itself when ``limit`` is 0
    or covers every row); ``columns``: the task's columns whose values make a row's key.
    """
    if not limit or limit >= len(dataset):
        return dataset
    return dataset.select(_dataset_key_order(dataset, columns, seed)[:limit].tolist())


# the seed of a row's content key in predictions.jsonl (``key``): --limit's key at --limit-seed 0
CONTENT_KEY_SEED = 0


class HexKeys(SequenceABC):
    """uint64 keys read as a sequence of 16-hex-digit texts (big-endian), made as they are read."""

    def __init__(self, keys: np.ndarray):
        self.keys = np.asarray(keys, dtype=np.uint64)

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.texts(np.arange(len(self))[i])
        return f"{int(self.keys[i]):016x}"

    def __iter__(self):
        chunk = chunk_rows("lines")
        for start in range(0, len(self), chunk):
            yield from self.texts(np.arange(start, min(start + chunk, len(self))))

    def texts(self, rows: np.ndarray) -> List[str]:
        """The texts of the keys at ``rows``, made at once (numpy: a format per key was slower)."""
        return _hex_digits(self.keys[rows], b"", b"").astype(str).tolist()

    def json_cells(self, rows: np.ndarray) -> List[str]:
        """``json.dumps`` of each text at ``rows``, made at once: what predictions.jsonl writes."""
        return _hex_digits(self.keys[rows], b'"', b'"').astype(str).tolist()

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (list, tuple, HexKeys)) else NotImplemented

    __hash__ = None


_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def _hex_digits(keys: np.ndarray, before: bytes, after: bytes) -> np.ndarray:
    """Each key's 16 hex digits (big-endian, as ``f"{key:016x}"``) between ``before`` and ``after``, bytes."""
    octets = np.asarray(keys, dtype=">u8").view(np.uint8).reshape(-1, 8)
    width = len(before) + 16 + len(after)
    out = np.empty((len(octets), width), dtype=np.uint8)
    out[:, :len(before)] = np.frombuffer(before, dtype=np.uint8)
    out[:, width - len(after):] = np.frombuffer(after, dtype=np.uint8)
    out[:, len(before):len(before) + 16:2] = _HEX[octets >> 4]
    out[:, len(before) + 1:len(before) + 16:2] = _HEX[octets & 15]
    return out.view(f"S{width}").reshape(-1)


@dataclass
class Rows:
    """The rows an evaluation evaluates, drawn once (:func:`draw_rows`) and passed down whole: the
    ``--limit`` sample of the data (every row without one), in its evaluation order; with a run that
    stops early each row's place in the seeded key order (its rounds' order); each row's slice
    names and cluster (``--slice-by``, ``--cluster-by``: :mod:`dist_eval.data.groups`) and, when
    first asked, its content key (:attr:`keys`).
    """

    dataset: object  # a datasets.Dataset: the sample, in key order when drawn from a bigger set
    rows_in_data: int  # the rows of the data it was drawn from
    limit: int
    limit_seed: int
    order: Optional[np.ndarray] = None  # positions in ``dataset`` in the key order (a run in rounds)
    key_columns: Tuple[str, ...] = ()  # the task's columns a row's content key is made of
    slices: Dict[str, List[str]] = field(default_factory=dict)  # {column: each row's slice name}
    clusters: Optional[tuple] = None  # (the --cluster-by column, each row's cluster), or None
    grouped_by: tuple = (None, None)  # the (slice_by, cluster_by) that slices and clusters were read for
    _keys: Optional[HexKeys] = field(default=None, repr=False)
    _class_names: Dict[str, Optional[List[str]]] = field(default_factory=dict, repr=False)  # {label column: names}

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def keys(self) -> HexKeys:
        """Each row's content key, 16 hex digits: :func:`row_keys` of its task columns (text, label, text pair: the
        values the --limit sample keys a row by) at seed 0. Rows with the same content have the same key, whatever
        their place or file: ``dist_eval.compare`` pairs two runs' rows by it. A sequence of texts held as the 8-byte
        keys (:class:`HexKeys`), hashed once, when first asked (rank 0's report).
        """
        if self._keys is None:
            self._keys = HexKeys(dataset_keys(self.dataset, self.key_columns, CONTENT_KEY_SEED))
        return self._keys

    def class_names(self, label_column: str) -> Optional[List[str]]:
        """The set's class names (:func:`~dist_eval.data.labels.label_names_of` of its labels), read once, when
        first asked: the rounds of a run in rounds name their text labels as the whole set does.
        """
        if label_column not in self._class_names:
            self._class_names[label_column] = label_names_of(self.dataset, label_column)
        return self._class_names[label_column]

    def facts(self) -> dict:
        """What a report records of the sample (``run.sample``)."""
        return asdict(SampleFacts(self.limit, self.limit_seed, self.rows_in_data, len(self.dataset)))


def draw_rows(data, settings, options=None, in_key_order: bool = False) -> Rows:
    """The rows an evaluation of ``data`` (a ``datasets.Dataset``, or Rows already drawn) evaluates:
    its task columns (``settings``' text, pair and label columns) checked, one line naming the flag,
    then their ``settings.limit`` sample; with ``options`` (:class:`dist_eval.config.Options`), each
    row's slices and cluster. ``in_key_order``: every row's place in the key order too (a run in
    rounds). The one place rows are sampled or keyed by their content.
    """
    rows = data if isinstance(data, Rows) else None
    if rows is None or (in_key_order and rows.order is None):
        rows = _drawn(data, settings, in_key_order)
    grouped_by = (None, None) if options is None else (options.slice_by, options.cluster_by)
    if grouped_by != rows.grouped_by:
        rows = replace(rows, slices=read_slice_values(rows.dataset, grouped_by[0]), grouped_by=grouped_by,
                       clusters=None if grouped_by[1] is None else
                       (grouped_by[1], read_cluster_names(rows.dataset, grouped_by[1])))
        warn_one_row_slices(rows.slices)
    return rows


def _drawn(data, settings, in_key_order: bool) -> Rows:
    """:func:`draw_rows`' sample (and key order) of a Dataset, or of Rows drawn without the key order."""
    dataset = data.dataset if isinstance(data, Rows) else data
    columns = TaskColumns.of(settings)
    check_columns(dataset, columns)
    names = tuple(name for _, name in columns.named())
    num_rows, limit = len(dataset), settings.limit
    sampling = not isinstance(data, Rows) and bool(limit) and limit < num_rows
    order = None
    if sampling or in_key_order:
        order = _dataset_key_order(dataset, names, settings.limit_seed)
    if sampling:
        dataset, order = dataset.select(order[:limit].tolist()), np.arange(limit)
    rows_in_data = data.rows_in_data if isinstance(data, Rows) else num_rows
    return Rows(dataset, rows_in_data, limit, settings.limit_seed, order, names)
