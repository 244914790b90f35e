"""This rank's batches of a Dataset (planned globally, tokenized once); a user DataLoader's: loader.py."""
from __future__ import annotations

import tempfile
import weakref
from functools import partial
from itertools import chain
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np

from dist_eval import ranks
from dist_eval.chunks import chunk_rows
from dist_eval.data.batches import Batch, plan_batches, shard_batch_ids
from dist_eval.data.labels import TaskColumns
from dist_eval.data.tokenize import right_pad, trim_heap
from dist_eval.data.tokenize import tokenize_rows as tokenize_these_rows
from dist_eval.errors import UsageError


def _row_block(num_rows: int, rank: int, world_size: int) -> np.ndarray:
    """Rows [rank*n/N, (rank+1)*n/N): each rank measures one contiguous block of lengths."""
    return np.arange(rank * num_rows // world_size, (rank + 1) * num_rows // world_size, dtype=np.int64)


class _Spill:
    """int32 arrays appended to a temporary file on the local disk ($TMPDIR), unlinked as it is
    made (the kernel frees it when the process ends, however it ends), read back as one array
    mapped read-only: a rank's token ids are then the page cache's, not its heap's.
    """

    def __init__(self):
        self.file = tempfile.TemporaryFile(prefix="dist_eval-ids-")  # noqa: SIM115 (closed by array())
        self.count = 0

    def add(self, values: np.ndarray) -> None:
        data = np.ascontiguousarray(values, dtype=np.int32)
        self.file.write(data.tobytes())
        self.count += len(data)

    def array(self) -> np.ndarray:
        """Everything added, mapped (the file closed: the map keeps its own handle)."""
        with self.file:
            if not self.count:
                return np.zeros(0, dtype=np.int32)
            self.file.flush()
            return np.asarray(np.memmap(self.file, dtype=np.int32, mode="r", shape=(self.count,)))


def _spilled(parts) -> np.ndarray:
    """The int32 arrays ``parts``, one after the other, in a :class:`_Spill`."""
    spill = _Spill()
    for part in parts:
        spill.add(part)
    return spill.array()



class PackedIds:
    """Token ids of rows, packed: the rows (ascending), each one's start in one flat int32 array.
    A mapping for :func:`padded_batches` (``in``, ``pop``, ``update``): a row popped is gone; rows
    added by ``update`` (tokenized as their batches come) are held apart, as lists.
    """

    def __init__(self, rows: np.ndarray, sizes: np.ndarray, flat: np.ndarray):
        order = np.argsort(rows, kind="stable")
        if not np.array_equal(order, np.arange(len(rows))):  # received from several ranks: put in row order
            starts = np.concatenate([[0], np.cumsum(sizes)])[:-1]
            flat = np.concatenate([flat[starts[i]:starts[i] + sizes[i]] for i in order.tolist()]) if len(order) \
                else flat
            rows, sizes = rows[order], sizes[order]
        self.rows = np.asarray(rows, dtype=np.int64)
        self.starts = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self.starts[1:])
        self.flat = np.asarray(flat, dtype=np.int32)
        self.taken = np.zeros(len(rows), dtype=bool)
        self.extra: Dict[int, List[int]] = {}

    @classmethod
    def empty(cls) -> PackedIds:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int32))

    def __len__(self) -> int:
        return int((~self.taken).sum()) + len(self.extra)

    def sizes(self) -> np.ndarray:
        return np.diff(self.starts)

    def _position(self, row: int) -> int:
        """The row's place in ``rows``, or -1 (absent or popped)."""
        position = int(np.searchsorted(self.rows, row))
        if position < len(self.rows) and self.rows[position] == row and not self.taken[position]:
            return position
        return -1

    def __contains__(self, row: int) -> bool:
        return row in self.extra or self._position(row) >= 0

    def pop(self, row: int) -> List[int]:
        if row in self.extra:
            return self.extra.pop(row)
        position = self._position(row)
        if position < 0:
            raise KeyError(row)
        self.taken[position] = True
        return self.flat[self.starts[position]:self.starts[position + 1]].tolist()

    def take(self, rows: np.ndarray) -> List[List[int]]:
        """The ids of ``rows`` (each held), popped: a batch at a time."""
        if self.extra:
            return [self.pop(r) for r in rows.tolist()]
        positions = np.searchsorted(self.rows, rows)
        self.taken[positions] = True
        flat, starts = self.flat, self.starts
        return [flat[a:b].tolist() for a, b in zip(starts[positions].tolist(), starts[positions + 1].tolist())]

    def update(self, pairs) -> None:
        self.extra.update(pairs)

    def missing(self, rows: np.ndarray) -> np.ndarray:
        """Those of ``rows`` held neither packed nor apart (vectorized: a batch at a time)."""
        positions = np.minimum(np.searchsorted(self.rows, rows), max(len(self.rows) - 1, 0))
        packed = (self.rows[positions] == rows) & ~self.taken[positions] if len(self.rows) else \
            np.zeros(len(rows), dtype=bool)
        if self.extra:
            packed |= np.fromiter((r in self.extra for r in rows.tolist()), dtype=bool, count=len(rows))
        return rows[~packed]

    def select(self, keep: np.ndarray) -> PackedIds:
        """The rows of ``keep`` (a mask over ``rows``), packed anew (spilled, a chunk at a time)."""
        chunk = chunk_rows("tokenize")
        parts = (self.of_range(start, min(start + chunk, len(self.rows)), keep[start:start + chunk])[2]
                 for start in range(0, len(self.rows), chunk))
        return PackedIds(self.rows[keep], self.sizes()[keep], _spilled(parts))

    def of_range(self, start: int, stop: int, mask: np.ndarray) -> tuple:
        """(rows, sizes, flat ids) of the rows at places [start, stop) where ``mask`` (over those
        places) holds: what travels.
        """
        sizes = np.diff(self.starts[start:stop + 1])
        flat = self.flat[self.starts[start]:self.starts[stop]]
        return self.rows[start:stop][mask], sizes[mask].astype(np.int64), flat[np.repeat(mask, sizes)]


def tokenize_packed(dataset, tokenize_rows: Callable, rows: np.ndarray, columns: TaskColumns, max_length: int,
                    pad_token_id: int) -> Tuple[PackedIds, int]:
    """(the token ids of ``rows``, packed; how many were truncated): tokenized a chunk of rows at a time,
    in row order (the first bad row of ``rows`` is refused first), the heap trimmed afterwards.
    """
    sizes, spill, num_truncated, chunk = [], _Spill(), 0, chunk_rows("tokenize")
    for start in range(0, len(rows), chunk):
        ids, truncated = tokenize_rows(dataset, rows[start:start + chunk], columns, max_length, pad_token_id)
        num_truncated += truncated
        chunk_sizes = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        sizes.append(chunk_sizes)
        spill.add(np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(chunk_sizes.sum())))
        del ids
    trim_heap()
    flat = spill.array()
    if not sizes:
        return PackedIds.empty(), 0
    return PackedIds(np.asarray(rows, dtype=np.int64), np.concatenate(sizes), flat), num_truncated


# The last set whose every row's token count a plan measured: (the dataset, its fingerprint, the
# tokenizer, the columns, max_length, the lengths), so that --slice-by's length quartiles read them
# rather than tokenize every row again (dist_eval.slices.length_quartiles)
_measured: Optional[tuple] = None


def _remember_lengths(dataset, tokenizer, columns: TaskColumns, max_length: int, lengths: np.ndarray) -> None:
    global _measured
    _measured = (weakref.ref(dataset), getattr(dataset, "_fingerprint", None), tokenizer, columns, max_length, lengths)


def token_lengths(dataset, tokenizer, settings, calling_the_base: frozenset = frozenset()) -> np.ndarray:
    """Every row's token count (truncated to ``settings.max_length``), int64: those the batch plan of
    this very dataset, tokenizer and settings measured, else counted a chunk at a time (only the
    counts kept: 8 bytes a row).
    """
    columns, max_length = TaskColumns.of(settings), settings.max_length
    if _measured is not None:
        ref, fingerprint, measured_by, measured_columns, measured_length, lengths = _measured
        if ref() is dataset and fingerprint == getattr(dataset, "_fingerprint", None) and measured_by is tokenizer \
                and measured_columns == columns and measured_length == max_length and len(lengths) == len(dataset):
            return lengths.astype(np.int64)
    counts, chunk = [], chunk_rows("tokenize")
    rows = np.arange(len(dataset), dtype=np.int64)
    for start in range(0, len(rows), chunk):
        ids, _ = tokenize_these_rows(tokenizer, dataset, rows[start:start + chunk], columns, max_length, -1,
                                     calling_the_base)
        counts.append(np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)))
        del ids
    trim_heap()
    return np.concatenate(counts) if counts else np.zeros(0, np.int64)


def _token_lengths(dataset, tokenize_rows: Callable, columns: TaskColumns, num_rows: int, max_length: int,
                   pad_token_id: int):
    """Every row's token count, on every rank: each rank tokenizes one contiguous block of
    rows (a chunk at a time) and the lengths are all-gathered (4 bytes a row). Returns (lengths,
    the packed ids of this rank's block, rows of the block truncated). Every rank must call it.
    """
    block = _row_block(num_rows, ranks.get_rank(), ranks.get_world_size())
    with ranks.phase("measuring the token lengths"):
        ids, num_truncated = tokenize_packed(dataset, tokenize_rows, block, columns, max_length, pad_token_id)
    local_lengths = ids.sizes().astype(np.int32)
    lengths = np.concatenate(ranks.all_gather_object(local_lengths))  # blocks are in rank order
    if len(dataset) == num_rows:
        _key_rows(dataset, columns, block)
    return lengths, ids, num_truncated


def _key_rows(dataset, columns: TaskColumns, block: np.ndarray) -> None:
    """Every row's content key (:func:`~dist_eval.data.sample.dataset_keys`, which the report writes in
    predictions.jsonl), each rank keying its block of rows, rank 0 gathering them (8 bytes a row) for
    the report: the hashing shared by the ranks, not rank 0's alone in the report (issue 74). Every rank
    must call it.
    """
    from dist_eval.data.sample import CONTENT_KEY_SEED, range_keys, remember_keys

    names = [name for _, name in columns.named()]
    with ranks.phase("keying the rows"):
        start, stop = (int(block[0]), int(block[-1]) + 1) if len(block) else (0, 0)
        keys = range_keys(dataset, names, CONTENT_KEY_SEED, start, stop)
        gathered = ranks.gather_arrays_to_main({"keys": keys.view(np.int64)})
    if gathered is not None:
        remember_keys(dataset, names, CONTENT_KEY_SEED, gathered["keys"].view(np.uint64))


def _row_owners(planned: List[np.ndarray], num_rows: int, plan_ids: List[int]) -> np.ndarray:
    """The rank whose batches (of ``plan_ids``) hold each row."""
    owners = np.zeros(num_rows, dtype=np.int64)
    world_size = ranks.get_world_size()
    for rank in range(1, world_size):
        ids = [plan_ids[i] for i in shard_batch_ids(len(plan_ids), rank, world_size)]
        if ids:
            owners[np.concatenate([planned[b] for b in ids])] = rank
    return owners


def _send_to_owners(by_row: PackedIds, planned: List[np.ndarray], num_rows: int,
                    plan_ids: List[int]) -> PackedIds:
    """The token ids of this rank's block, each row sent to the rank whose batches hold it;
    returns those of this rank's own rows. Rows travel packed: (row indices, lengths, one
    flat int32 array of ids), which pickles in a fraction of a list of lists' time; in rounds of
    chunk_rows("exchange") rows of each block (the same number of rounds on every rank: a round's pickles
    and buffers, not the block's).
    """
    world_size = ranks.get_world_size()
    if world_size == 1:  # every row is this rank's already
        return by_row
    owners = _row_owners(planned, num_rows, plan_ids)[by_row.rows]
    block = -(-num_rows // world_size)  # the largest block's rows
    rows: List[List[np.ndarray]] = [[] for _ in range(world_size)]
    sizes: List[List[np.ndarray]] = [[] for _ in range(world_size)]
    spills = [_Spill() for _ in range(world_size)]  # each source's ids, as they come
    chunk = chunk_rows("exchange")
    for start in range(0, max(block, 1), chunk):
        stop = min(start + chunk, len(owners))
        outgoing = [by_row.of_range(start, stop, owners[start:stop] == rank) if start < stop else
                    (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int32)) for rank in range(world_size)]
        for source, (part_rows, part_sizes, part_ids) in enumerate(ranks.exchange_objects(outgoing)):
            rows[source].append(part_rows)
            sizes[source].append(part_sizes)
            spills[source].add(part_ids)
        del outgoing
    del by_row, owners
    # each source's rows ascending, the sources' blocks in rank order: the rows ascending
    arrays, copy = (spill.array() for spill in spills), chunk_rows("copy_tokens")  # token ids copied at once
    flat = _spilled(ids[start:start + copy] for ids in arrays for start in range(0, len(ids), copy))
    trim_heap()
    return PackedIds(np.concatenate([part for parts in rows for part in parts]),
                     np.concatenate([part for parts in sizes for part in parts]), flat)


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
# Batches between two trims of the heap in the forwards (each a few milliseconds)
_TRIM_EVERY = 256


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
    by_row = PackedIds.empty()
    lengths, num_truncated = None, 0
    if settings.length_buckets or settings.max_batch_tokens is not None:
        lengths, by_row, num_truncated = _token_lengths(
            dataset, tokenize_rows, columns, num_rows, max_length, pad_token_id
        )
        _remember_lengths(dataset, tokenizer, columns, max_length, lengths)
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
        by_row = by_row.select(kept[by_row.rows])
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
        todo = np.unique(np.concatenate([planned[b] for b in batch_ids])) if batch_ids else np.zeros(0, np.int64)
        by_row, truncated_here = tokenize_packed(dataset, tokenize_rows, todo, columns, max_length, pad_token_id)
        num_truncated += truncated_here

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
    if count > len(planned):  # refused by every shard of the split, before any forward: none of it could merge
        raise UsageError(f"the set's batch plan has {len(planned)} batch(es), so shards {len(planned)} to {count - 1} "
                         f"of {count} would hold no row: expected at most {len(planned)} shards. Split it into fewer "
                         f"(K <= {len(planned)}).", param="shard", value=f"{index}/{count}")
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


def padded_batches(batch_ids: List[int], planned: List[np.ndarray], labels: np.ndarray,
                   by_row: Union[PackedIds, Dict[int, List[int]]], tokenize: Callable[[List[int]], List[List[int]]],
                   pad_token_id: int) -> Iterator[Batch]:
    """The batches ``batch_ids`` of the plan, right-padded, in order. ``by_row`` holds the
    token ids known so far (each is dropped once used); the rows missing there are given
    to ``tokenize`` as their batches come: those of the batch at hand and of the next
    ones, up to _AHEAD_ROWS rows, in one call.
    """
    for position, b in enumerate(batch_ids):
        if position % _TRIM_EVERY == 0:  # a batch's garbage (ids, tensors, results) freed, given back
            trim_heap()
        batch_rows = planned[b].tolist()
        if len(_missing(by_row, planned[b])):
            todo: List[int] = []
            for ahead in batch_ids[position:]:
                todo.extend(_missing(by_row, planned[ahead]).tolist())
                if len(todo) >= _AHEAD_ROWS:
                    break
            by_row.update(zip(todo, tokenize(todo)))
        ids = by_row.take(planned[b]) if isinstance(by_row, PackedIds) else [by_row.pop(r) for r in batch_rows]
        yield b, planned[b], right_pad(ids, pad_token_id), labels[planned[b]]


def _missing(by_row, rows: np.ndarray) -> np.ndarray:
    """Those of ``rows`` whose ids ``by_row`` does not hold, in their order."""
    if isinstance(by_row, PackedIds):
        return by_row.missing(rows)
    return np.array([r for r in rows.tolist() if r not in by_row], dtype=np.int64)
