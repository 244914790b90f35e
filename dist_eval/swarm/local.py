"""LocalSwarm: K petals server processes on this machine for one saved model folder.

Each server is a :class:`~dist_eval.swarm.process.ServerProcess`; the supervisor
(:mod:`~dist_eval.swarm.supervisor`) restarts those that die, and the teardown
(:mod:`~dist_eval.swarm.teardown`) stops them and removes what they leave. Standard library only.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from dist_eval.atomic import atomic_write
from dist_eval.procs import _free_ports, _port_is_free
from dist_eval.swarm import teardown
from dist_eval.swarm.devices import available_memory, check_num_servers, model_weights, plan_servers, visible_gpu_memory
from dist_eval.swarm.drain import DRAIN_TIMEOUT_S
from dist_eval.swarm.placement import (
    SwarmError,
    _check_block_range,
    _check_host,
    _check_peers,
    _default_prefix,
    _read_num_blocks,
    block_parameters,
    plan_blocks,
)
from dist_eval.swarm.process import ServerProcess
from dist_eval.swarm.server import PEERS_FILE_FLAG
from dist_eval.swarm.supervisor import RestartPolicy, Supervisor
from dist_eval.watchdog import Watchdog

# the module each server process runs: petals' run_server with dist_eval's server-side
# changes (tests run petals' own server in its place, as a swarm of others' servers)
SERVER_MODULE = "dist_eval.swarm.server"
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# SIGINT -> SIGKILL delay. A lone server exits soon after SIGINT, but the last servers of
# a swarm announce "offline" to peers that already left and wait for hivemind's DHT
# timeouts. For a private swarm (all of it going away)
# nothing is lost by cutting that short: its clients have closed, nobody is left to hear
# "offline", and the files hivemind would leave are removed at stop. 0.25 s saves most of a
# second of every demo run over 1 s (benchmarks/RESULTS.md).
# Servers that joined another host's swarm get longer, so that their "offline" reaches it;
# so does a swarm that others may have joined (python -m dist_eval.swarm: stop(grace=...)).
_GRACE_SECONDS_PRIVATE = 0.25
GRACE_SECONDS_ANNOUNCED = 1.0
_GRACE_SECONDS_JOINED = 3.0


def _served_folder(model_dir: str) -> str:
    """``model_dir``, or its copy in the layout petals' server reads (converted once, cached)."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return model_dir  # _read_num_blocks says what is missing
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
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return block_parameters(json.load(f))[first:last]
    except (OSError, ValueError, KeyError, TypeError, SwarmError):
        return None


def _log_to_stderr(line: str) -> None:
    print(f"dist_eval.swarm: {line}", file=sys.stderr, flush=True)


def _check_args(port: Optional[int], num_servers: int, start_timeout: float, dht_prefix: Optional[str]) -> None:
    if port is not None and (not isinstance(port, int) or not 1 <= port <= 65535 - num_servers + 1):
        raise SwarmError(f"port={port!r}: expected a TCP port such that port..port+{num_servers - 1} are valid.")
    if not start_timeout or start_timeout <= 0:
        raise SwarmError(f"start_timeout={start_timeout!r}: expected a positive number of seconds.")
    if dht_prefix is not None and (not dht_prefix or re.search(r"[.\s]", dht_prefix)):
        raise SwarmError(
            f"dht_prefix={dht_prefix!r}: must be non-empty, without '.' or spaces (petals uses them as delimiters)."
        )


class LocalSwarm:
    """K Petals server processes on this machine for one saved model folder: a private
    swarm on 127.0.0.1 (the default), or this host's part of a multi-host swarm.

    ``start()`` (or ``with LocalSwarm(...) as swarm``) returns once every server printed
    ``Started``, i.e. every block is served; then ``initial_peers`` holds one multiaddr
    per server (``/ip4/127.0.0.1/tcp/PORT/p2p/ID``) and ``dht_prefix`` the prefix the
    blocks are announced under: pass both to petals' ``from_pretrained``. A folder in a
    layout petals' server cannot read is served from its converted copy (``model_dir``;
    ``source_dir`` is the folder given, and names the default ``dht_prefix``), see
    :mod:`dist_eval.backends.petals_folder`.

    Placement: each server serves one contiguous range (``--block_indices A:B``). Every
    server holds every block where the K replicas fit in a share of the memory (the GPU's,
    or the memory available here for CPU servers: :func:`~dist_eval.swarm.devices.plan_servers`):
    every request is then one hop. Else (:func:`plan_blocks`) every block is on two
    servers (two layers of servers, each splitting the blocks), so a failed server leaves
    no block missing; each server then holds about 2L/K of the L blocks (K=2: both serve
    all). ``blocks_per_server=B`` overrides: B blocks per server, ranges evenly spread
    (must cover every block). ``placement`` lists the ranges.

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
    through its address (all start at once; the others wait for that address after their
    imports, see :mod:`dist_eval.swarm.server`). Servers run
    ``--quant_type none --throughput 1.0`` (no network speed test) and the device, dtype and
    request size of their :class:`~dist_eval.swarm.devices.ServerPlan` (``server_plan``):
    ``device`` ``"cpu"`` (the default: float32, 2 servers), ``"cuda"``, ``"cuda:K"`` or
    ``"auto"`` (the GPUs if any): on GPUs, fp16/bf16 full replicas, as many per GPU as fit
    (at most 8), accepting 16384-token requests (see :mod:`dist_eval.swarm.devices`).
    ``num_servers`` and ``torch_dtype`` override the plan's; later flags in
    ``extra_server_args`` override any of them.

    Processes: every server is its own session/process group, with ``HF_HUB_OFFLINE=1``
    and a private ``TMPDIR``; its output goes to ``<log_dir>/server-<i>.log`` (a temp
    folder when log_dir is None, deleted on stop unless the start failed). ``stop()``
    sends SIGINT to each group (petals' graceful shutdown), SIGKILL
    to what is left after 0.25 s (3 s for servers that joined another host's swarm), waits
    until no process of the groups remains, then deletes the private TMPDIR and the
    ``/tmp/hivemind-*.sock`` files the servers held (hivemind leaks them). ``stop()`` also
    runs from ``__exit__`` (on exceptions too), at interpreter exit, and from a small
    watchdog process if this process dies without it.

    Restarts: once started, a :class:`~dist_eval.swarm.supervisor.Supervisor` thread restarts
    a server that dies as ``restart`` (a :class:`~dist_eval.swarm.supervisor.RestartPolicy`,
    default: at most 3 restarts in 600 s, 2 s backoff doubling) says, on its port, blocks and
    identity (``--identity_path``: the same address); ``log`` gets one line per event (default:
    stderr). :meth:`check` raises once blocks stay unserved; :meth:`server_state` and
    :meth:`restarts` tell where each server stands.
    """

    def __init__(
        self,
        model_dir: str,
        num_servers: Optional[int] = None,
        dht_prefix: Optional[str] = None,
        port: Optional[int] = None,
        blocks_per_server: Optional[int] = None,
        start_timeout: float = 120.0,
        log_dir: Optional[str] = None,
        extra_server_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        join_peers: Sequence[str] = (),
        block_range: Optional[Tuple[int, int]] = None,
        device: str = "cpu",
        torch_dtype: Optional[str] = None,
        restart: Optional[RestartPolicy] = None,
        log: Optional[Callable[[str], None]] = None,
    ):
        if not os.path.isdir(model_dir):
            raise SwarmError(f"{model_dir}: no such folder. Pass a model folder saved with save_pretrained().")
        check_num_servers(num_servers)
        self.source_dir = os.path.abspath(model_dir)
        self.model_dir = _served_folder(self.source_dir)  # the folder itself, or its copy in petals' layout
        self.num_blocks: int = _read_num_blocks(self.model_dir)
        self.block_range = _check_block_range(block_range or (0, self.num_blocks), self.num_blocks)
        first, last = self.block_range
        self.server_plan = self._plan_servers(device, num_servers, torch_dtype)
        num_servers = self.server_plan.num_servers
        # the plan's ranges by the blocks' sizes, unless blocks_per_server was asked for
        by_size = self.server_plan.block_ranges if blocks_per_server is None else None
        if blocks_per_server is None:
            blocks_per_server = self.server_plan.blocks_per_server
        _check_args(port, num_servers, start_timeout, dht_prefix)
        self.num_servers = num_servers
        self.host = _check_host(host)
        self.join_peers: List[str] = _check_peers(join_peers)
        self.placement: List[Tuple[int, int]] = [
            (first + a, first + b) for a, b in (by_size or plan_blocks(last - first, num_servers, blocks_per_server))
        ]
        self.dht_prefix: str = dht_prefix or _default_prefix(self.source_dir)
        self.port = port
        self.start_timeout = float(start_timeout)
        self.log_dir = os.path.abspath(log_dir) if log_dir else None
        self.extra_server_args = [str(a) for a in extra_server_args]
        self.initial_peers: List[str] = []
        self.start_seconds: Optional[float] = None  # measured by start()
        self.stop_seconds: Optional[float] = None  # measured by stop()
        self._servers: List[ServerProcess] = []
        self._sockets: Set[str] = set()  # /tmp/hivemind-*.sock held by our servers
        self._workdir: Optional[str] = None
        self._keep_logs = False
        self._watchdog: Optional[Watchdog] = None
        self._state = "new"  # new -> starting -> running -> stopped
        self._lock = threading.RLock()
        self._owner_pid = os.getpid()  # a fork()ed child must not stop its parent's swarm
        self._starter: Optional[threading.Thread] = None  # start_in_background()'s thread
        self._start_error: Optional[BaseException] = None
        self.restart = restart if restart is not None else RestartPolicy()
        self._log = log or _log_to_stderr
        self._supervisor: Optional[Supervisor] = None  # from start() on: restarts the servers that die

    def _plan_servers(self, device: str, num_servers: Optional[int], torch_dtype: Optional[str]):
        first, last = self.block_range
        weight_bytes, saved_dtype = model_weights(self.model_dir)
        return plan_servers(
            device, num_servers, torch_dtype, gpu_memory=visible_gpu_memory(device),
            weight_bytes=weight_bytes * (last - first) // self.num_blocks, saved_dtype=saved_dtype,
            num_blocks=last - first, cpus=os.cpu_count() or 1, cpu_memory=available_memory(),
            block_weights=_block_weights(self.model_dir, first, last),
        )  # fmt: skip

    # ------------------------------------------------------------------ public

    @property
    def pgids(self) -> List[int]:
        """Process group ids of the servers started (each server's main pid)."""
        return [s.pgid for s in self._servers if s.pgid is not None and not s.seen_gone]

    @property
    def ports(self) -> List[int]:
        return [s.port for s in self._servers]

    @property
    def log_paths(self) -> List[str]:
        return [s.log_path for s in self._servers]

    @property
    def servers(self) -> Tuple[ServerProcess, ...]:
        """The server processes, in order (empty before :meth:`start`)."""
        return tuple(self._servers)

    @contextmanager
    def running(self) -> Iterator[bool]:
        """Hold the swarm as it is: yields whether it runs, and :meth:`stop` waits until the block ends
        (the supervisor restarts servers within it, so that none starts after a stop).
        """
        with self._lock:
            yield self._state == "running"

    def serves_again(self, server: ServerProcess) -> bool:
        """Whether ``server`` (restarted) serves its blocks; its address then replaces its entry
        in ``initial_peers``.
        """
        if server.state == "up":
            self.initial_peers[server.index] = server.address
            return True
        return False

    def start(self) -> LocalSwarm:
        """Start every server; return once every block is served. On failure or timeout
        everything started is stopped and SwarmError is raised.
        """
        with self._lock:
            if self._state == "running":
                return self
            if self._state != "new":
                raise SwarmError(f"this LocalSwarm is {self._state}; create a new one to start another swarm.")
            self._state = "starting"
        began = time.monotonic()
        teardown.stop_at_exit(self)
        try:
            self._launch_all(deadline=began + self.start_timeout)
        except BaseException:
            self._keep_logs = any(s.pgid is not None for s in self._servers)  # the error cites them
            try:
                self.stop()
            except Exception:  # the start failure is the error to report
                pass
            raise
        self._note_sockets()
        self.initial_peers = [s.address for s in self._servers]
        self.start_seconds = time.monotonic() - began
        with self._lock:
            if self._state != "starting":  # stopped meanwhile
                raise SwarmError("local swarm: stopped while starting.")
            self._state = "running"
            self._supervisor = Supervisor(self, self._log)
            self._supervisor.start()
        return self

    def start_in_background(self) -> LocalSwarm:
        """Begin :meth:`start` in a thread and return at once, so that the caller can work
        (e.g. import its client) while the servers start; :meth:`wait_started` joins it.
        :meth:`stop` may be called meanwhile: the start then fails and starts nothing more.
        """
        def start() -> None:
            try:
                self.start()
            except BaseException as e:  # re-raised by wait_started(), in the caller's thread
                self._start_error = e

        self._starter = threading.Thread(target=start, name="dist_eval-swarm-start", daemon=True)
        self._starter.start()
        return self

    def wait_started(self) -> LocalSwarm:
        """Wait for :meth:`start_in_background`'s start; raise its error if it failed."""
        if self._starter is not None:
            self._starter.join()
        if self._start_error is not None:
            raise self._start_error
        return self

    def check(self) -> None:
        """Raise SwarmError once blocks of this swarm stay without a live server: past
        ``restart.unserved_timeout`` seconds, or with every server holding them down for good
        (see :mod:`dist_eval.swarm.supervisor`). A server that died while others still serve
        its blocks, or that is being restarted, is no error.
        """
        failure = self._supervisor.failure() if self._supervisor is not None else None
        if failure is not None:
            raise SwarmError(f"local swarm: {failure}")

    def server_state(self, index: int) -> str:
        """Server ``index``'s state as its supervisor sees it: "up", "waiting" (dead, its
        restart due), "starting" (restarted, not serving yet) or "down" (stays down).
        """
        return self._supervisor.state(index) if self._supervisor is not None else "new"

    def restarts(self, index: int) -> int:
        """How many times server ``index`` was restarted in the restart window."""
        return self._supervisor.restarts(index) if self._supervisor is not None else 0

    def stop(self, timeout: float = 15.0, grace: Optional[float] = None, drain: bool = False) -> None:
        """Stop every server process and wait until none is left (idempotent).

        SIGINT to each process group (SIGTERM if the servers inherited an ignored SIGINT),
        SIGKILL to what is left after min(``grace``, 60% of ``timeout``), then wait until no
        process of the groups is left, at most until ``timeout``. ``grace`` None: 0.25 s for
        a private swarm (only its owner's clients used it), 3 s for servers that joined
        another host's swarm. ``drain``: others' clients may have requests in flight (a swarm
        others joined); each server's grace begins once its log says it drained them, at most
        :data:`~dist_eval.swarm.drain.DRAIN_TIMEOUT_S` after the SIGINT, and their TMPDIR goes
        once torch's shared-memory manager has left it.
        SwarmError if a process survives (never seen).
        """
        with self._lock:
            if self._state == "stopped" or os.getpid() != self._owner_pid:
                return
            self._state = "stopped"
        if self._supervisor is not None:
            self._supervisor.stop()  # it starts no server once the state says stopped
        began = time.monotonic()
        drain_s = DRAIN_TIMEOUT_S if drain else 0.0
        try:
            if grace is None:
                grace = _GRACE_SECONDS_JOINED if self.join_peers else _GRACE_SECONDS_PRIVATE
            teardown.terminate(self._servers, self._sockets, began + drain_s + timeout, min(grace, 0.6 * timeout),
                               drain_s)
        finally:
            teardown.cleanup_files(self._sockets, self._workdir, self._servers, self.log_dir, self._keep_logs,
                                   wait_for_shm_managers=drain)
            if self._watchdog is not None:
                self._watchdog.release()
                self._watchdog = None
            teardown.forget_at_exit(self)
            if self._starter is not None and self._starter is not threading.current_thread():
                self._starter.join(timeout=5.0)  # its servers are gone: it fails at once
            self.stop_seconds = time.monotonic() - began

    def __enter__(self) -> LocalSwarm:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (
            f"LocalSwarm({self.model_dir!r}, servers={self.num_servers}, dht_prefix={self.dht_prefix!r}, "
            f"placement={self.placement}, state={self._state})"
        )

    # ------------------------------------------------------------------ start

    def _launch_all(self, deadline: float) -> None:
        with self._lock:  # a stop() from another thread sees the folder and the watchdog, or prevents them
            if self._state != "starting":
                raise SwarmError("local swarm: stopped while starting.")
            self._workdir = tempfile.mkdtemp(prefix="dist_eval-swarm-")
            self._watchdog = watchdog = Watchdog()
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
        env = self._server_env(tmpdir)
        self._servers = [
            ServerProcess(
                i, ports[i], self.placement[i], os.path.join(logs, f"server-{i}.log"), host=self.host,
                identity_path=os.path.join(self._workdir, f"identity-{i}.key"),  # its peer id, kept over restarts
                command=self._command, env=env, cwd=self._workdir, watchdog=watchdog, before_kill=self._note_sockets,
            )
            for i in range(self.num_servers)
        ]  # fmt: skip
        watchdog.watch_path(tmpdir)
        if self.log_dir is None:
            watchdog.watch_path(self._workdir)

        if self.join_peers:  # another host started the swarm: all servers join it at once
            for s in self._servers:
                self._spawn(s, ["--initial_peers", *self.join_peers])
        else:
            # The first server starts the swarm; the others start at the same time (their
            # imports are most of a server's start-up) and join once its address is known.
            first, peers_file = self._servers[0], os.path.join(self._workdir, teardown.PEERS_FILE)
            self._spawn(first, ["--new_swarm"])
            for s in self._servers[1:]:
                self._spawn(s, [PEERS_FILE_FLAG, peers_file])
            self._wait(deadline, [first], need_started=False)
            atomic_write(peers_file, first.address + "\n")
        self._wait(deadline, self._servers, need_started=True)

    def _server_env(self, tmpdir: str) -> Dict[str, str]:
        """The servers' environment: offline, their private TMPDIR, the plan's threads, this checkout."""
        env = dict(os.environ)
        env.update(HF_HUB_OFFLINE="1", TMPDIR=tmpdir, PYTHONUNBUFFERED="1")
        if self.server_plan.threads and "OMP_NUM_THREADS" not in env:  # an operator's setting stands
            env["OMP_NUM_THREADS"] = str(self.server_plan.threads)
        if os.path.basename(_PROJECT_ROOT) not in ("site-packages", "dist-packages"):  # a source checkout
            env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT_ROOT, env.get("PYTHONPATH")) if p)
        return env

    def _spawn(self, s: ServerProcess, peer_args: List[str]) -> None:
        with self._lock:  # stop() (from another thread) either sees this server or stops it from starting
            if self._state != "starting":
                raise SwarmError("local swarm: stopped while starting.")
            s.start(peer_args)

    def _command(self, s: ServerProcess, peer_args: Sequence[str]) -> List[str]:
        """Server ``s``'s command line, with ``peer_args`` (how it finds the swarm)."""
        return [
            sys.executable, "-m", SERVER_MODULE, self.model_dir, *peer_args,
            "--dht_prefix", self.dht_prefix,
            *self.server_plan.server_args(s.index), "--quant_type", "none",
            "--throughput", "1.0", "--skip_reachability_check",
            "--host_maddrs", f"/ip4/{self.host}/tcp/{s.port}",  # listened on and announced
            "--block_indices", f"{s.blocks[0]}:{s.blocks[1]}",
            # its peer id (so its address) kept over restarts
            "--identity_path", s.identity_path,
            *self.extra_server_args,
        ]  # fmt: skip

    def _wait(self, deadline: float, servers: List[ServerProcess], need_started: bool) -> None:
        while True:
            pending = []
            for s in servers:
                state = s.state  # its log read, then its exit polled
                if state == "exited":
                    hint = ""
                    if self.join_peers and "failed to connect to bootstrap peers" in s.read_log():
                        hint = (
                            f" No swarm answered at {' '.join(self.join_peers)}: check the addresses (a running "
                            "swarm prints them) and that its servers' TCP ports are reachable from here."
                        )
                    raise SwarmError(
                        f"local swarm {s.label} exited with code {s.returncode} before serving its blocks;{hint} "
                        f"read its log ({s.log_path}). Log tail: {s.tail()}"
                    )
                if s.address is None or (need_started and state != "up"):
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

    def _note_sockets(self) -> None:
        """Remember the hivemind sockets our servers hold, to remove them at stop (see teardown)."""
        teardown.note_sockets(self.pgids, self._sockets)


def start_for_run(model_dir: str, num_servers: Optional[int], dht_prefix: Optional[str], device: str,
                  say: Callable[..., None]) -> LocalSwarm:
    """Rank 0 of a run without --initial-peers: a local swarm serving the model, starting in the
    background (``wait_started()``); the caller stops it when the run ends.
    """
    from dist_eval import ranks
    from dist_eval.errors import UsageError

    if ranks.launched_on_several_nodes():  # its servers listen on 127.0.0.1 of rank 0's node only
        raise UsageError(
            "--initial-peers: omitted on a run over several nodes, but the local swarm started then "
            "is reachable from rank 0's node only. Start servers every node can reach "
            "(launch/start_server.sh on a host, HOST=<its IP>) and pass the INITIAL_PEERS=... they "
            "print with --initial-peers, and their --dht-prefix."
        )
    swarm = LocalSwarm(model_dir, num_servers=num_servers, dht_prefix=dht_prefix, device=device)
    plan = swarm.server_plan
    say(f"dist_eval: starting a local swarm of {plan.num_servers} server(s) ({plan.describe()}) "
        f"for {model_dir} ...", flush=True)
    return swarm.start_in_background()
