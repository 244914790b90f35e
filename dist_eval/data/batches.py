"""The global batch plan and its shards.

Why batches are sharded, not rows: a batch's composition (and so its padded length)
is then the same whatever the world size, and every sample's logits are bitwise
identical for N = 1, 2, 3, ... (row sharding would change which rows are padded
together, and could change the last bits of the logits and loss with N).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from dist_eval.chunks import chunk_rows

# One batch: (batch id in the global plan, global row indices [B], input_ids [B, T] or
# None when its logits are already stored (a resumed run), labels [B])
Batch = Tuple[int, np.ndarray, Optional[torch.Tensor], np.ndarray]


def known_batches(rows: np.ndarray, labels: np.ndarray, rows_per_batch: Optional[int] = None) -> List[Batch]:
    """``rows`` whose logits are known (the plan leaves them out: the row store holds them) as batches of
    their own (of ``rows_per_batch`` rows, by default ``chunk_rows("known")``), ids -1, -2, ... (no plan's),
    without token ids: the loop takes their logits as they are.
    """
    rows_per_batch = rows_per_batch or chunk_rows("known")
    return [(-1 - i, rows[start:start + rows_per_batch], None, labels[rows[start:start + rows_per_batch]])
            for i, start in enumerate(range(0, len(rows), rows_per_batch))]


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
        return [
            np.arange(start, min(start + batch_size, num_rows), dtype=np.int64)
            for start in range(0, num_rows, batch_size)
        ]
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.shape != (num_rows,):
        raise ValueError(f"lengths has shape {lengths.shape}, expected ({num_rows},)")
    rows = np.arange(num_rows, dtype=np.int64)
    order = np.lexsort((rows, -lengths)) if length_buckets else rows  # longest first; ties keep row order
    if max_batch_tokens is None:
        return [order[start : start + batch_size] for start in range(0, num_rows, batch_size)]
    if length_buckets:
        return _budgeted_longest_first(order, lengths[order], batch_size, max_batch_tokens, prefix_tokens)
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


def _budgeted_longest_first(order: np.ndarray, sorted_lengths: np.ndarray, batch_size: int, max_batch_tokens: int,
                            prefix_tokens: int) -> List[np.ndarray]:
    """The token budget's batches of rows sorted longest first, a step per batch (not per row): a
    batch's first row is its longest, so it holds min(batch_size, budget // (that length + prefix))
    rows, at least one; the rows are those the row-by-row rule of :func:`plan_batches` gives.
    """
    batches, start, num_rows = [], 0, len(order)
    while start < num_rows:
        padded = int(sorted_lengths[start]) + prefix_tokens
        fits = max(1, max_batch_tokens // padded) if padded > 0 else batch_size
        stop = min(num_rows, start + min(batch_size, fits))
        batches.append(order[start:stop])
        start = stop
    return batches


class _Length:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def snake_order(num_items: int, world_size: int) -> List[int]:
    """0..num_items-1 in rounds of ``world_size``, every other round reversed: 0, 1, 2, 5, 4, 3, 6, ...

    Dealt round-robin (position p to rank p % world_size), a list sorted by cost, largest
    first, then gives every rank a share of nearly the same total cost: the rank that took
    the largest item of one round takes the smallest of the next. Dealt in plain order,
    rank 0 would take the largest of every round, and the extra item of an odd last round.
    """
    order: List[int] = []
    for start in range(0, num_items, world_size):
        this_round = list(range(start, min(start + world_size, num_items)))
        order.extend(this_round if (start // world_size) % 2 == 0 else this_round[::-1])
    return order


def shard_batch_ids(num_batches: int, rank: int, world_size: int) -> List[int]:
    """This rank's batch ids, in plan order: its ``DistributedSampler`` shard (without the
    padding) of the plan's batch ids in :func:`snake_order`.

    The plan lists batches longest first, so the shards' costs then nearly match (dealt in
    plan order, rank 0 took the longest batch of every round, so the most work; the ranks'
    ends still differ by the servers' answers: benchmarks/RESULTS.md).
    DistributedSampler (drop_last=False) pads the id list to a multiple of the world
    size by repeating ids from its start; the padding lands at the end of each rank's
    shard. Those repeats are dropped here, before anything runs or is counted. A rank
    may get no batch at all (fewer batches than ranks); it still joins every collective.
    """
    if num_batches == 0:
        return []
    sampler = DistributedSampler(
        _Length(num_batches), num_replicas=world_size, rank=rank, shuffle=False, drop_last=False
    )
    padded_shard = list(sampler)
    # Position of shard element k in the padded list is rank + k * world_size.
    num_real = len(range(rank, num_batches, world_size))
    order = snake_order(num_batches, world_size)
    return sorted(order[position] for position in padded_shard[:num_real])
