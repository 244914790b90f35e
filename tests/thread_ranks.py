"""Ranks as threads of the test process, the collectives faked with a barrier: for the tests of
code that asks ``dist_eval.ranks`` who it is and swaps objects (tests/test_data_shard.py,
tests/test_shard_merge.py), without a process group."""
from __future__ import annotations

import threading


class ThreadRanks:
    """get_rank / get_world_size / all_gather_object / exchange_objects for ``size`` threads, each
    setting ``local.rank`` to its own."""

    def __init__(self, size: int = 2):
        self.size, self.local = size, threading.local()
        self.barrier, self.slots = threading.Barrier(size, timeout=60), [None] * size

    def rank(self):
        return getattr(self.local, "rank", 0)

    def _swap(self, obj):
        self.slots[self.rank()] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def all_gather_object(self, obj):
        return self._swap(obj)

    def exchange_objects(self, outgoing):
        return [sent[self.rank()] for sent in self._swap(outgoing)]
