"""LocalSwarm: K petals server processes on this machine for one saved model folder.

In data-flow order: its settings (:mod:`~dist_eval.swarm.settings`: the folder, the plan, the
placement), its start (:mod:`~dist_eval.swarm.launch`: the servers, each a
:class:`~dist_eval.swarm.process.ServerProcess`), its supervision (:mod:`~dist_eval.swarm.supervisor`:
the servers that die restarted), its stop (:mod:`~dist_eval.swarm.teardown`). This module holds
their order: new -> starting -> running -> stopped, from any thread. Standard library only.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional, Sequence, Set, Tuple

from dist_eval.swarm import settings as swarm_settings
from dist_eval.swarm import teardown
from dist_eval.swarm.devices import available_memory, visible_gpu_memory
from dist_eval.swarm.drain import DRAIN_TIMEOUT_S
from dist_eval.swarm.launch import Launch, started
from dist_eval.swarm.placement import SwarmError
from dist_eval.swarm.process import ServerProcess
from dist_eval.swarm.supervisor import RestartPolicy, Supervisor

# the module each server process runs: petals' run_server with dist_eval's server-side
# changes (tests run petals' own server in its place, as a swarm of others' servers)
SERVER_MODULE = "dist_eval.swarm.server"


def _log_to_stderr(line: str) -> None:
    print(f"dist_eval.swarm: {line}", file=sys.stderr, flush=True)


class LocalSwarm:
    """K Petals server processes on this machine for one saved model folder: a private
    swarm on 127.0.0.1 (the default), or this host's part of a multi-host swarm.

    ``start()`` (or ``with LocalSwarm(...) as swarm``) returns once every server serves its blocks;
    then ``initial_peers`` holds one multiaddr per server (``/ip4/127.0.0.1/tcp/PORT/p2p/ID``) and
    ``dht_prefix`` the prefix the blocks are announced under: pass both to petals' ``from_pretrained``.
    The arguments and what the swarm makes of them (``model_dir``, ``server_plan``, ``placement``,
    ...: the fields of :class:`~dist_eval.swarm.settings.SwarmSettings`, read as the swarm's own) are
    :mod:`~dist_eval.swarm.settings`'s.

    Several hosts: ``host`` is the IPv4 address the servers listen on and announce; ``join_peers``
    (multiaddrs of a running swarm): every server joins it, ``start()`` returns once *this host's*
    blocks are served, and ``initial_peers`` lists this host's servers. Use the same ``dht_prefix``
    on every host. Ports: ``port=None`` takes free ports from the OS; ``port=P`` uses P, P+1, ....

    Processes: each server its own process group, its output in ``<log_dir>/server-<i>.log`` (a temp
    folder when log_dir is None, deleted on stop unless the start failed). ``stop()`` also runs from
    ``__exit__``, at interpreter exit, and from a watchdog process if this process dies without it.

    Restarts: once started, a :class:`~dist_eval.swarm.supervisor.Supervisor` thread restarts a server
    that dies as ``restart`` (a :class:`~dist_eval.swarm.supervisor.RestartPolicy`) says; ``log`` gets
    one line per event (default: stderr). :meth:`check` raises once blocks stay unserved;
    :meth:`server_state` and :meth:`restarts` tell where each server stands.
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
        self.settings = s = swarm_settings.decide(
            model_dir, num_servers=num_servers, dht_prefix=dht_prefix, port=port,
            blocks_per_server=blocks_per_server, start_timeout=start_timeout, log_dir=log_dir,
            extra_server_args=extra_server_args, host=host, join_peers=join_peers, block_range=block_range,
            device=device, torch_dtype=torch_dtype, gpu_memory=visible_gpu_memory, cpu_memory=available_memory,
        )  # fmt: skip
        # the settings, read as the swarm's own (by its callers, the supervisor and the CLI)
        self.source_dir, self.model_dir, self.num_blocks = s.source_dir, s.model_dir, s.num_blocks
        self.block_range, self.server_plan, self.num_servers = s.block_range, s.server_plan, s.num_servers
        self.placement, self.dht_prefix, self.host, self.join_peers = s.placement, s.dht_prefix, s.host, s.join_peers
        self.port, self.start_timeout, self.log_dir = s.port, s.start_timeout, s.log_dir
        self.extra_server_args = s.extra_server_args
        self.restart = restart if restart is not None else RestartPolicy()
        self.initial_peers: List[str] = []
        self.start_seconds: Optional[float] = None  # measured by start()
        self._launch: Optional[Launch] = None  # from start() on: the work folder, the servers
        self._keep_logs = False  # the start failed: its error cites the logs
        self._state = "new"  # new -> starting -> running -> stopped
        self._lock = threading.RLock()
        self._owner_pid = os.getpid()  # a fork()ed child must not stop its parent's swarm
        self._starter: Optional[threading.Thread] = None  # start_in_background()'s thread
        self._start_error: Optional[BaseException] = None
        self._log = log or _log_to_stderr
        self._supervisor: Optional[Supervisor] = None  # from start() on: restarts the servers that die

    # ------------------------------------------------------------------ what it holds

    @property
    def servers(self) -> Tuple[ServerProcess, ...]:
        """The server processes, in order (empty before :meth:`start`)."""
        return tuple(self._launch.servers) if self._launch is not None else ()

    @property
    def pgids(self) -> List[int]:
        """Process group ids of the servers started (each server's main pid)."""
        return self._launch.pgids if self._launch is not None else []

    @property
    def ports(self) -> List[int]:
        return [s.port for s in self.servers]

    @property
    def log_paths(self) -> List[str]:
        return [s.log_path for s in self.servers]

    @property
    def workdir(self) -> Optional[str]:
        """Its temp folder (the servers' TMPDIR, identities, state files; logs without ``log_dir``), from start on."""
        return self._launch.workdir if self._launch is not None else None

    @property
    def sockets(self) -> Set[str]:
        """The hivemind sockets its servers were seen to hold (removed at stop)."""
        return set(self._launch.sockets) if self._launch is not None else set()

    @property
    def starting_in_background(self) -> bool:
        """Whether :meth:`start_in_background`'s thread still runs."""
        return self._starter is not None and self._starter.is_alive()

    # ------------------------------------------------------------------ start

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
            with self._lock:  # a stop() from another thread sees the folder and the watchdog, or prevents them
                self._check_starting()
                self._launch = Launch(self.settings, self._command)
            self._launch.make_servers()
            self._launch.start(self._spawn, deadline=began + self.start_timeout)
        except BaseException:
            self._keep_logs = started(self._launch)  # the error cites them
            try:
                self.stop()
            except Exception:  # the start failure is the error to report
                pass
            raise
        self.initial_peers = [s.address for s in self.servers]
        self.start_seconds = time.monotonic() - began
        with self._lock:
            self._check_starting()  # stopped meanwhile
            self._state = "running"
            self._supervisor = Supervisor(self, self._log)
            self._supervisor.start()
        return self

    def _check_starting(self) -> None:
        if self._state != "starting":
            raise SwarmError("local swarm: stopped while starting.")

    def _command(self, server: ServerProcess, peer_args: Sequence[str]) -> List[str]:
        return self.settings.command(SERVER_MODULE, server, peer_args)  # read here: tests replace SERVER_MODULE

    def _spawn(self, server: ServerProcess, peer_args: List[str]) -> None:
        with self._lock:  # stop() (from another thread) either sees this server or stops it from starting
            self._check_starting()
            server.start(peer_args)

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

    # ------------------------------------------------------------------ running: what the supervisor asks

    @contextmanager
    def running(self) -> Iterator[bool]:
        """Hold the swarm as it is: yields whether it runs, and :meth:`stop` waits until the block ends
        (the supervisor restarts servers within it, so that none starts after a stop).
        """
        with self._lock:
            yield self._state == "running"

    def serves_again(self, server: ServerProcess) -> bool:
        """Whether ``server`` (restarted) serves its blocks; its address then replaces its entry in
        ``initial_peers``.
        """
        if server.state == "up":
            self.initial_peers[server.index] = server.address
            if self._launch is not None:  # its new p2pd's sockets, removed at stop even if it is killed whole
                self._launch.note_sockets()
            return True
        return False

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

    # ------------------------------------------------------------------ stop

    def stop(self, timeout: float = 15.0, grace: Optional[float] = None, drain: bool = False) -> None:
        """Stop every server process and wait until none is left, then remove what they left (idempotent;
        :mod:`~dist_eval.swarm.teardown`): SIGKILL after min(``grace``, 60% of ``timeout``), ``grace`` None:
        0.25 s for a private swarm, 3 s for servers that joined another host's. ``drain``: others' clients
        may have requests in flight; each server's grace begins once it drained them (at most
        :data:`~dist_eval.swarm.drain.DRAIN_TIMEOUT_S`). SwarmError if a process survives (never seen).
        """
        with self._lock:
            if self._state == "stopped" or os.getpid() != self._owner_pid:
                return
            self._state = "stopped"
        if self._supervisor is not None:
            self._supervisor.stop()  # it starts no server once the state says stopped
        began = time.monotonic()
        drain_s = DRAIN_TIMEOUT_S if drain else 0.0
        if grace is None:
            grace = teardown.GRACE_SECONDS_JOINED if self.join_peers else teardown.GRACE_SECONDS_PRIVATE
        try:
            if self._launch is not None:
                self._launch.stop(began + drain_s + timeout, min(grace, 0.6 * timeout), drain_s, self._keep_logs)
        finally:
            teardown.forget_at_exit(self)
            if self._starter is not None and self._starter is not threading.current_thread():
                self._starter.join(timeout=5.0)  # its servers are gone: it fails at once

    def __enter__(self) -> LocalSwarm:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (
            f"LocalSwarm({self.model_dir!r}, servers={self.num_servers}, dht_prefix={self.dht_prefix!r}, "
            f"placement={self.placement}, state={self._state})"
        )


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
