"""This rank's batches of a Dataset (planned globally, tokenized once); a user DataLoader's: loader.py."""
from __future__ import annotations

from functools import partial
from itertools import chain
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from dist_eval import ranks
from dist_eval.data.batches import Batch, plan_batches, shard_batch_ids
from dist_eval.data.labels import TaskColumns
from dist_eval.data.tokenize import cyclic_gc_paused, right_pad
from dist_eval.data.tokenize import tokenize_rows as tokenize_these_rows
from dist_eval.errors import UsageError


def _row_block(num_rows: int, rank: int, world_size: int) -> np.ndarray:
    """Rows [rank*n/N, (rank+1)*n/N): each rank measures one contiguous block of lengths."""
    return np.arange(rank * num_rows // world_size, (rank + 1) * num_rows // world_size, dtype=np.int64)


def _token_lengths(dataset, tokenize_rows: Callable, columns: TaskColumns, num_rows: int, max_length: int,
                   pad_token_id: int):
    """Every row's token count, on every rank: each rank tokenizes one contiguous block of
    rows and the lengths are all-gathered (4-8 bytes a row). Returns (lengths, {row: ids}
    of this rank's block, rows of the block truncated). Every rank must call it.
    """
    block = _row_block(num_rows, ranks.get_rank(), ranks.get_world_size())
    with ranks.phase("measuring the token lengths"):
        ids, num_truncated = tokenize_rows(dataset, block, columns, max_length, pad_token_id)
    local_lengths = np.fromiter((len(x) for x in ids), dtype=np.int32, count=len(ids))
    lengths = np.concatenate(ranks.all_gather_object(local_lengths))  # blocks are in rank order
    return lengths, dict(zip(block.tolist(), ids)), num_truncated


def _row_owners(planned: List[np.ndarray], num_rows: int, plan_ids: List[int]) -> np.ndarray:
    """The rank whose batches (of ``plan_ids``) hold each row."""
    owners = np.zeros(num_rows, dtype=np.int64)
    world_size = ranks.get_world_size()
    for rank in range(1, world_size):
        ids = [plan_ids[i] for i in shard_batch_ids(len(plan_ids), rank, world_size)]
        if ids:
            owners[np.concatenate([planned[b] for b in ids])] = rank
    return owners


def _send_to_owners(by_row: Dict[int, List[int]], planned: List[np.ndarray], num_rows: int,
                    plan_ids: List[int]) -> Dict[int, List[int]]:
    """The token ids of this rank's block, each row sent to the rank whose batches hold it;
    returns those of this rank's own rows. Rows travel packed: (row indices, lengths, one
    flat int32 array of ids), which pickles in a fraction of a list of lists' time.
    """
    if ranks.get_world_size() == 1:  # every row is this rank's already
        return by_row
    owners = _row_owners(planned, num_rows, plan_ids)
    rows = np.fromiter(by_row, dtype=np.int64, count=len(by_row))
    outgoing = []
    for rank in range(ranks.get_world_size()):
        picked = rows[owners[rows] == rank].tolist()
        sequences = [by_row[r] for r in picked]
        sizes = np.fromiter(map(len, sequences), dtype=np.int64, count=len(picked))
        flat = np.fromiter(chain.from_iterable(sequences), dtype=np.int32, count=int(sizes.sum()))
        outgoing.append((np.asarray(picked, dtype=np.int64), sizes, flat))
    mine: Dict[int, List[int]] = {}
    for picked, sizes, flat in ranks.exchange_objects(outgoing):
        ends = np.cumsum(sizes)
        with cyclic_gc_paused():  # a list per row
            mine.update((row, flat[end - size:end].tolist())
                        for row, size, end in zip(picked.tolist(), sizes.tolist(), ends.tolist()))
    return mine


def _plan(rows, settings, lengths: Optional[np.ndarray], prefix_tokens: int) -> List[np.ndarray]:
    """The global plan of ``rows`` (a count: every row; or the row indices planned)."""
    if isinstance(rows, int):
        return plan_batches(rows, settings.batch_size, lengths, settings.max_batch_tokens,
                            length_buckets=settings.length_buckets, prefix_tokens=prefix_tokens)
    planned = plan_batches(len(rows), settings.batch_size, None if lengths is None else lengths[rows],
                           settings.max_batch_tokens, length_buckets=settings.length_buckets,
                           prefix_tokens=prefix_tokens)
    return [rows[b] for b in planned]


# Rows tokenized at once as the batches come (see dataset_batches): the rows of the next
# batches up to this many, so that each read of the dataset serves several batches.
_AHEAD_ROWS = 256


def dataset_batches(
    dataset, tokenizer, labels: np.ndarray, settings, *, pad_token_id: int, prefix_tokens: int = 0,
    on_plan: Optional[Callable[[List[int], List[int]], None]] = None, skip_rows: Optional[np.ndarray] = None,
    calling_the_base: frozenset = frozenset(), shard: Optional[Tuple[int, int]] = None,
    on_shard: Optional[Callable[[np.ndarray], None]] = None,
) -> Tuple[Iterator[Batch], int, Dict[int, np.ndarray]]:
    """This rank's batches of a Dataset: (iterator of right-padded batches, rows truncated
    here, {batch id: row indices} of this rank's batches).

    ``settings`` is a :class:`dist_eval.config.Settings`. Every rank calls it (it holds
    collectives). With length buckets or a token budget the global batch plan needs every
    row's token count (:func:`_token_lengths`: each rank tokenizes one block of rows, which
    checks every row and counts the truncated ones); each block's token ids then go to the
    ranks whose batches hold their rows (:func:`_send_to_owners`), so a row is tokenized
    once per run. Without the lengths, every row of the shard is tokenized (so checked)
    here, before any forward. ``on_plan(rows, padded tokens)`` of every batch of the global
    plan, in plan order, when the lengths are known (the progress's ETA counts that work).
    ``skip_rows`` (the same on every rank): rows the plan leaves out (the row store holds them);
    they are still tokenized where their truncation is counted. ``calling_the_base``: see
    :func:`~dist_eval.data.tokenize.tokenize_rows`.

    ``shard`` = (I, K): only the rows of shard I of K (:func:`shard_of_plan`: the batches of the
    whole set's plan dealt to it, kept whole with their ids, so each row's logits are those of a
    run over every row), given to ``on_shard`` (sorted); the truncated rows counted are its own.
    """
    tokenize_rows = partial(tokenize_these_rows, tokenizer, calling_the_base=calling_the_base)
    columns, max_length = TaskColumns.of(settings), settings.max_length
    num_rows = len(labels)
    by_row: Dict[int, List[int]] = {}
    lengths, num_truncated = None, 0
    if settings.length_buckets or settings.max_batch_tokens is not None:
        lengths, by_row, num_truncated = _token_lengths(
            dataset, tokenize_rows, columns, num_rows, max_length, pad_token_id
        )
    whole, inside, skip_rows = None, None, np.zeros(0, np.int64) if skip_rows is None else skip_rows
    if shard is not None:
        whole, plan_ids, inside = shard_of_plan(_plan(num_rows, settings, lengths, prefix_tokens), num_rows, shard)
        skip_rows = skip_rows[inside[skip_rows]]  # the stored rows of this shard
        if on_shard is not None:
            on_shard(np.flatnonzero(inside))
        if lengths is not None:  # the truncated rows of this shard (of this rank's block): only they are counted
            num_truncated = _truncated_in_block(dataset, tokenize_rows, columns, settings, pad_token_id,
                                                lengths, inside)
    kept = None if inside is None else inside.copy()  # None: every row
    if len(skip_rows):
        kept = np.ones(num_rows, dtype=bool) if kept is None else kept
        kept[skip_rows] = False
        if lengths is None:  # their truncation, counted on the rank of their block (as with the lengths)
            mine = skip_rows[_row_block(len(skip_rows), ranks.get_rank(), ranks.get_world_size())]
            num_truncated += tokenize_rows(dataset, np.sort(mine), columns, max_length, pad_token_id)[1]
    if kept is not None:
        by_row = {r: ids for r, ids in by_row.items() if kept[r]}
    if whole is not None and not len(skip_rows):  # the whole set's batches, their ids kept (resume, bits)
        planned = whole
    else:
        planned = _plan(num_rows if kept is None else np.flatnonzero(kept), settings, lengths, prefix_tokens)
        plan_ids = list(range(len(planned)))
    if on_plan is not None and lengths is not None:
        on_plan([len(planned[b]) for b in plan_ids],
                [len(planned[b]) * (int(lengths[planned[b]].max()) + prefix_tokens) for b in plan_ids])
    batch_ids = [plan_ids[i] for i in shard_batch_ids(len(plan_ids), ranks.get_rank(), ranks.get_world_size())]
    if lengths is not None:  # the block's rows go to the ranks whose batches hold them: no row tokenized twice
        by_row = _send_to_owners(by_row, planned, num_rows, plan_ids)
    else:
        todo = np.array(sorted({r for b in batch_ids for r in planned[b].tolist()}), dtype=np.int64)
        ids, truncated_here = tokenize_rows(dataset, todo, columns, max_length, pad_token_id)
        num_truncated += truncated_here
        by_row.update(zip(todo.tolist(), ids))

    def tokenize(rows: List[int]) -> List[List[int]]:
        return tokenize_rows(dataset, np.array(rows, dtype=np.int64), columns, max_length, pad_token_id)[0]

    batches = padded_batches(batch_ids, planned, labels, by_row, tokenize, pad_token_id)
    return batches, num_truncated, {b: planned[b] for b in batch_ids}


def shard_of_plan(planned: List[np.ndarray], num_rows: int, shard: Tuple[int, int]):
    """(the whole set's plan, the ids of shard I of K's batches in it, a mask of its rows): the
    plan's batches dealt to K shards as to K ranks (:func:`shard_batch_ids`: by cost, snake order),
    so the split depends only on the data and the settings, never on the ranks of any shard.
    """
    index, count = shard
    ids = shard_batch_ids(len(planned), index, count)
    if not ids:
        raise UsageError(f"the set's batch plan has {len(planned)} batch(es), so shard {index} of {count} would hold "
                         f"no row: expected at most {len(planned)} shards. Split it into fewer (K <= {len(planned)}).",
                         param="shard", value=f"{index}/{count}")
    inside = np.zeros(num_rows, dtype=bool)
    inside[np.concatenate([planned[b] for b in ids])] = True
    return planned, ids, inside


def _truncated_in_block(dataset, tokenize_rows: Callable, columns: TaskColumns, settings, pad_token_id: int,
                        lengths: np.ndarray, inside: np.ndarray) -> int:
    """The truncated rows of this rank's block of lengths that are in the shard: a truncated row
    is max_length tokens long, so only those rows are tokenized again to tell.
    """
    block = _row_block(len(lengths), ranks.get_rank(), ranks.get_world_size())
    maybe = block[inside[block] & (lengths[block] >= settings.max_length)]
    return tokenize_rows(dataset, maybe, columns, settings.max_length, pad_token_id)[1]


def padded_batches(batch_ids: List[int], planned: List[np.ndarray], labels: np.ndarray, by_row: Dict[int, List[int]],
                   tokenize: Callable[[List[int]], List[List[int]]], pad_token_id: int) -> Iterator[Batch]:
    """The batches ``batch_ids`` of the plan, right-padded, in order. ``by_row`` holds the
    token ids known so far (each is dropped once used); the rows missing there are given
    to ``tokenize`` as their batches come: those of the batch at hand and of the next
    ones, up to _AHEAD_ROWS rows, in one call.
    """
    for position, b in enumerate(batch_ids):
        batch_rows = planned[b].tolist()
        if any(r not in by_row for r in batch_rows):
            todo: List[int] = []
            for ahead in batch_ids[position:]:
                todo.extend(r for r in planned[ahead].tolist() if r not in by_row)
                if len(todo) >= _AHEAD_ROWS:
                    break
            by_row.update(zip(todo, tokenize(todo)))
        yield b, planned[b], right_pad([by_row.pop(r) for r in batch_rows], pad_token_id), labels[planned[b]]
