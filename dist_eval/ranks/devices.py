"""Where a rank's tensors live, decided by pure functions of (CUDA available, device
count, local rank, flags), so that the GPU-node decisions are tested on a CPU machine.

- The process group: gloo by default wherever the ranks run. dist_eval's collectives
  carry numpy arrays (counts, predictions, logits) that live on the CPU, whatever the
  backend computes on; NCCL would only add a copy to the GPU and back, and would need one
  GPU per rank (capping N at the GPU count). Petals client ranks keep every tensor on the
  CPU. ``--dist-backend nccl`` is there for who wants it: then each rank takes GPU
  ``LOCAL_RANK``, and a node must have one per rank.
- The local backend's model: ``--device cpu`` (default), ``cuda`` (each rank on
  ``cuda:LOCAL_RANK % device_count``, so ranks may share GPUs) or ``cuda:K``.
"""
from __future__ import annotations

import re

from dist_eval.errors import UsageError

DIST_BACKENDS = ("gloo", "nccl")


def dist_backend_for(flag: str, *, cuda_available: bool, device_count: int, local_rank: int) -> str:
    """The process group's backend for ``--dist-backend flag``; refuses an NCCL that cannot run here."""
    if flag not in DIST_BACKENDS:
        raise UsageError(f"expected one of {', '.join(DIST_BACKENDS)}.", param="dist_backend", value=flag)
    if flag == "nccl" and (not cuda_available or local_rank >= device_count):
        visible = device_count if cuda_available else 0
        raise UsageError(
            f"NCCL needs one CUDA device per rank, and LOCAL_RANK {local_rank} finds {visible} "
            "visible on this node: start fewer ranks per node, or use --dist-backend gloo (any N).",
            param="dist_backend", value=flag,
        )
    return flag


def local_device(requested: str, *, cuda_available: bool, device_count: int, local_rank: int) -> str:
    """The torch device of the local backend's model on this rank; refuses one that does not exist."""
    if requested == "cpu":
        return "cpu"
    match = re.fullmatch(r"cuda(?::(\d+))?", requested or "")
    if match is None:
        raise UsageError("expected cpu, cuda or cuda:K.", param="device", value=requested)
    count = device_count if cuda_available else 0
    if count == 0:
        raise UsageError("no CUDA device is visible on this node; use --device cpu.", param="device", value=requested)
    if match.group(1) is None:
        return f"cuda:{local_rank % count}"
    if int(match.group(1)) >= count:
        raise UsageError(
            f"no such device: this node has {count} visible CUDA device(s) (cuda:0 to cuda:{count - 1}).",
            param="device", value=requested,
        )
    return requested


def this_rank_device(requested: str, local_rank: int) -> str:
    """:func:`local_device` for this process (reads torch.cuda)."""
    import torch

    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    return local_device(requested, cuda_available=available, device_count=count, local_rank=local_rank)
