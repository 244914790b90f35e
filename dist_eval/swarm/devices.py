"""What a local swarm's servers run on: device, dtype, how many per GPU, request size.

Decided by a pure function (:func:`plan_servers`) of the request, the visible GPUs'
memory and the model's weight size, so that the GPU decisions are tested on a CPU
machine; :func:`visible_gpu_memory` is the one place that asks torch. Standard library
only at import.

Why these GPU defaults (the throughput issue's figures on one H100: benchmarks/RESULTS.md):
a petals server computes one request at a time, so on a GPU the servers, not the GPU,
saturate, and more server processes on one GPU, each holding every block, served more.
So on a GPU the swarm starts full replicas,
as many per GPU as fit in a share of its memory, at most 8; in fp16 (bf16 for a model
saved in bf16), petals' own default being the saved dtype (fp32 for many checkpoints);
and each server accepts requests of up to 16384 tokens (petals' default 2048), which
paid off with bigger requests on few servers. On the CPU and on GPUs alike, the cores are
shared out among the servers (``threads``: ``OMP_NUM_THREADS``, unless set already), and
the servers hold full replicas wherever they fit in a share of the device's memory: then
every request is one hop, and any server can fail. On the CPU, where a server computes
with one thread of its own, K servers on one machine are there for parallelism; with
every block on only two of them (``placement.plan_blocks``, the layout when they do not
fit) a request crossed one or two servers, and the server holding every block got most of
the work (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from dist_eval.swarm.placement import SwarmError, plan_by_size

CPU_SERVERS = 2  # every block on both: one may fail without a block going missing
GPU_SERVERS_MAX = 8  # per GPU; the most measured to pay off
GPU_WEIGHT_SHARE = 0.5  # of a GPU's memory the servers' weights may take; the rest: activations, caches
CPU_WEIGHT_SHARE = 0.5  # of the memory available here that the CPU servers' full replicas may take
GPU_MAX_BATCH_SIZE = 16384  # tokens per request a GPU server accepts
DTYPES = ("float32", "float16", "bfloat16")
# what may be asked for: auto, cpu, cuda (every visible GPU), cuda:K (group 1: K)
DEVICE_REQUEST = re.compile(r"auto|cpu|cuda(?::(\d+))?")
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ServerPlan:
    """One local swarm's servers: ``devices[i]`` is server i's torch device."""

    devices: Tuple[str, ...]
    torch_dtype: str
    blocks_per_server: Optional[int]  # every block (full replicas), or None: placement's default (2 servers a block)
    max_batch_size: Optional[int]  # None: petals' default
    threads: Optional[int] = None  # CPU threads of each server (OMP_NUM_THREADS); None: torch's default
    # each server's blocks [a, b), when a model split over GPUs has blocks of other sizes (a
    # mixture-of-experts block weighs many dense ones): placed by size, not by count
    block_ranges: Optional[Tuple[Tuple[int, int], ...]] = None

    @property
    def num_servers(self) -> int:
        return len(self.devices)

    def describe(self) -> str:
        """E.g. ``float32 on cpu`` or ``float16 on cuda:0, cuda:1``."""
        return f"{self.torch_dtype} on {', '.join(sorted(set(self.devices)))}"

    def server_args(self, index: int) -> List[str]:
        """The petals ``run_server`` flags that differ between plans, for server ``index``."""
        args = ["--device", self.devices[index], "--torch_dtype", self.torch_dtype]
        if self.max_batch_size is not None:
            args += ["--max_batch_size", str(self.max_batch_size)]
        return args


def plan_servers(
    device: str,
    num_servers: Optional[int],
    torch_dtype: Optional[str],
    *,
    gpu_memory: Sequence[int],
    weight_bytes: int,
    saved_dtype: str,
    num_blocks: int,
    cpus: int = 1,
    cpu_memory: int = 0,
    block_weights: Optional[Sequence[int]] = None,
) -> ServerPlan:
    """The servers for ``device`` (``auto``: every visible GPU if any, else the CPU; ``cpu``;
    ``cuda``: every visible GPU; ``cuda:K``: that one) and ``num_servers`` (None: the
    device's default), in ``torch_dtype`` (None: float32 on the CPU, the saved 16-bit
    dtype or float16 on a GPU). ``gpu_memory``: bytes of each visible GPU;
    ``weight_bytes``: the model's weights as saved, in ``saved_dtype``; ``cpus``: the CPU
    cores here, shared out among the servers (``threads``); ``cpu_memory``: bytes of memory
    available here (0: unknown), which CPU servers' full replicas must fit a share of.
    ``block_weights``: each block's weights in values (``placement.block_parameters``), or None;
    when they differ, a model split over the GPUs is split by the blocks' sizes.
    """
    if torch_dtype is not None and torch_dtype not in DTYPES:
        raise SwarmError(f"torch_dtype={torch_dtype!r}: expected one of {', '.join(DTYPES)} (or none: the default).")
    check_num_servers(num_servers)
    gpus = _gpus_of(device, len(gpu_memory))
    if not gpus:
        count, dtype = num_servers or CPU_SERVERS, torch_dtype or "float32"
        # full replicas where they fit, else every block on two servers (placement's layout)
        full = count * _replica_bytes(weight_bytes, saved_dtype, dtype) <= cpu_memory * CPU_WEIGHT_SHARE
        return ServerPlan(("cpu",) * count, dtype, num_blocks if full else None, None, _threads(cpus, count))
    dtype = torch_dtype or (saved_dtype if saved_dtype in ("float16", "bfloat16") else "float16")
    replica = _replica_bytes(weight_bytes, saved_dtype, dtype)
    budget = min(int(gpu_memory[g] * GPU_WEIGHT_SHARE) for g in gpus)
    per_gpu = min(GPU_SERVERS_MAX, budget // max(replica, 1))
    if per_gpu >= 1:  # full replicas: one hop per request, and any server can fail
        count = num_servers or per_gpu * len(gpus)
        devices = tuple(f"cuda:{gpus[i % len(gpus)]}" for i in range(count))
        return ServerPlan(devices, dtype, num_blocks, GPU_MAX_BATCH_SIZE, _threads(cpus, count))
    # the model does not fit one GPU's share: split its blocks over the GPUs, one server each
    if block_weights is not None and len(set(block_weights)) > 1 and (num_servers or len(gpus)) == len(gpus):
        ranges = _split_by_size([w * _BYTES[dtype] for w in block_weights], len(gpus), budget, dtype)
        devices = tuple(f"cuda:{g}" for g in gpus[:len(ranges)])
        return ServerPlan(devices, dtype, None, GPU_MAX_BATCH_SIZE, _threads(cpus, len(devices)), tuple(ranges))
    per_block = -(-replica // num_blocks)
    blocks_each = -(-num_blocks // len(gpus))
    if blocks_each * per_block > budget or (num_servers or len(gpus)) != len(gpus):
        gib = 2**30
        raise SwarmError(
            f"the model's weights ({replica / gib:.1f} GiB in {dtype}) do not fit the local swarm's "
            f"{len(gpus)} GPU(s) ({budget / gib:.1f} GiB each for weights, one server per GPU): "
            "start servers over more GPUs or hosts (python -m dist_eval.swarm --block-indices, or petals' "
            "run_server) and pass their --initial-peers."
        )
    devices = tuple(f"cuda:{g}" for g in gpus)
    return ServerPlan(devices, dtype, blocks_each, GPU_MAX_BATCH_SIZE, _threads(cpus, len(gpus)))


def _split_by_size(block_bytes: List[int], gpus: int, budget: int, dtype: str) -> List[Tuple[int, int]]:
    """Contiguous ranges, one per GPU, of about equal bytes (cut where the running total passes
    each GPU's equal part); where one passes ``budget``, as many blocks as fit each in turn
    (:func:`placement.plan_by_size`); SwarmError when the GPUs cannot hold them.
    """
    total, running, cuts = sum(block_bytes), 0, []
    for index, size in enumerate(block_bytes):
        if len(cuts) < gpus - 1 and running + size / 2 > total * (len(cuts) + 1) / gpus:
            cuts.append(index)
        running += size
    edges = [0, *cuts, len(block_bytes)]
    ranges = [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]
    if all(sum(block_bytes[a:b]) <= budget for a, b in ranges):
        return ranges
    try:
        return plan_by_size(block_bytes, [budget] * gpus)
    except SwarmError as e:
        raise SwarmError(f"the model's blocks in {dtype} do not fit the local swarm's {gpus} GPU(s) by size: {e}. "
                         "Start servers over more GPUs or hosts (python -m dist_eval.swarm --block-indices, or "
                         "petals' run_server) and pass their --initial-peers.") from e


def _replica_bytes(weight_bytes: int, saved_dtype: str, dtype: str) -> int:
    """Bytes of one server's copy of weights saved as ``weight_bytes`` in ``saved_dtype``, served in ``dtype``."""
    return weight_bytes * _BYTES[dtype] // _BYTES.get(saved_dtype, 4)


def _threads(cpus: int, servers: int) -> int:
    # Each server's torch would start one thread per core: K servers on C cores then fight
    # over them (and OpenMP threads spin while they wait); one thread each made the CPU
    # benchmark's swarm faster for every client (benchmarks/RESULTS.md).
    return max(1, cpus // servers)


def check_num_servers(num_servers: Optional[int]) -> None:
    """SwarmError unless ``num_servers`` is None (the device's default) or a positive int."""
    if num_servers is not None and (isinstance(num_servers, bool) or not isinstance(num_servers, int)
                                    or num_servers < 1):
        raise SwarmError(f"num_servers={num_servers!r}: expected a positive number of servers.")


def _gpus_of(device: str, visible: int) -> List[int]:
    if device == "cpu" or (device == "auto" and not visible):
        return []
    if device in ("auto", "cuda"):
        if not visible:
            raise SwarmError("device='cuda': no CUDA device is visible here; use device='cpu' (or 'auto').")
        return list(range(visible))
    match = DEVICE_REQUEST.fullmatch(device) if isinstance(device, str) else None
    if not match or match.group(1) is None:
        raise SwarmError(f"device={device!r}: expected auto, cpu, cuda (every visible GPU) or cuda:K.")
    if int(match.group(1)) >= visible:
        raise SwarmError(f"device={device!r}: {visible} CUDA device(s) are visible here (cuda:0..).")
    return [int(match.group(1))]


_NVIDIA_GPUS = "/proc/driver/nvidia/gpus"  # one entry per GPU the NVIDIA driver sees
_QUERY = (
    "import torch\n"
    "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
    "print(*[torch.cuda.get_device_properties(i).total_memory for i in range(n)])"
)


def visible_gpu_memory(device: str) -> List[int]:
    """Bytes of memory of each GPU torch sees here ([] for ``device='cpu'``, and for ``auto``
    on a machine without an NVIDIA driver: then nothing is started).

    Asked in a child process: torch's CUDA initialised in this one (a rank, the swarm's
    parent, the petals client's forked helpers) would stay there for nothing, and
    ``python -m dist_eval.swarm`` imports no torch.
    """
    if device == "cpu" or (device == "auto" and not _driver_sees_gpus()):
        return []
    try:
        done = subprocess.run([sys.executable, "-c", _QUERY], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SwarmError(f"device={device!r}: could not ask torch for the GPUs ({e}).") from None
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SwarmError(f"device={device!r}: could not ask torch for the GPUs ({tail}).")
    return [int(x) for x in done.stdout.split()]


def available_memory() -> int:
    """Bytes of memory available here for new processes (MemAvailable of /proc/meminfo; 0 where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _driver_sees_gpus() -> bool:
    try:
        return bool(os.listdir(_NVIDIA_GPUS))
    except OSError:
        return False


def model_weights(model_dir: str) -> Tuple[int, str]:
    """(bytes of the weight files, the dtype they are saved in) of a save_pretrained folder."""
    size = sum(
        os.path.getsize(os.path.join(model_dir, name))
        for name in os.listdir(model_dir)
        if name.endswith((".safetensors", ".bin")) and not name.startswith("training_args")
    )
    from dist_eval.backends.config_json import read_config_json
    from dist_eval.errors import UsageError

    try:  # either transformers generation's name of it (backends.config_json)
        saved = read_config_json(model_dir).get("torch_dtype") or "float32"
    except UsageError:
        saved = "float32"
    return size, saved if saved in _BYTES else "float32"
