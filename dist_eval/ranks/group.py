"""The process group: join the one torchrun described, rank, world size, launcher probing."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: torch.distributed.nn.functional's
# functions take ``group=group.WORLD`` as a default, evaluated at its import. Imported later
# (torch._dynamo imports it, and DistributedDataParallel imports torch._dynamo), they pin the
# default group: destroy_process_group() then leaves it alive with its gloo threads, and at
# the interpreter's exit a gloo thread that still drops the last collective's tensors needs
# the GIL of a finalizing interpreter: "terminate called without an active exception", SIGABRT.
if dist.is_available():  # a process that imported dist_eval before its init_process_group is safe
    import torch.distributed.nn  # noqa: F401


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
    the ranks of this node, is then below WORLD_SIZE).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return launched_by_torchrun() and int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world


def init_process_group_from_env(timeout_s: float, dist_backend: str = "gloo") -> bool:
    """Join the process group that torchrun/SLURM described in the environment.

    Returns True when this call created the group (and so must destroy it). Does
    nothing when a group already exists (a training loop made it) or when the process
    was not launched by torchrun. The backend is ``dist_backend`` (gloo by default,
    wherever the ranks run: see :mod:`dist_eval.ranks.devices`).
    """
    if is_initialized() or not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return False
    from dist_eval.ranks.devices import dist_backend_for

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    available = torch.cuda.is_available()
    backend = dist_backend_for(
        dist_backend, cuda_available=available, device_count=torch.cuda.device_count() if available else 0,
        local_rank=local_rank,
    )
    if backend == "nccl":
        # Before the first collective: NCCL's object collectives use the current device,
        # and with the default (cuda:0) every rank of a node would share one GPU.
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def destroy_process_group() -> None:
    if is_initialized():
        dist.destroy_process_group()
