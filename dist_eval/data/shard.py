"""This rank's batches of a Dataset (planned globally, tokenized once); a user DataLoader's: loader.py."""
from __future__ import annotations

from typing import Dict, Iterator, List, Tuple

import numpy as np

from dist_eval import ranks
from dist_eval.data.batches import plan_batches, shard_batch_ids
from dist_eval.data.labels import TaskColumns
from dist_eval.data.tokenize import right_pad, tokenize_rows
from dist_eval.predict import Batch


def _row_block(num_rows: int, rank: int, world_size: int) -> np.ndarray:
    """Rows [rank*n/N, (rank+1)*n/N): each rank measures one contiguous block of lengths."""
    return np.arange(rank * num_rows // world_size, (rank + 1) * num_rows // world_size, dtype=np.int64)


def _token_lengths(dataset, tokenizer, columns: TaskColumns, num_rows: int, max_length: int, pad_token_id: int):
    """Every row's token count, on every rank: each rank tokenizes one contiguous block of
    rows and the lengths are all-gathered (4-8 bytes a row). Returns (lengths, {row: ids}
    of this rank's block, rows of the block truncated). Every rank must call it.
    """
    block = _row_block(num_rows, ranks.get_rank(), ranks.get_world_size())
    with ranks.phase("measuring the token lengths"):
        ids, num_truncated = tokenize_rows(tokenizer, dataset, block, columns, max_length, pad_token_id)
    local_lengths = np.fromiter((len(x) for x in ids), dtype=np.int32, count=len(ids))
    lengths = np.concatenate(ranks.all_gather_object(local_lengths))  # blocks are in rank order
    return lengths, dict(zip(block.tolist(), ids)), num_truncated


def dataset_batches(
    dataset, tokenizer, labels: np.ndarray, settings, *, pad_token_id: int, prefix_tokens: int = 0
) -> Tuple[Iterator[Batch], int, Dict[int, np.ndarray]]:
    """This rank's batches of a Dataset: (iterator of right-padded batches, rows truncated
    here, {batch id: row indices} of this rank's batches).

    ``settings`` is a :class:`dist_eval.config.Settings`. Every rank calls it (it holds
    collectives). Tokenisation happens once, up front, so it never stalls the forwards.
    With length buckets or a token budget the global batch plan needs every row's token
    count (:func:`_token_lengths`); each rank then tokenizes only the rows of its own
    batches that its block of lengths did not cover.
    """
    columns, max_length = TaskColumns.of(settings), settings.max_length
    num_rows = len(labels)
    known_ids: Dict[int, List[int]] = {}
    lengths, num_truncated = None, 0
    if settings.length_buckets or settings.max_batch_tokens is not None:
        lengths, known_ids, num_truncated = _token_lengths(
            dataset, tokenizer, columns, num_rows, max_length, pad_token_id
        )
    planned = plan_batches(
        num_rows, settings.batch_size, lengths, settings.max_batch_tokens,
        length_buckets=settings.length_buckets, prefix_tokens=prefix_tokens,
    )
    batch_ids = shard_batch_ids(len(planned), ranks.get_rank(), ranks.get_world_size())
    rows = np.concatenate([planned[b] for b in batch_ids]) if batch_ids else np.zeros(0, np.int64)
    todo = np.array([r for r in rows.tolist() if r not in known_ids], dtype=np.int64)
    ids, truncated_here = tokenize_rows(tokenizer, dataset, todo, columns, max_length, pad_token_id)
    if lengths is None:  # else each row's truncation was counted once, in its block
        num_truncated = truncated_here
    by_row = {r: known_ids.get(r) for r in rows.tolist()}
    by_row.update(zip(todo.tolist(), ids))
    known_ids.clear()

    def generate() -> Iterator[Batch]:
        for b in batch_ids:
            batch_rows = planned[b]
            yield b, batch_rows, right_pad([by_row[r] for r in batch_rows.tolist()], pad_token_id), labels[batch_rows]

    return generate(), num_truncated, {b: planned[b] for b in batch_ids}
