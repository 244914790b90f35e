"""Stored rows in memory: a key folder's rows as sorted columns (:class:`StoredRows`: found by key, the newest
copy of a row kept), and a run's rows' values by row index (:class:`RowValues`).
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

from dist_eval.rowstore.keys import KEY_BYTES


class StoredRows:
    """The rows read from a store's files as columns (issue 51: about 24 bytes and the logits a row,
    not a dict entry of objects): the keys sorted (one copy of each: the newest), their logits,
    seconds and servers. A mapping {row key (bytes): (logits, seconds, servers)} as well.
    """

    def __init__(self, keys: np.ndarray, logits: np.ndarray, seconds: np.ndarray, which: np.ndarray, sets: list):
        self.keys, self.logits, self.seconds, self.which, self.sets = keys, logits, seconds, which, sets

    @classmethod
    def empty(cls, num_labels: int) -> StoredRows:
        return cls(np.zeros(0, f"V{KEY_BYTES}"), np.zeros((0, num_labels), "<f4"), np.zeros(0, "<f4"),
                   np.zeros(0, np.int32), [()])

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self):
        return (bytes(key) for key in self.keys)

    def _position(self, key: bytes) -> int:
        at = int(np.searchsorted(self.keys, np.void(key)))
        if at == len(self.keys) or bytes(self.keys[at]) != key:
            raise KeyError(key)
        return at

    def __contains__(self, key) -> bool:
        try:
            self._position(key)
        except KeyError:
            return False
        return True

    def __getitem__(self, key: bytes) -> tuple:
        at = self._position(key)
        return self.logits[at], float(self.seconds[at]), self.sets[self.which[at]]

    def joined(self, newer: list) -> StoredRows:
        """These rows and ``newer`` files' columns (:func:`read_columns`), oldest first: a row's newest copy kept."""
        sets = list(self.sets)
        which = [self.which]
        for _, _, _, part_which, part_sets in newer:
            which.append(np.asarray(part_which, np.int64) + len(sets))
            sets.extend(part_sets)
        keys = np.concatenate([self.keys, *(np.ascontiguousarray(part[0]).view(f"V{KEY_BYTES}").ravel()
                                            for part in newer)])
        order = np.argsort(keys, kind="stable")  # equal keys stay oldest first
        last = np.ones(len(order), dtype=bool)
        last[:-1] = keys[order[1:]] != keys[order[:-1]]
        kept = order[last]
        del order, last

        def column(mine, index):
            return np.concatenate([mine, *(part[index] for part in newer)])[kept]

        return StoredRows(keys[kept], column(self.logits, 1), column(self.seconds, 2),
                          np.concatenate(which)[kept].astype(np.int32), sets)

    def without_servers(self, blamed: set) -> StoredRows:
        """These rows but those a server of ``blamed`` computed."""
        bad = np.array([bool(blamed.intersection(servers)) for servers in self.sets])
        kept = ~bad[self.which]
        return StoredRows(self.keys[kept], self.logits[kept], self.seconds[kept], self.which[kept], self.sets)

    def find(self, keys: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(the rows of ``keys`` [n, 16] held here, ascending; each one's position here)."""
        wanted = np.ascontiguousarray(keys, dtype=np.uint8).view(f"V{KEY_BYTES}").ravel()
        if not len(self.keys):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        at = np.minimum(np.searchsorted(self.keys, wanted), len(self.keys) - 1)
        rows = np.flatnonzero(self.keys[at] == wanted)
        return rows, at[rows]


class RowValues:
    """{row of the set: one stored row's value} of :meth:`StoredRows.find`'s rows (a mapping by row,
    as :class:`dict`: ``in``, ``[]``, ``len``): the rows' positions in the columns, 4 bytes a row of the set.
    """

    def __init__(self, values: np.ndarray, slots: np.ndarray, count: int, as_float: bool = False):
        self.values, self.slots, self.count, self.as_float = values, slots, count, as_float

    @classmethod
    def of(cls, stored: StoredRows, rows: np.ndarray, positions: np.ndarray, num_rows: int) -> tuple:
        """(the logits by row, the seconds by row) of the ``rows`` held at ``positions``."""
        slots = np.full(num_rows, -1, dtype=np.int32 if len(stored) < 2**31 else np.int64)
        slots[rows] = positions
        return cls(stored.logits, slots, len(rows)), cls(stored.seconds, slots, len(rows), as_float=True)

    def __len__(self) -> int:
        return self.count

    def __contains__(self, row) -> bool:
        return 0 <= row < len(self.slots) and self.slots[row] >= 0

    def __getitem__(self, row):
        if row not in self:
            raise KeyError(row)
        value = self.values[self.slots[row]]
        return float(value) if self.as_float else value
