"""This node's other ranks, as processes: who says what when a rank has died.

torchrun's workers on a node are children of one agent process. When one of them dies,
the agent stops the others with SIGTERM; if the dead one was rank 0 (which alone prints
the run's error line), the others would exit silently. Each rank notes its siblings'
pids at the start; a stopped rank can then tell that rank 0 is gone, and the lowest
surviving rank of rank 0's node says so, once.
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

from dist_eval.procs import is_running, proc_stat

# rank -> (pid, start time in clock ticks since boot: with the pid, one process)
Siblings = Dict[int, Tuple[int, str]]


def _rank_of(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return int(env[b"RANK"])
    except (OSError, KeyError, ValueError):
        return None


def sibling_ranks() -> Siblings:
    """The ranks on this node (this process included): the agent's children that have a RANK.
    Empty where /proc cannot tell (not Linux, or not launched by torchrun).
    """
    if "RANK" not in os.environ or not os.path.isdir("/proc"):
        return {}
    agent, found = os.getppid(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        rest = proc_stat(int(entry)) or []
        if len(rest) > 19 and int(rest[1]) == agent:
            rank = _rank_of(int(entry))
            if rank is not None:
                found[rank] = (int(entry), rest[19])
    return found


def dead_main_rank(siblings: Siblings, my_rank: int) -> Optional[int]:
    """Rank 0's pid if it ran on this node, has died, and this rank is the lowest one of
    the node still alive (so that one rank reports it); else None.
    """
    if my_rank == 0 or 0 not in siblings or is_running(*siblings[0]):
        return None
    lower_alive = [r for r, proc in siblings.items() if 0 < r < my_rank and is_running(*proc)]
    return None if lower_alive else siblings[0][0]
