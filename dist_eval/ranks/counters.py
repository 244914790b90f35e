"""Counters shared by every rank through the c10d store: no collective per update."""
from __future__ import annotations

from typing import Dict

from dist_eval.ranks.collectives import broadcast_object
from dist_eval.ranks.group import get_world_size

# Counters in one process (no store); keyed like the store's, so callers need not care.
_local_counters: Dict[str, int] = {}


def new_shared_counter(name: str) -> str:
    """The key of a fresh counter that every rank can add to (see :func:`shared_counter_add`).

    Every rank must call it, at the same point: rank 0 draws a run-unique key and
    broadcasts it (one collective), so a later run in the same group never sees old counts.
    """
    import uuid

    return broadcast_object(f"dist_eval/{name}/{uuid.uuid4().hex}")


def shared_counter_add(key: str, amount: int) -> int:
    """Add ``amount`` to the counter ``key`` shared by every rank and return its new total.

    Not a collective: one request to the process group's c10d key-value store (the one
    torchrun's rendezvous set up), so any rank may call it alone, at any time, from any
    thread; ``amount=0`` reads the total. In one process: a plain local counter.
    """
    if get_world_size() == 1:
        _local_counters[key] = _local_counters.get(key, 0) + int(amount)
        return _local_counters[key]
    from torch.distributed.distributed_c10d import _get_default_store

    return int(_get_default_store().add(key, int(amount)))
