"""This rank's batches of a user DataLoader, as the user's evaluation loop already has it.

Batches are dicts with ``input_ids`` (right-padded), ``labels`` and optionally
``attention_mask`` and ``index``. The row indices come from the loader's sampler, read
once for the epoch (``list(batch_sampler)``, so ``set_epoch`` is respected), not from the
batches:

- a ``DistributedSampler`` (``drop_last=False``): each rank evaluates its own shard; the
  repeats it pads its last round with (the shard positions past ``len(range(rank, n, N))``)
  are dropped before anything is counted;
- any other sampler, when every rank iterates the whole loader: rank 0's index batches are
  broadcast (so an unseeded shuffle cannot differ between ranks) and each rank keeps only
  its share of the batches (:func:`dist_eval.data.batches.shard_batch_ids`).

Either way a new DataLoader over the same dataset, ``collate_fn`` and workers loads only
this rank's index batches, so the rows and the indices cannot drift apart. The attention
mask is checked (its ones must form a prefix: right padding), then dropped: it is never
sent to a model. Each batch is cut to its longest real row (causal models and last-token
pooling give the same logits); a batch holding an all-zero row is sent uncut, since the
logits of a row with no real token depend on its padded length.

A loader whose indices cannot be known (an ``IterableDataset``, a custom
``batch_sampler``, ``batch_size=None``) is used only when its batches carry ``index``;
otherwise it is refused in one line, as are left padding and ``drop_last``.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from dist_eval import ranks
from dist_eval.data.batches import Batch, shard_batch_ids
from dist_eval.errors import UsageError

ARG = "data"


def readable_sampler(loader: DataLoader) -> Optional[str]:
    """None when the loader's row indices can be read from its sampler, else why not."""
    if isinstance(loader.dataset, IterableDataset):
        return "an IterableDataset has no sampler to read the row indices from"
    if type(loader.batch_sampler) is not BatchSampler:
        if loader.batch_sampler is None:
            return "batch_size=None (no batch sampler) gives no row indices"
        return f"a custom batch_sampler ({type(loader.batch_sampler).__name__}) whose indices cannot be known"
    return None


def index_batches(loader: DataLoader) -> Tuple[List[List[int]], Optional[int]]:
    """(this rank's index batches, the shard position from which rows are padding or None).

    Every rank must call it (a plain sampler's batches are broadcast from rank 0).
    """
    sampler = loader.batch_sampler.sampler
    if loader.batch_sampler.drop_last:
        raise UsageError("a DataLoader with drop_last=True skips rows; evaluate with drop_last=False.", param=ARG)
    if isinstance(sampler, DistributedSampler):
        world, rank = ranks.get_world_size(), ranks.get_rank()
        if sampler.drop_last:
            raise UsageError("DistributedSampler(drop_last=True) skips rows; use drop_last=False.", param=ARG)
        if (sampler.num_replicas, sampler.rank) != (world, rank):
            raise UsageError(
                f"DistributedSampler(num_replicas={sampler.num_replicas}, rank={sampler.rank}) does not match the "
                f"process group (world size {world}, rank {rank}).", param=ARG,
            )
        batches = [[int(i) for i in b] for b in loader.batch_sampler]  # one epoch, in order
        return batches, len(range(rank, len(sampler.dataset), world))
    batches = [[int(i) for i in b] for b in loader.batch_sampler] if ranks.is_main_process() else None
    batches = ranks.broadcast_object(batches)
    own = shard_batch_ids(len(batches), ranks.get_rank(), ranks.get_world_size())
    return [batches[b] for b in own], None


def rank_loader(loader: DataLoader, batches: List[List[int]]) -> DataLoader:
    """A DataLoader over the same dataset, collate_fn and workers that yields exactly ``batches``."""
    extra = {}
    if loader.num_workers > 0:
        extra = dict(
            prefetch_factor=loader.prefetch_factor, persistent_workers=False,
            multiprocessing_context=loader.multiprocessing_context, timeout=loader.timeout,
        )
    return DataLoader(
        loader.dataset, batch_sampler=batches, collate_fn=loader.collate_fn, num_workers=loader.num_workers,
        pin_memory=loader.pin_memory, worker_init_fn=loader.worker_init_fn, **extra,
    )


def real_width(input_ids: torch.Tensor, mask, batch_number: int) -> int:
    """The batch's longest real row (its width when a row is all padding); refuses left padding."""
    if mask is None:
        return input_ids.shape[1]
    mask = torch.as_tensor(mask)
    if mask.shape != input_ids.shape:
        raise UsageError(
            f"batch {batch_number}: attention_mask {tuple(mask.shape)} does not match input_ids "
            f"{tuple(input_ids.shape)}.", param=ARG,
        )
    mask = mask.ne(0)
    if mask.shape[1] > 1 and bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise UsageError(
            f"batch {batch_number}: the attention_mask is not right padding (its ones do not form a prefix of "
            "each row); tokenize with padding_side='right'.", param=ARG,
        )
    lengths = mask.sum(1)
    if len(lengths) == 0 or bool((lengths == 0).any()):
        return input_ids.shape[1]
    return int(lengths.max())


def _checked(batch, batch_number: int, need_index: bool):
    """(input_ids cut to the longest real row, labels) of one batch, after checking its keys."""
    needed = ("index", "input_ids", "labels") if need_index else ("input_ids", "labels")
    missing = [k for k in needed if not hasattr(batch, "keys") or k not in batch]
    if missing:
        raise UsageError(
            f"each batch must be a dict with 'input_ids' (right-padded) and 'labels' (and 'attention_mask' if any); "
            f"batch {batch_number} lacks {missing}.", param=ARG,
        )
    input_ids = torch.as_tensor(batch["input_ids"])
    width = real_width(input_ids, batch.get("attention_mask"), batch_number)
    return input_ids[:, :width], np.asarray(batch["labels"], dtype=np.int64)


def loader_batches(loader: DataLoader) -> Iterator[Batch]:
    """This rank's batches of a user DataLoader (see the module docstring). Every rank
    must call it (it may hold a broadcast); the batches are loaded lazily.
    """
    why_not = readable_sampler(loader)
    if why_not is not None:
        return _indexed_batches(loader, why_not)
    batches, padding_from = index_batches(loader)
    return _sampled_batches(rank_loader(loader, batches), batches, padding_from)


def _sampled_batches(loader: DataLoader, batches: List[List[int]], padding_from: Optional[int]) -> Iterator[Batch]:
    position = 0
    for batch_number, (batch, rows) in enumerate(zip(loader, batches)):
        rows = np.asarray(rows, dtype=np.int64)
        keep = np.ones(len(rows), dtype=bool)
        if padding_from is not None:
            keep = (position + np.arange(len(rows))) < padding_from
        position += len(rows)
        if not keep.any():
            continue
        input_ids, labels = _checked(batch, batch_number, need_index=False)
        if len(labels) != len(rows):
            raise UsageError(
                f"batch {batch_number} has {len(labels)} labels for the {len(rows)} rows its sampler gave.", param=ARG
            )
        yield batch_number, rows[keep], input_ids[torch.from_numpy(keep)], labels[keep]


def _indexed_batches(loader: DataLoader, why_not: str) -> Iterator[Batch]:
    """A loader whose sampler cannot be read: its batches must carry 'index'; each rank
    evaluates what its loader yields (it must be this rank's share, without repeats).
    """
    for batch_number, batch in enumerate(loader):
        if not hasattr(batch, "keys") or "index" not in batch:
            raise UsageError(f"the row indices cannot be known ({why_not}); give each batch 'index'.", param=ARG)
        input_ids, labels = _checked(batch, batch_number, need_index=True)
        yield batch_number, np.asarray(batch["index"], dtype=np.int64), input_ids, labels
