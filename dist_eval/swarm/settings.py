"""What a local swarm runs, decided before any server starts: the folder served, its blocks, the
servers' plan (device, dtype, how many), each server's block range, the DHT prefix, the hosts and
ports; then each server's command line and environment.

Folder: a layout petals' server cannot read is served from its converted copy (``model_dir``;
``source_dir`` is the folder given, and names the default ``dht_prefix``), see
:mod:`dist_eval.backends.petals_folder`.

Placement: each server serves one contiguous range (``--block_indices A:B``). Every server holds every
block where the K replicas fit in a share of the memory (the GPU's, or the memory available here for
CPU servers: :func:`~dist_eval.swarm.devices.plan_servers`): every request is then one hop. Else
(:func:`~dist_eval.swarm.placement.plan_blocks`) every block is on two servers, so a failed server
leaves no block missing; a model split over GPUs whose blocks differ in size is split by their sizes.
``blocks_per_server=B`` overrides: B blocks per server, ranges evenly spread (must cover every block).
``block_range=(A, B)`` places the servers on blocks A..B-1 only (other hosts serve the rest).

Servers run ``--quant_type none --throughput 1.0`` (no network speed test) and the device, dtype and
request size of their :class:`~dist_eval.swarm.devices.ServerPlan`; ``num_servers`` and
``torch_dtype`` override the plan's, later flags in ``extra_server_args`` any of them. They run
offline (``HF_HUB_OFFLINE=1``), with a private ``TMPDIR`` and the plan's threads.

Standard library only.
"""
from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from dist_eval.procs import port_is_free, reserve_ports
from dist_eval.swarm.devices import ServerPlan, check_num_servers, model_weights, plan_servers
from dist_eval.swarm.placement import (
    SwarmError,
    block_parameters,
    check_block_range,
    check_host,
    check_peers,
    default_prefix,
    plan_blocks,
    read_num_blocks,
)
from dist_eval.swarm.process import ServerProcess

_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class SwarmSettings:
    """One local swarm's settings, checked (see the module's docstring); :func:`decide` makes them."""

    source_dir: str  # the folder given
    model_dir: str  # the folder served: source_dir, or its copy in petals' layout
    num_blocks: int  # the model's
    block_range: Tuple[int, int]  # the blocks this host serves
    server_plan: ServerPlan
    placement: List[Tuple[int, int]]  # each server's blocks
    dht_prefix: str
    host: str  # listened on and announced
    join_peers: List[str]  # a running swarm to join, or none: a new one
    port: Optional[int]  # the first server's (the others' follow), or None: free ports
    start_timeout: float
    log_dir: Optional[str]  # None: the logs go with the swarm's temp folder
    extra_server_args: List[str]

    @property
    def num_servers(self) -> int:
        return self.server_plan.num_servers

    def reserve_ports(self) -> List[socket.socket]:
        """Each server's TCP port, held until the swarm stops (:func:`~dist_eval.procs.reserve_ports`: no other
        process gets it meanwhile, a server's restart included): free ones from the OS, or ``port``, ``port+1``, ...
        (SwarmError if one is taken).
        """
        if self.port is None:
            return reserve_ports(self.host, count=self.num_servers)
        ports = [self.port + i for i in range(self.num_servers)]
        for p in ports:
            # a listener refuses the probe, but not the reservation's bind (SO_REUSEADDR: a server of this user
            # listening there with SO_REUSEPORT would share the port)
            if not port_is_free(p, self.host):
                raise SwarmError(
                    f"port {p} on {self.host} is already in use: pass another port (servers use "
                    f"{ports[0]}..{ports[-1]}), or none to pick free ports."
                )
        try:
            return reserve_ports(self.host, ports=ports)
        except OSError as e:  # taken since the probe
            raise SwarmError(f"ports {ports[0]}..{ports[-1]} on {self.host}: {e.strerror}: pass another port, or "
                             "none to pick free ports.") from e

    def env(self, tmpdir: str) -> Dict[str, str]:
        """The servers' environment: offline, their private TMPDIR, the plan's threads, this checkout."""
        env = dict(os.environ)
        env.update(HF_HUB_OFFLINE="1", TMPDIR=tmpdir, PYTHONUNBUFFERED="1")
        if self.server_plan.threads and "OMP_NUM_THREADS" not in env:  # an operator's setting stands
            env["OMP_NUM_THREADS"] = str(self.server_plan.threads)
        if os.path.basename(_PROJECT_ROOT) not in ("site-packages", "dist-packages"):  # a source checkout
            env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT_ROOT, env.get("PYTHONPATH")) if p)
        return env

    def command(self, module: str, server: ServerProcess, peer_args: Sequence[str]) -> List[str]:
        """``server``'s command line: ``python -m module``, with ``peer_args`` (how it finds the swarm)."""
        return [
            sys.executable, "-m", module, self.model_dir, *peer_args,
            "--dht_prefix", self.dht_prefix,
            *self.server_plan.server_args(server.index), "--quant_type", "none",
            "--throughput", "1.0", "--skip_reachability_check",
            "--host_maddrs", f"/ip4/{self.host}/tcp/{server.port}",  # listened on and announced
            "--block_indices", f"{server.blocks[0]}:{server.blocks[1]}",
            # its peer id (so its address) kept over restarts
            "--identity_path", server.identity_path,
            *self.extra_server_args,
        ]  # fmt: skip


def decide(model_dir: str, *, num_servers: Optional[int], dht_prefix: Optional[str], port: Optional[int],
           blocks_per_server: Optional[int], start_timeout: float, log_dir: Optional[str],
           extra_server_args: Sequence[str], host: str, join_peers: Sequence[str],
           block_range: Optional[Tuple[int, int]], device: str, torch_dtype: Optional[str],
           gpu_memory: Callable[[str], List[int]], cpu_memory: Callable[[], int]) -> SwarmSettings:
    """The settings of a swarm serving ``model_dir`` (LocalSwarm's arguments), checked in the order a reader
    needs them (the folder, its blocks, the plan, the rest); ``gpu_memory(device)`` and ``cpu_memory()``
    measure this machine (:mod:`~dist_eval.swarm.devices`). SwarmError names the argument at fault.
    """
    if not os.path.isdir(model_dir):
        raise SwarmError(f"{model_dir}: no such folder. Pass a model folder saved with save_pretrained().")
    check_num_servers(num_servers)
    source_dir = os.path.abspath(model_dir)
    served = _served_folder(source_dir)
    num_blocks = read_num_blocks(served)
    first, last = block_range = check_block_range(block_range or (0, num_blocks), num_blocks)
    weight_bytes, saved_dtype = model_weights(served)
    plan = plan_servers(
        device, num_servers, torch_dtype, gpu_memory=gpu_memory(device),
        weight_bytes=weight_bytes * (last - first) // num_blocks, saved_dtype=saved_dtype,
        num_blocks=last - first, cpus=os.cpu_count() or 1, cpu_memory=cpu_memory(),
        block_weights=_block_weights(served, first, last),
    )  # fmt: skip
    # the plan's ranges by the blocks' sizes, unless blocks_per_server was asked for
    ranges = plan.block_ranges if blocks_per_server is None else None
    _check_args(port, plan.num_servers, start_timeout, dht_prefix)
    host, join_peers = check_host(host), check_peers(join_peers)
    if ranges is None:
        per_server = plan.blocks_per_server if blocks_per_server is None else blocks_per_server
        ranges = plan_blocks(last - first, plan.num_servers, per_server)
    return SwarmSettings(
        source_dir=source_dir, model_dir=served, num_blocks=num_blocks, block_range=block_range, server_plan=plan,
        placement=[(first + a, first + b) for a, b in ranges], dht_prefix=dht_prefix or default_prefix(source_dir),
        host=host, join_peers=join_peers, port=port, start_timeout=float(start_timeout),
        log_dir=os.path.abspath(log_dir) if log_dir else None, extra_server_args=[str(a) for a in extra_server_args],
    )  # fmt: skip


def _served_folder(model_dir: str) -> str:
    """``model_dir``, or its copy in the layout petals' server reads (converted once, cached)."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return model_dir  # read_num_blocks says what is missing
    from dist_eval.backends.petals_folder import petals_model_folder, require_every_shard
    from dist_eval.errors import UsageError

    try:
        require_every_shard(model_dir, "a local swarm")
        return petals_model_folder(model_dir, log=lambda line: print(f"dist_eval.swarm: {line}", flush=True))
    except UsageError as e:
        raise SwarmError(f"{model_dir}: {e.detail}") from None


def _block_weights(model_dir: str, first: int, last: int) -> Optional[List[int]]:
    """Blocks ``first:last``'s weights counted from config.json (placement.block_parameters), or
    None where they are not counted (families whose blocks are all alike) or cannot be read.
    """
    from dist_eval.backends.config_json import read_config_json
    from dist_eval.errors import UsageError

    try:
        return block_parameters(read_config_json(model_dir))[first:last]
    except (UsageError, KeyError, TypeError, SwarmError):
        return None


def _check_args(port: Optional[int], num_servers: int, start_timeout: float, dht_prefix: Optional[str]) -> None:
    if port is not None and (not isinstance(port, int) or not 1 <= port <= 65535 - num_servers + 1):
        raise SwarmError(f"port={port!r}: expected a TCP port such that port..port+{num_servers - 1} are valid.")
    if not start_timeout or start_timeout <= 0:
        raise SwarmError(f"start_timeout={start_timeout!r}: expected a positive number of seconds.")
    if dht_prefix is not None and (not dht_prefix or re.search(r"[.\s]", dht_prefix)):
        raise SwarmError(
            f"dht_prefix={dht_prefix!r}: must be non-empty, without '.' or spaces (petals uses them as delimiters)."
        )
