"""Petals servers on this machine for one saved model folder: a private swarm, or this
host's share of a swarm that spans several hosts.

Library::

    with LocalSwarm("path/to/model", num_servers=2) as swarm:   # returns once every block is served
        ... from_pretrained(model_dir, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix)

Command line (stays in the foreground; Ctrl-C or SIGTERM stops every process it started)::

    python -m dist_eval.swarm MODEL_DIR [--servers K] [--port P] [--dht-prefix NAME] [--start-timeout S]
        [--host IP] [--initial-peers MADDR ...] [--block-indices A:B] [--device DEV]

It prints one line ``INITIAL_PEERS=<multiaddr> [<multiaddr> ...]`` on stdout once its
servers serve their blocks. Several hosts make one swarm: the first starts a new swarm
(``--host`` = its IP), the others join it with ``--initial-peers`` (the first's line),
each serving a ``--block-indices`` range, all under the same ``--dht-prefix``.

Each server is ``python -m dist_eval._server <petals run_server flags>`` (so it imports
petals through :mod:`dist_eval.compat`), started in its own session/process group: a
petals server spawns about eleven processes (among them the p2pd daemon that holds the
port), and only signalling the whole group stops them all. This module imports nothing
but the standard library, so the CLI starts at once and never prints petals' noise.
"""
from __future__ import annotations

import argparse
import atexit
import errno
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

__all__ = ["SwarmError", "LocalSwarm", "plan_blocks", "main"]


class SwarmError(Exception):
    """The local swarm could not be started (or was misconfigured). The message is one
    line: what failed, what to do, and the tail of the failing server's log."""


# "Nov 22 09:06:39.750 [INFO] Running a server on ['/ip4/127.0.0.1/tcp/39111/p2p/12D3Koo...']"
_RUNNING_RE = re.compile(r"Running a server on \[([^\]]*)\]")
_MADDR_RE = re.compile(r"/ip4/[0-9.]+/tcp/(\d+)/p2p/[1-9A-HJ-NP-Za-km-z]+")
_STARTED_RE = re.compile(r"\[INFO\] Started\s*$", re.MULTILINE)
# a peer to join: what the INITIAL_PEERS= line of a running swarm (or petals) prints
_PEER_RE = re.compile(r"^/(ip4|ip6|dns|dns4|dns6)/[^/\s]+/tcp/\d{1,5}/p2p/[1-9A-HJ-NP-Za-km-z]+$")
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SIGINT_BIT = 1 << (signal.SIGINT - 1)
# SIGINT -> SIGKILL delay. Measured on 2 CPU cores: a lone server exits ~1 s after SIGINT,
# but the last servers of a swarm announce "offline" to peers that already left and wait
# for hivemind's DHT timeouts (~10 s). Nothing is lost by cutting that short: the whole
# private swarm is going away, and the files hivemind would leave are removed here.
_GRACE_SECONDS = 3.0


# --------------------------------------------------------------------------- placement


def _split(num_blocks: int, parts: int) -> List[Tuple[int, int]]:
    """``parts`` contiguous, near-equal ranges covering [0, num_blocks)."""
    return [(p * num_blocks // parts, (p + 1) * num_blocks // parts) for p in range(parts)]


def plan_blocks(num_blocks: int, num_servers: int, blocks_per_server: Optional[int] = None) -> List[Tuple[int, int]]:
    """Block range ``(start, end)`` (end exclusive) of each server.

    Default: one server serves everything. With two or more servers, every block is
    served by **two** servers, so that one server can fail without a block going
    missing: the servers form two layers, the first ``ceil(K/2)`` servers split the
    blocks into contiguous near-equal ranges, and so do the other ``floor(K/2)``
    (with more servers in a layer than blocks, ranges repeat). Each server then holds
    about ``2 * num_blocks / K`` blocks (twice the memory of a plain split; pass
    ``blocks_per_server=ceil(num_blocks / K)`` to give that up). For K=2 both servers
    serve every block; for K=3 and 4 blocks: 0:2, 2:4, 0:4; for K=4: 0:2, 2:4, 0:2, 2:4.

    ``blocks_per_server=B``: every server serves B contiguous blocks, the ranges evenly
    spread from block 0 to the last block (overlapping where K*B > num_blocks).
    SwarmError if they cannot cover every block (K*B < num_blocks).
    """
    if num_blocks < 1 or num_servers < 1:
        raise SwarmError(f"cannot place {num_blocks} block(s) on {num_servers} server(s).")
    if blocks_per_server is not None:
        if blocks_per_server < 1:
            raise SwarmError(f"blocks_per_server={blocks_per_server}: expected a positive number of blocks.")
        size = min(blocks_per_server, num_blocks)
        if size * num_servers < num_blocks:
            raise SwarmError(
                f"blocks_per_server={blocks_per_server} x {num_servers} server(s) cannot cover the model's "
                f"{num_blocks} blocks: use at least {-(-num_blocks // num_servers)} blocks per server or more servers."
            )
        if num_servers == 1:
            return [(0, size)]
        span = num_blocks - size
        starts = [(i * span + (num_servers - 1) // 2) // (num_servers - 1) for i in range(num_servers)]
        return [(s, s + size) for s in starts]
    if num_servers == 1:
        return [(0, num_blocks)]
    plan: List[Tuple[int, int]] = []
    for layer_size in ((num_servers + 1) // 2, num_servers // 2):
        ranges = _split(num_blocks, min(layer_size, num_blocks))
        plan.extend(ranges[i % len(ranges)] for i in range(layer_size))
    return plan


# --------------------------------------------------------------------------- /proc helpers


def _process_groups(pgids: Set[int]) -> Dict[int, List[Tuple[int, str]]]:
    """{pgid: [(pid, state), ...]} for every live process whose group is in ``pgids``."""
    found: Dict[int, List[Tuple[int, str]]] = {}
    if not pgids:
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        rest = stat.rpartition(")")[2].split()
        if len(rest) < 3:
            continue
        pgid = int(rest[2])
        if pgid in pgids:
            found.setdefault(pgid, []).append((int(entry), rest[0]))
    return found


def _live_groups(pgids: Set[int]) -> Dict[int, List[int]]:
    """Like :func:`_process_groups`, without zombies (they hold no port and no memory)."""
    return {g: [p for p, st in procs if st != "Z"] for g, procs in _process_groups(pgids).items() if any(st != "Z" for _, st in procs)}


def _unix_socket_paths(pids: Sequence[int]) -> Set[str]:
    """Paths of the unix sockets that these processes hold (hivemind never deletes some)."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    paths = set()
    try:
        with open("/proc/net/unix") as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("/"):
                    paths.add(parts[7])
    except OSError:
        pass
    return paths


def _ignores_sigint(pid: int) -> bool:
    """True when the process ignores SIGINT: it inherited SIG_IGN (e.g. its parent was a
    background job of a non-interactive shell), so Python never installed its handler."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) & _SIGINT_BIT)
    except (OSError, ValueError):
        pass
    return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as p2pd does: TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError:
            return False
    return True


def _free_ports(count: int, host: str = "127.0.0.1") -> List[int]:
    """``count`` distinct ports that are free now on ``host`` (the OS picks them)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _check_host(host: str) -> str:
    """``host`` if it is an IPv4 address servers can listen on *and* announce, else SwarmError."""
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        raise SwarmError(
            f"host={host!r}: expected an IPv4 address of this machine that the clients can reach "
            "(e.g. 10.0.0.5; `hostname -I` lists them), or 127.0.0.1 for a swarm on this machine only."
        ) from None
    if address.is_unspecified:
        # petals announces the address it listens on: 0.0.0.0 would be announced as-is
        raise SwarmError(
            f"host={host!r}: servers announce the address they listen on, and {host} is nobody's address; "
            "pass this machine's IP that the clients can reach (e.g. 10.0.0.5; `hostname -I` lists them)."
        )
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise SwarmError(
                    f"host={host!r}: not an address of this machine; pass one of its own IPs "
                    "(`hostname -I` lists them), the one the clients can reach."
                ) from None
            raise
    return host


def _check_peers(peers: Sequence[str]) -> List[str]:
    peers = [str(p) for p in peers]
    for p in peers:
        if not _PEER_RE.match(p):
            raise SwarmError(
                f"initial peer {p!r}: expected a multiaddr like /ip4/10.0.0.5/tcp/31337/p2p/12D3KooW... "
                "(a running swarm prints them on its INITIAL_PEERS=... line)."
            )
    return peers


def _check_block_range(block_range, num_blocks: int) -> Tuple[int, int]:
    try:
        start, end = (int(x) for x in block_range)
    except (TypeError, ValueError):
        start, end = -1, -1
    if not 0 <= start < end <= num_blocks:
        shown = ":".join(map(str, block_range)) if isinstance(block_range, (tuple, list)) else repr(block_range)
        raise SwarmError(
            f"block range {shown}: expected A:B (end exclusive) with 0 <= A < B <= {num_blocks}, "
            f"the model's number of blocks; e.g. 0:{num_blocks} for all of them."
        )
    return start, end


def _read_num_blocks(model_dir: str) -> int:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise SwarmError(f"{model_dir}: no config.json in the folder. Pass a folder saved with save_pretrained().")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise SwarmError(f"{path}: not readable as JSON ({e}).") from None
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and value >= 1:
            return value
    raise SwarmError(f"{path}: no positive num_hidden_layers; is this a transformer model petals can serve?")


def _default_prefix(model_dir: str) -> str:
    base = os.path.basename(os.path.normpath(os.path.abspath(model_dir)))
    return "dist_eval-" + (re.sub(r"[^A-Za-z0-9_-]", "_", base) or "model")


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- watchdog

# A tiny process (its own session) that stops processes if the Python process that
# started them dies without stopping them (SIGKILL, or SIGTERM from torchrun, which
# skips atexit). It reads commands on stdin; EOF without "done" means the owner died.
# "pg N": a process group to stop; "pid N START": one process (START: its start time,
# so that a pid reused by then is left alone); "path P": a file or folder to remove.
_WATCHDOG = r"""
import os, shutil, signal, sys, time
groups, pids, paths = set(), {}, set()
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "pg":
        groups.add(int(arg))
    elif cmd == "pid":
        pid, _, start = arg.partition(" ")
        pids[int(pid)] = start
    elif cmd == "path":
        paths.add(arg)
    elif cmd == "done":
        sys.exit(0)
def stat(e):
    try:
        return open("/proc/%s/stat" % e, "rb").read().decode("utf-8", "replace").rpartition(")")[2].split()
    except OSError:
        return []
def ours(e, rest):
    if len(rest) < 20 or rest[0] == "Z":
        return False
    return int(rest[2]) in groups or pids.get(int(e)) == rest[19]
def alive():
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and ours(e, stat(e))]
inodes = set()
for e in alive():
    try:
        for fd in os.listdir("/proc/%s/fd" % e):
            t = os.readlink("/proc/%s/fd/%s" % (e, fd))
            if t.startswith("socket:["):
                inodes.add(t[8:-1])
    except OSError:
        continue
try:
    for line in open("/proc/net/unix").read().splitlines()[1:]:
        f = line.split()
        if len(f) >= 8 and f[6] in inodes and f[7].startswith("/tmp/hivemind-"):
            paths.add(f[7])
except OSError:
    pass
for p in alive():  # single processes (helpers) have nothing to save: at once
    if p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
for sig, wait in ((signal.SIGINT, 3.0), (signal.SIGKILL, 5.0)):  # groups (servers) get a graceful try
    for g in groups:
        try:
            os.killpg(g, sig)
        except OSError:
            pass
    end = time.monotonic() + wait
    while alive() and time.monotonic() < end:
        time.sleep(0.1)
for p in paths:
    if os.path.isdir(p):
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            os.unlink(p)
        except OSError:
            pass
"""


class Watchdog:
    """A handle on one watchdog process (see ``_WATCHDOG``): what it is told to stop
    (process groups, single processes) and remove (paths) if this process dies first.
    :meth:`release` ends it without stopping anything. Never raises: without a watchdog
    (it could not start) only this process's own cleanup remains."""

    def __init__(self) -> None:
        try:
            self._proc: Optional[subprocess.Popen] = subprocess.Popen(
                [sys.executable, "-S", "-c", _WATCHDOG], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, text=True,
            )  # fmt: skip
        except OSError:
            self._proc = None

    def watch_group(self, pgid: int) -> None:
        self._tell(f"pg {pgid}")

    def watch_pid(self, pid: int, start_time: str) -> None:
        self._tell(f"pid {pid} {start_time}")

    def watch_path(self, path: str) -> None:
        self._tell(f"path {path}")

    def _tell(self, line: str) -> None:
        if self._proc is None:
            return
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def release(self) -> None:
        if self._proc is None:
            return
        self._tell("done")
        try:
            self._proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None


# --------------------------------------------------------------------------- the swarm


@dataclass
class _Server:
    index: int
    port: int
    blocks: Tuple[int, int]
    log_path: str
    proc: Optional[subprocess.Popen] = None
    address: Optional[str] = None
    started: bool = False
    log_offset: int = 0
    log_text: str = ""

    @property
    def label(self) -> str:
        return f"server {self.index} (blocks {self.blocks[0]}:{self.blocks[1]}, port {self.port})"

    def read_log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                chunk = f.read()
        except OSError:
            return self.log_text
        self.log_offset += len(chunk)
        self.log_text += chunk.decode("utf-8", "replace")
        return self.log_text

    def tail(self, lines: int = 6) -> str:
        kept = [_one_line(line) for line in self.read_log().splitlines() if line.strip()][-lines:]
        return " | ".join(kept) if kept else "(empty log)"


_LIVE_SWARMS: "Set[LocalSwarm]" = set()
_LIVE_LOCK = threading.Lock()


def _stop_all_at_exit() -> None:
    with _LIVE_LOCK:
        swarms = list(_LIVE_SWARMS)
    for swarm in swarms:
        try:
            swarm.stop()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


atexit.register(_stop_all_at_exit)


class LocalSwarm:
    """K Petals server processes on this machine for one saved model folder: a private
    swarm on 127.0.0.1 (the default), or this host's part of a multi-host swarm.

    ``start()`` (or ``with LocalSwarm(...) as swarm``) returns once every server printed
    ``Started``, i.e. every block is served; then ``initial_peers`` holds one multiaddr
    per server (``/ip4/127.0.0.1/tcp/PORT/p2p/ID``) and ``dht_prefix`` the prefix the
    blocks are announced under: pass both to petals' ``from_pretrained``.

    Placement (see :func:`plan_blocks`): each server serves one contiguous range
    (``--block_indices A:B``). With one server it serves every block; with K >= 2
    every block is on two servers (two layers of servers, each splitting the blocks),
    so a failed server leaves no block missing; each server then holds about 2L/K of
    the L blocks (K=2: both serve all). ``blocks_per_server=B`` overrides: B blocks per
    server, ranges evenly spread (must cover every block). ``placement`` lists the ranges.

    ``block_range=(A, B)`` places the servers on blocks A..B-1 only (the rest of the
    model served by other hosts); ``placement`` is then within that range.

    Several hosts: ``host`` is the IPv4 address the servers listen on and announce
    (default 127.0.0.1: this machine only; on a cluster, this host's IP that the clients
    reach). ``join_peers`` (multiaddrs of a running swarm): every server joins that swarm
    instead of starting a new one, so ``start()`` returns once *this host's* blocks are
    served, and ``initial_peers`` lists this host's servers (any server of a swarm is a
    valid entry point). Use the same ``dht_prefix`` on every host.

    Ports: ``port=None`` takes free ports from the OS; ``port=P`` uses P, P+1, ....
    Without ``join_peers`` the first server starts a new swarm, the others join it
    through its address (they start in parallel once it has printed it). Servers run
    ``--device cpu --torch_dtype float32 --quant_type none --throughput 1.0`` (no network
    speed test); later flags in ``extra_server_args`` override them (e.g. ``["--device", "cuda"]``).

    Processes: every server is its own session/process group, with ``HF_HUB_OFFLINE=1``
    and a private ``TMPDIR``; its output goes to ``<log_dir>/server-<i>.log`` (a temp
    folder when log_dir is None, deleted on stop unless the start failed). ``stop()``
    sends SIGINT to each group (petals' graceful shutdown, ~1 s for a lone server), SIGKILL
    to what is left after 3 s, waits until no process of the groups remains, then deletes
    the private TMPDIR and the ``/tmp/hivemind-*.sock`` files the servers held (hivemind
    leaks them). ``stop()`` also runs from ``__exit__`` (on exceptions too), at
    interpreter exit, and from a small watchdog process if this process dies without it.
    """

    def __init__(
        self,
        model_dir: str,
        num_servers: int = 2,
        dht_prefix: Optional[str] = None,
        port: Optional[int] = None,
        blocks_per_server: Optional[int] = None,
        start_timeout: float = 120.0,
        log_dir: Optional[str] = None,
        extra_server_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        join_peers: Sequence[str] = (),
        block_range: Optional[Tuple[int, int]] = None,
    ):
        if not os.path.isdir(model_dir):
            raise SwarmError(f"{model_dir}: no such folder. Pass a model folder saved with save_pretrained().")
        if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
            raise SwarmError(f"num_servers={num_servers!r}: expected a positive number of servers.")
        if port is not None and (not isinstance(port, int) or not 1 <= port <= 65535 - num_servers + 1):
            raise SwarmError(f"port={port!r}: expected a TCP port such that port..port+{num_servers - 1} are valid.")
        if not start_timeout or start_timeout <= 0:
            raise SwarmError(f"start_timeout={start_timeout!r}: expected a positive number of seconds.")
        if dht_prefix is not None and (not dht_prefix or re.search(r"[.\s]", dht_prefix)):
            raise SwarmError(f"dht_prefix={dht_prefix!r}: must be non-empty, without '.' or spaces (petals uses them as delimiters).")
        self.model_dir = os.path.abspath(model_dir)
        self.num_blocks: int = _read_num_blocks(self.model_dir)
        self.num_servers = num_servers
        self.host = _check_host(host)
        self.join_peers: List[str] = _check_peers(join_peers)
        self.block_range = _check_block_range(block_range or (0, self.num_blocks), self.num_blocks)
        first, last = self.block_range
        self.placement: List[Tuple[int, int]] = [
            (first + a, first + b) for a, b in plan_blocks(last - first, num_servers, blocks_per_server)
        ]
        self.dht_prefix: str = dht_prefix or _default_prefix(self.model_dir)
        self.port = port
        self.start_timeout = float(start_timeout)
        self.log_dir = os.path.abspath(log_dir) if log_dir else None
        self.extra_server_args = [str(a) for a in extra_server_args]
        self.initial_peers: List[str] = []
        self.start_seconds: Optional[float] = None  # measured by start()
        self.stop_seconds: Optional[float] = None  # measured by stop()
        self._servers: List[_Server] = []
        self._sockets: Set[str] = set()  # /tmp/hivemind-*.sock held by our servers
        self._workdir: Optional[str] = None
        self._keep_logs = False
        self._watchdog: Optional[Watchdog] = None
        self._state = "new"  # new -> starting -> running -> stopped
        self._lock = threading.RLock()
        self._owner_pid = os.getpid()  # a fork()ed child must not stop its parent's swarm

    # ------------------------------------------------------------------ public

    @property
    def pgids(self) -> List[int]:
        """Process group ids of the servers started (each server's main pid)."""
        return [s.proc.pid for s in self._servers if s.proc is not None]

    @property
    def ports(self) -> List[int]:
        return [s.port for s in self._servers]

    @property
    def log_paths(self) -> List[str]:
        return [s.log_path for s in self._servers]

    def start(self) -> "LocalSwarm":
        """Start every server; return once every block is served. On failure or timeout
        everything started is stopped and SwarmError is raised."""
        with self._lock:
            if self._state == "running":
                return self
            if self._state != "new":
                raise SwarmError(f"this LocalSwarm is {self._state}; create a new one to start another swarm.")
            self._state = "starting"
        began = time.monotonic()
        with _LIVE_LOCK:
            _LIVE_SWARMS.add(self)
        try:
            self._launch_all(deadline=began + self.start_timeout)
        except BaseException:
            self._keep_logs = any(s.proc is not None for s in self._servers)  # the error cites them
            try:
                self.stop()
            except Exception:  # noqa: BLE001 - the start failure is the error to report
                pass
            raise
        self._note_sockets()
        self.initial_peers = [s.address for s in self._servers]
        self.start_seconds = time.monotonic() - began
        with self._lock:
            self._state = "running"
        return self

    def check(self) -> None:
        """Raise SwarmError if a server has exited since the start."""
        for s in self._servers:
            if s.proc is not None and s.proc.poll() is not None and self._state == "running":
                raise SwarmError(
                    f"local swarm {s.label} exited with code {s.proc.returncode}; blocks "
                    f"{s.blocks[0]}:{s.blocks[1]} may be unserved. Log tail: {s.tail()} (log: {s.log_path})"
                )

    def stop(self, timeout: float = 15.0) -> None:
        """Stop every server process and wait until none is left (idempotent).

        SIGINT to each process group (SIGTERM if the servers inherited an ignored SIGINT),
        SIGKILL to what is left after min(3 s, 60% of ``timeout``), then wait until no
        process of the groups is left, at most until ``timeout``. Typical: 1-4 s.
        SwarmError if a process survives (never seen)."""
        with self._lock:
            if self._state == "stopped" or os.getpid() != self._owner_pid:
                return
            self._state = "stopped"
        began = time.monotonic()
        deadline = began + timeout
        try:
            self._terminate(deadline, began + min(_GRACE_SECONDS, 0.6 * timeout))
        finally:
            self._cleanup_files()
            if self._watchdog is not None:
                self._watchdog.release()
                self._watchdog = None
            with _LIVE_LOCK:
                _LIVE_SWARMS.discard(self)
            self.stop_seconds = time.monotonic() - began

    def __enter__(self) -> "LocalSwarm":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (f"LocalSwarm({self.model_dir!r}, servers={self.num_servers}, dht_prefix={self.dht_prefix!r}, "
                f"placement={self.placement}, state={self._state})")

    # ------------------------------------------------------------------ start

    def _launch_all(self, deadline: float) -> None:
        self._workdir = tempfile.mkdtemp(prefix="dist_eval-swarm-")
        tmpdir = os.path.join(self._workdir, "tmp")
        logs = self.log_dir or os.path.join(self._workdir, "logs")
        os.makedirs(tmpdir)
        os.makedirs(logs, exist_ok=True)
        if self.port is None:
            ports = _free_ports(self.num_servers, self.host)
        else:
            ports = [self.port + i for i in range(self.num_servers)]
            for p in ports:
                if not _port_is_free(p, self.host):
                    raise SwarmError(
                        f"port {p} on {self.host} is already in use: pass another port (servers use "
                        f"{ports[0]}..{ports[-1]}), or none to pick free ports."
                    )
        self._servers = [
            _Server(i, ports[i], self.placement[i], os.path.join(logs, f"server-{i}.log"))
            for i in range(self.num_servers)
        ]
        self._watchdog = Watchdog()
        self._watchdog.watch_path(tmpdir)
        if self.log_dir is None:
            self._watchdog.watch_path(self._workdir)
        env = dict(os.environ)
        env.update(HF_HUB_OFFLINE="1", TMPDIR=tmpdir, PYTHONUNBUFFERED="1")
        if os.path.basename(_PROJECT_ROOT) not in ("site-packages", "dist-packages"):  # a source checkout
            env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT_ROOT, env.get("PYTHONPATH")) if p)

        if self.join_peers:  # another host started the swarm: all servers join it at once
            peers, joining = self.join_peers, self._servers
        else:
            first = self._servers[0]
            self._spawn(first, ["--new_swarm"], env)
            self._wait(deadline, [first], need_started=False)
            peers, joining = [first.address], self._servers[1:]
        for s in joining:
            self._spawn(s, ["--initial_peers", *peers], env)
        self._wait(deadline, self._servers, need_started=True)

    def _spawn(self, s: _Server, peer_args: List[str], env: Dict[str, str]) -> None:
        if self._state != "starting":  # stop() was called from another thread meanwhile
            raise SwarmError("local swarm: stopped while starting.")
        cmd = [
            sys.executable, "-m", "dist_eval._server", self.model_dir, *peer_args,
            "--dht_prefix", self.dht_prefix,
            "--device", "cpu", "--torch_dtype", "float32", "--quant_type", "none",
            "--throughput", "1.0", "--skip_reachability_check",
            "--host_maddrs", f"/ip4/{self.host}/tcp/{s.port}",  # listened on and announced
            "--block_indices", f"{s.blocks[0]}:{s.blocks[1]}",
            *self.extra_server_args,
        ]  # fmt: skip
        with open(s.log_path, "wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            s.log_offset = 0
            s.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, cwd=self._workdir, start_new_session=True,
            )  # fmt: skip
        self._watchdog.watch_group(s.proc.pid)

    def _wait(self, deadline: float, servers: List[_Server], need_started: bool) -> None:
        while True:
            pending = []
            for s in servers:
                text = s.read_log()
                if s.address is None:
                    match = _RUNNING_RE.search(text)
                    if match:
                        addrs = [m.group(0) for m in _MADDR_RE.finditer(match.group(1))]
                        mine = [a for a in addrs if a.startswith(f"/ip4/{self.host}/tcp/{s.port}/")]
                        s.address = (mine or addrs or [None])[0]
                if s.address is not None and _STARTED_RE.search(text):
                    s.started = True
                if s.proc.poll() is not None:
                    hint = ""
                    if self.join_peers and "failed to connect to bootstrap peers" in s.read_log():
                        hint = (f" No swarm answered at {' '.join(self.join_peers)}: check the addresses (a running "
                                "swarm prints them) and that its servers' TCP ports are reachable from here.")
                    raise SwarmError(
                        f"local swarm {s.label} exited with code {s.proc.returncode} before serving its blocks;{hint} "
                        f"read its log ({s.log_path}). Log tail: {s.tail()}"
                    )
                if s.address is None or (need_started and not s.started):
                    pending.append(s)
            if not pending:
                return
            if time.monotonic() >= deadline:
                s = pending[0]
                what = "printed its address" if s.address is None else "served its blocks ('Started')"
                raise SwarmError(
                    f"local swarm: {', '.join(p.label for p in pending)} not ready after {self.start_timeout:.0f} s "
                    f"({s.label} never {what}); raise the start timeout on a slow or busy machine, or read "
                    f"{s.log_path}. Log tail: {s.tail()}"
                )
            time.sleep(0.1)

    # ------------------------------------------------------------------ stop

    def _terminate(self, deadline: float, kill_at: float) -> None:
        started = [s for s in self._servers if s.proc is not None]
        if not started:
            return
        pgids = {s.proc.pid for s in started}
        live = self._note_sockets()
        for s in started:
            if s.proc.poll() is None:
                sig = signal.SIGTERM if _ignores_sigint(s.proc.pid) else signal.SIGINT
                _signal_group(s.proc.pid, sig)
            elif s.proc.pid in live:  # main is gone, its children are not
                _signal_group(s.proc.pid, signal.SIGKILL)
        killed = False
        while True:
            for s in started:
                s.proc.poll()  # reap the main processes: a zombie leader keeps its group listed
            live = _live_groups(pgids)
            if not live:
                break
            now = time.monotonic()
            if now >= kill_at and not killed:
                for pgid in live:
                    _signal_group(pgid, signal.SIGKILL)
                killed = True
            if now >= deadline:
                break
            time.sleep(0.05)
        for s in started:
            if s.proc.poll() is None:
                try:
                    s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        left = _live_groups(pgids)
        if left:
            raise SwarmError(
                f"local swarm: processes {sorted(p for procs in left.values() for p in procs)} survived SIGKILL "
                f"of their groups {sorted(left)}; kill them by hand (kill -9 -- -PGID)."
            )

    def _note_sockets(self) -> Dict[int, List[int]]:
        """Remember the hivemind sockets our servers hold: hivemind creates them in /tmp
        whatever TMPDIR says, and leaves some behind even on a clean exit."""
        live = _live_groups(set(self.pgids))
        paths = _unix_socket_paths([p for procs in live.values() for p in procs])
        self._sockets |= {p for p in paths if os.path.basename(p).startswith("hivemind-")}
        return live

    def _cleanup_files(self) -> None:
        for path in self._sockets:
            try:
                os.unlink(path)
            except OSError:
                pass
        if self._workdir is None:
            return
        shutil.rmtree(os.path.join(self._workdir, "tmp"), ignore_errors=True)
        if self.log_dir is None and self._keep_logs:
            return  # the failure message points at these logs
        if self.log_dir is None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        else:
            try:
                os.rmdir(self._workdir)
            except OSError:
                pass

    # ------------------------------------------------------------------ watchdog


# --------------------------------------------------------------------------- CLI


class _Interrupted(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage block
        print(f"dist_eval.swarm: error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(2)


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m dist_eval.swarm",
        description="Serve a saved model folder on a private Petals swarm on 127.0.0.1 (or, with --host and "
        "--initial-peers, as this host's part of a multi-host swarm) until Ctrl-C / SIGTERM. "
        "Prints INITIAL_PEERS=<multiaddrs> on stdout once its servers serve their blocks.",
    )
    p.add_argument("model_dir", help="Folder saved with save_pretrained (config.json + weights).")
    p.add_argument("--servers", type=int, default=2, help="Number of server processes (default 2; with 2+ every block is on 2 servers).")
    p.add_argument("--port", type=int, default=None, help="First TCP port (servers use PORT, PORT+1, ...; default: free ports).")
    p.add_argument("--dht-prefix", default=None, help="DHT prefix to announce the blocks under (default: dist_eval-<folder name>).")
    p.add_argument("--start-timeout", type=float, default=120.0, help="Seconds to wait for every block to be served (default 120).")
    p.add_argument("--blocks-per-server", type=int, default=None, help="Blocks per server (default: every block on 2 servers).")
    p.add_argument("--log-dir", default=None, help="Keep the servers' logs here (default: a temp folder removed at exit).")
    p.add_argument("--host", default="127.0.0.1", help="IPv4 address to listen on and announce: this host's IP that "
                   "the clients reach (default 127.0.0.1: this machine only).")
    p.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR", help="Join the swarm at these "
                   "multiaddrs (another host's INITIAL_PEERS=...) instead of starting a new one.")
    p.add_argument("--block-indices", type=_block_range_arg, default=None, metavar="A:B", help="Serve only blocks "
                   "A..B-1 (end exclusive; other hosts serve the rest). Default: every block.")
    p.add_argument("--device", default=None, help="Torch device of the servers (default cpu; e.g. cuda, cuda:1).")
    return p


def _block_range_arg(text: str) -> Tuple[int, int]:
    start, sep, end = text.partition(":")
    if not sep or not start.strip().isdigit() or not end.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected A:B, e.g. 0:16 for blocks 0..15")
    return int(start), int(end)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _build_parser().parse_args(argv)

    def on_signal(signum, frame):
        # stop once; a second Ctrl-C must not interrupt the stopping itself
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        raise _Interrupted(signal.Signals(signum).name)

    try:
        swarm = LocalSwarm(
            args.model_dir, num_servers=args.servers, dht_prefix=args.dht_prefix, port=args.port,
            blocks_per_server=args.blocks_per_server, start_timeout=args.start_timeout, log_dir=args.log_dir,
            host=args.host, join_peers=args.initial_peers, block_range=args.block_indices,
            extra_server_args=["--device", args.device] if args.device else (),
        )  # fmt: skip
    except SwarmError as e:
        print(f"dist_eval.swarm: error: {e}", file=sys.stderr, flush=True)
        return 2
    # Installed before the servers start: they then begin with default signal handling
    # (even if this process was started with SIGINT ignored) and stop gracefully on SIGINT.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)  # terminal closed
    code = 0
    try:
        swarm.start()
        peers = " ".join(swarm.initial_peers)
        print(f"INITIAL_PEERS={peers}", flush=True)
        placement = ", ".join(f"{a}:{b}" for a, b in swarm.placement)
        first, last = swarm.block_range
        blocks = f"the {swarm.num_blocks} blocks" if (first, last) == (0, swarm.num_blocks) else f"blocks {first}:{last} (of {swarm.num_blocks})"
        joined = f", joined to the swarm at {' '.join(swarm.join_peers)}" if swarm.join_peers else ""
        print(
            f"dist_eval.swarm: {swarm.num_servers} server(s) serve {blocks} of {swarm.model_dir}{joined} "
            f"(block ranges {placement}; ready in {swarm.start_seconds:.1f} s) under dht prefix {swarm.dht_prefix}. "
            f"Evaluate with: torchrun --nproc-per-node N -m dist_eval --backend petals --model {swarm.model_dir} "
            f"--data-files ... --initial-peers {peers} --dht-prefix {swarm.dht_prefix} . Ctrl-C or SIGTERM stops the swarm.",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        while True:
            time.sleep(0.5)
            swarm.check()
    except _Interrupted:
        code = 0
    except SwarmError as e:
        print(f"dist_eval.swarm: error: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        try:
            swarm.stop()
        except SwarmError as e:
            print(f"dist_eval.swarm: error: {e}", file=sys.stderr, flush=True)
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
