"""Joining: two runs' rows paired by content (:func:`join_by_content`), and what both must share row by row
(their clusters, their slices), refused where they differ.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from dist_eval.compare.read import RunOutputs
from dist_eval.errors import UsageError


def join_by_content(a: RunOutputs, b: RunOutputs) -> tuple:
    """(the positions in A of the rows B has too, their positions in B, in A's order; A's positions
    B has not; B's positions A has not), by each row's content key: the k-th row of a content in
    A is paired with the k-th of that content in B (identical rows are interchangeable).
    """
    def tagged(keys):
        seen: dict = {}
        out = []
        for key in keys:
            seen[key] = seen.get(key, 0) + 1
            out.append((key, seen[key]))
        return out

    in_b = {tag: j for j, tag in enumerate(tagged(b.keys))}
    pairs = [(i, in_b.pop(tag, -1)) for i, tag in enumerate(tagged(a.keys))]
    shared_a = np.array([i for i, j in pairs if j >= 0], dtype=np.int64)
    shared_b = np.array([j for _, j in pairs if j >= 0], dtype=np.int64)
    a_only = np.array([i for i, j in pairs if j < 0], dtype=np.int64)
    return shared_a, shared_b, a_only, np.array(sorted(in_b.values()), dtype=np.int64)


def shared_clusters(a: RunOutputs, b: RunOutputs) -> Optional[list]:
    """Each shared row's cluster when both runs have them (``--cluster-by``); refused where they differ."""
    if not a.clusters or not b.clusters:
        return None
    if a.clusters != b.clusters:
        first = next(i for i, (x, y) in enumerate(zip(a.clusters, b.clusters)) if x != y)
        raise UsageError(f"{a.folder} and {b.folder}: the clusters of row {a.indices[first]} differ "
                         f"({a.clusters[first]!r} vs {b.clusters[first]!r}): the runs were clustered by different "
                         "columns or are over "
                         "different data. Run both with the same --cluster-by.")
    return a.clusters


def shared_slices(a: RunOutputs, b: RunOutputs) -> Optional[list]:
    """Each shared row's slices, {column: value}, over the columns both runs sliced by (and
    where the two agree on every row: else the runs' data differ there, and it is refused). The
    token-length quartiles are of each run's whole set: left out where two sets cut them apart.
    """
    from dist_eval.slices import TOKEN_LENGTH_SLICES

    if not a.slices or not b.slices:
        return None
    columns = [column for column in a.slices[0] if column in b.slices[0]]
    if TOKEN_LENGTH_SLICES in columns and any(x[TOKEN_LENGTH_SLICES] != y[TOKEN_LENGTH_SLICES]
                                              for x, y in zip(a.slices, b.slices)):
        columns.remove(TOKEN_LENGTH_SLICES)
    cells = [{column: cell[column] for column in columns} for cell in a.slices]
    other = [{column: cell[column] for column in columns} for cell in b.slices]
    if cells != other:
        first = next(i for i, (x, y) in enumerate(zip(cells, other)) if x != y)
        raise UsageError(f"{a.folder} and {b.folder}: the slices of row {a.indices[first]} differ ({cells[first]} vs "
                         f"{other[first]}): the runs are over different data. Compare two runs of the same split.")
    return cells if columns else None
