"""Every torch.distributed call of dist_eval lives here; each is a no-op in one process.

Object collectives move pickled numpy arrays. With NCCL they go through the GPU, so
the CUDA device of each local rank is set before the first collective
(:func:`init_process_group_from_env` does it).
"""
from __future__ import annotations

import datetime
import os
from typing import Any, Dict, List, Optional

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


def launched_on_several_nodes() -> bool:
    """True when torchrun placed the ranks on more than one node (its LOCAL_WORLD_SIZE,
    the ranks of this node, is then below WORLD_SIZE)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return launched_by_torchrun() and int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world


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
        local_rank, visible = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= visible:
            from dist_eval.errors import UsageError

            raise UsageError(
                f"LOCAL_RANK {local_rank}: this node has {visible} visible CUDA device(s), and NCCL needs one "
                f"GPU per rank: start at most {visible} rank(s) per node (--nproc-per-node / NPROC_PER_NODE), "
                "or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on the CPU with gloo."
            )
        # Before the first collective: NCCL's object collectives use the current device,
        # and with the default (cuda:0) every rank of a node would share one GPU.
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return True


def destroy_process_group() -> None:
    if is_initialized():
        dist.destroy_process_group()


def barrier_if_alive() -> None:
    """A barrier on a failure path: every rank is known to be alive and here, but an
    error in the barrier itself must not hide the failure being reported."""
    try:
        barrier()
    except Exception:  # noqa: BLE001
        pass


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


def gather_arrays_to_main(arrays: Dict[str, np.ndarray]) -> Optional[Dict[str, np.ndarray]]:
    """Each array concatenated over ranks in rank order, on rank 0 only (None elsewhere).

    Every rank passes the same keys with the same dtypes and trailing shapes; lengths may
    differ (an empty shard is fine). Arrays travel as tensors, one key at a time, straight
    into the concatenated result: rank 0 never holds a pickled copy beside the unpickled
    one, so its peak memory stays near one copy of the gathered arrays (about one
    field's worth of receive buffers above it).
    """
    if get_world_size() == 1:
        return dict(arrays)
    counts = [n for n in all_gather_object(len(next(iter(arrays.values()))) if arrays else 0)]
    longest = max(counts)
    is_main = get_rank() == 0
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    out: Dict[str, np.ndarray] = {}
    for key in sorted(arrays):  # the same order on every rank
        local = np.ascontiguousarray(arrays[key])
        padded = np.zeros((longest, *local.shape[1:]), dtype=local.dtype)
        padded[: len(local)] = local
        send = torch.from_numpy(padded).to(device)
        del padded
        receive = [torch.empty_like(send) for _ in counts] if is_main else None
        dist.gather(send, receive, dst=0)
        del send
        if is_main:
            out[key] = np.concatenate([r[:n].cpu().numpy() for r, n in zip(receive, counts)])
        del receive
    return out if is_main else None


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

class StoppedForAnotherRank(RuntimeError):
    """This rank stopped its phase early because another rank had already failed it."""


class FailureFlag:
    """Lets the ranks of a long phase stop as soon as one of them fails it, instead of
    finishing their own work before the agreement at its end.

    Every rank creates it at the same point (one collective). A rank that fails calls
    :meth:`raise_` before it enters the agreement; the others see it in :meth:`check`,
    one request to the c10d store per call (see :func:`shared_counter_add`), and stop.
    """

    def __init__(self, name: str):
        self._key = new_shared_counter(name)

    def raise_(self) -> None:
        shared_counter_add(self._key, 1)

    def check(self) -> None:
        """Raise :class:`StoppedForAnotherRank` when another rank has failed."""
        if get_world_size() > 1 and shared_counter_add(self._key, 0):
            raise StoppedForAnotherRank("stopped: another rank failed")


class RankFailure(RuntimeError):
    """Raised on every rank when one or more ranks failed a phase.

    ``usage`` is True when every failure was a :class:`dist_eval.errors.UsageError`
    (the user can fix it), so the CLI prints one line instead of a traceback.
    """

    def __init__(self, phase: str, failures: List[tuple], world_size: int):
        self.phase = phase
        # ranks that only stopped because another failed are not failures of their own
        failures = [f for f in failures if f[1] != "stopped"] or failures
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

    if isinstance(local_error, RankFailure):
        # agreed on already, by every rank, in a nested phase: pass it on as it is (wrapping
        # it would turn a usage error into an internal one, and print it twice)
        raise local_error
    if local_error is None:
        report = None
    elif isinstance(local_error, StoppedForAnotherRank):
        report = ("stopped", str(local_error))
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
