"""Every torch.distributed call of dist_eval lives here; each is a no-op in one process.

Object collectives move pickled numpy arrays. With NCCL they go through the GPU, so
the CUDA device of each local rank is set before the first collective
(:func:`init_process_group_from_env` does it).
"""
from __future__ import annotations

import datetime
import os
from typing import Any, List, Optional

import numpy as np
import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def init_process_group_from_env(timeout_s: float) -> bool:
    """Join the process group that torchrun/SLURM described in the environment.

    Returns True when this call created the group (and so must destroy it). Does
    nothing when a group already exists (a training loop made it) or when the process
    was not launched by torchrun. The backend is NCCL when CUDA is available, else gloo.
    """
    if is_initialized() or not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return False
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return True


def destroy_process_group() -> None:
    if is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank."""
    if get_world_size() == 1:
        return obj
    box = [obj if get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> List[Any]:
    """One object from each rank, in rank order, on every rank."""
    if get_world_size() == 1:
        return [obj]
    out: List[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_object_to_main(obj: Any) -> Optional[List[Any]]:
    """One object from each rank, in rank order, on rank 0 only (None elsewhere).

    Only rank 0 holds the gathered per-sample arrays: one copy, not world_size copies.
    """
    if get_world_size() == 1:
        return [obj]
    out: Optional[List[Any]] = [None] * get_world_size() if get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_reduce_sum(values: np.ndarray) -> np.ndarray:
    """Element-wise float64 sum over ranks (counts stay exact below 2**53)."""
    local = np.asarray(values, dtype=np.float64)
    if get_world_size() == 1:
        return local.copy()
    tensor = torch.from_numpy(local.copy())
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.cpu().numpy()


class RankFailure(RuntimeError):
    """Raised on every rank when one or more ranks failed a phase.

    ``usage`` is True when every failure was a :class:`dist_eval.errors.UsageError`
    (the user can fix it), so the CLI prints one line instead of a traceback.
    """

    def __init__(self, phase: str, failures: List[tuple], world_size: int):
        self.phase = phase
        self.failures = failures  # [(rank, kind, message)]
        self.usage = all(kind == "usage" for _, kind, _ in failures)
        rank, _, message = failures[0]
        where = f"rank {rank}: " if world_size > 1 and len(failures) < world_size else ""
        others = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 and where else ""
        super().__init__(f"{where}{message}{others}")


def agree_on_failure(phase: str, local_error: Optional[BaseException]) -> None:
    """Every rank calls this after a phase; if any rank failed, every rank raises.

    This is what keeps one rank's failure (a missing column, a swarm error) from
    leaving the others waiting in the next collective until the timeout.
    """
    from dist_eval.errors import UsageError

    if local_error is None:
        report = None
    elif isinstance(local_error, UsageError):
        report = ("usage", str(local_error))
    else:
        report = ("internal", f"{phase} failed: {type(local_error).__name__}: {local_error}")
    reports = all_gather_object(report)
    failures = [(rank, r[0], r[1]) for rank, r in enumerate(reports) if r is not None]
    if failures:
        failure = RankFailure(phase, failures, get_world_size())
        if local_error is not None:
            raise failure from local_error
        raise failure
