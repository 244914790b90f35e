"""Everything dist_eval does with torch.distributed; each call is a no-op in one process.

- :mod:`~dist_eval.ranks.group`: join the process group torchrun described; rank, world size.
- :mod:`~dist_eval.ranks.collectives`: broadcast, gather, exchange, reduce (the only collectives).
- :mod:`~dist_eval.ranks.phases`: ``with phase(name):`` one rank's failure fails every rank.
- :mod:`~dist_eval.ranks.counters`: counters shared through the c10d store (progress).

Used as ``from dist_eval import ranks``: ``ranks.get_rank()``, ``with ranks.phase(name):``.
(Not named ``dist``: that is the usual name of a build's output folder, which tools and
ignore-file templates skip.)
"""
from dist_eval.ranks.collectives import (
    all_gather_object,
    all_reduce_sum,
    barrier,
    barrier_if_alive,
    broadcast_object,
    exchange_objects,
    gather_arrays_to_main,
)
from dist_eval.ranks.counters import new_shared_counter, shared_counter_add
from dist_eval.ranks.group import (
    destroy_process_group,
    get_rank,
    get_world_size,
    init_process_group_from_env,
    is_initialized,
    is_main_process,
    launched_by_torchrun,
    launched_on_several_nodes,
)
from dist_eval.ranks.phases import RankFailure, agree_on_failure, phase, phase_seconds

__all__ = [
    "all_gather_object", "all_reduce_sum", "barrier", "barrier_if_alive", "broadcast_object", "exchange_objects",
    "gather_arrays_to_main",
    "new_shared_counter", "shared_counter_add", "destroy_process_group", "get_rank", "get_world_size",
    "init_process_group_from_env", "is_initialized", "is_main_process", "launched_by_torchrun",
    "launched_on_several_nodes", "RankFailure", "agree_on_failure", "phase", "phase_seconds",
]
