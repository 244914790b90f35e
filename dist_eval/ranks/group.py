"""The process group: join the one torchrun described, rank, world size, launcher probing."""
from __future__ import annotations

import datetime
import os

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
    the ranks of this node, is then below WORLD_SIZE).
    """
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
