"""A local swarm's start: its work folder, its servers started in the order a swarm needs, and the
wait until every block is served; then :meth:`Launch.stop` hands what it made to the teardown.

Without ``join_peers`` the first server starts a new swarm and the others join it through its
address; all start at once, the others waiting for a file holding that address
(:data:`~dist_eval.swarm.server.PEERS_FILE_FLAG`). Their imports are most of a server's start: several
servers are forked from one process that imported them once (:mod:`~dist_eval.swarm.forks`).
With ``join_peers`` (another host's swarm) every server joins it at once. A server counts as
started when it says it serves its blocks (:mod:`~dist_eval.swarm.state_file`), not when its
process exists.

The work folder (a temp folder) holds the servers' private TMPDIR, their identities (kept over
restarts: the same peer id, so the same address), their state files, the first server's address
and, without ``log_dir``, their logs (``server-<i>.log``). A :class:`~dist_eval.watchdog.Watchdog`
process stops the servers and removes the folder if the swarm's process dies without doing it.
Standard library only.
"""
from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from typing import Callable, List, Optional, Sequence, Set

from dist_eval.atomic import atomic_write
from dist_eval.procs import close_all
from dist_eval.swarm import teardown
from dist_eval.swarm.forks import ForkServer
from dist_eval.swarm.placement import SwarmError
from dist_eval.swarm.process import Command, ServerProcess
from dist_eval.swarm.server import PEERS_FILE_FLAG
from dist_eval.swarm.settings import SwarmSettings
from dist_eval.watchdog import Watchdog

# a server whose reported error holds this found no swarm at join_peers: p2pd says so in words only (hivemind
# raises them as P2PDaemonError), so this is the one text the swarm matches; the hint is all it changes
_NO_SWARM_ANSWERED = "failed to connect to bootstrap peers"


class Launch:
    """What one start of a swarm (``settings``) made on this machine: ``workdir``, ``watchdog``, the
    ``servers`` (:meth:`make_servers`, each started with ``command``), the hivemind ``sockets`` they hold.
    """

    def __init__(self, settings: SwarmSettings, command: Command):
        self.settings, self.command = settings, command
        self.workdir = tempfile.mkdtemp(prefix="dist_eval-swarm-")
        self.watchdog = Watchdog()
        self.tmpdir = os.path.join(self.workdir, "tmp")  # the servers' TMPDIR
        self.logs = self.settings.log_dir or os.path.join(self.workdir, "logs")
        os.makedirs(self.tmpdir)
        os.makedirs(self.logs, exist_ok=True)
        self.servers: List[ServerProcess] = []
        self.forks: Optional[ForkServer] = None
        self.sockets: Set[str] = set()  # /tmp/hivemind-*.sock held by the servers (see teardown)
        self.reserved: List[socket.socket] = []  # the servers' TCP ports, held (procs.reserve_ports)
        self._ports_lock, self._stopped = threading.Lock(), False

    def make_servers(self) -> List[ServerProcess]:
        """The server processes, not started: each its port, blocks, log and identity."""
        with self._ports_lock:  # a stop() from another thread meanwhile lets go of what is reserved here
            self._refuse_if_stopped()
            self.reserved = self.settings.reserve_ports()  # held until stop: no other process takes a server's port
            ports = [s.getsockname()[1] for s in self.reserved]  # read here: a stop closes them under this lock
        env = self.settings.env(self.tmpdir)
        # the servers forked from one process that imports their libraries once (forks.py)
        self.forks = ForkServer(env, self.workdir, os.path.join(self.logs, "fork-server.log"), self.watchdog)
        self.servers = [
            ServerProcess(
                i, ports[i], blocks, os.path.join(self.logs, f"server-{i}.log"), host=self.settings.host,
                identity_path=os.path.join(self.workdir, f"identity-{i}.key"),  # its peer id, kept over restarts
                command=self.command, env=env, cwd=self.workdir, watchdog=self.watchdog, before_kill=self.note_sockets,
                forks=self.forks,
            )
            for i, blocks in enumerate(self.settings.placement)
        ]  # fmt: skip
        self.watchdog.watch_path(self.tmpdir)
        if self.settings.log_dir is None:
            self.watchdog.watch_path(self.workdir)
        return self.servers

    def _refuse_if_stopped(self) -> None:
        """A SwarmError where :meth:`stop` ran (another thread) since this start began; under ``_ports_lock``."""
        if self._stopped:
            raise SwarmError("local swarm: stopped while starting")

    @property
    def pgids(self) -> List[int]:
        """Process group ids of the servers started and not seen gone."""
        return [s.pgid for s in self.servers if s.pgid is not None and not s.seen_gone]

    def start(self, spawn: Callable[[ServerProcess, List[str]], None], deadline: float) -> None:
        """Start every server through ``spawn(server, peer_args)``; return once every block is served
        (SwarmError if a server exits first, or at ``deadline``).
        """
        with self._ports_lock:  # stopped since make_servers (which plans its servers all the same): start nothing
            self._refuse_if_stopped()
        join_peers = self.settings.join_peers
        if len(self.servers) > 1 and self.forks.serves(self.command(self.servers[0], [])):
            # several servers: their imports once, before any server starts (and outside the swarm's lock)
            self.forks.start(deadline)
        if join_peers:  # another host started the swarm: all servers join it at once
            for s in self.servers:
                spawn(s, ["--initial_peers", *join_peers])
        else:
            first, peers_file = self.servers[0], os.path.join(self.workdir, teardown.PEERS_FILE)
            spawn(first, ["--new_swarm"])
            for s in self.servers[1:]:
                spawn(s, [PEERS_FILE_FLAG, peers_file])
            self.wait(deadline, [first], serving=False)
            atomic_write(peers_file, first.address + "\n")
        self.wait(deadline, self.servers, serving=True)
        self.note_sockets()

    def wait(self, deadline: float, servers: Sequence[ServerProcess], serving: bool) -> None:
        """Wait until each of ``servers`` has its address (and, with ``serving``, serves its blocks)."""
        while True:
            pending = []
            for s in servers:
                state = s.state
                if state == "exited":
                    raise SwarmError(f"local swarm {s.label} exited with code {s.returncode} before serving its "
                                     f"blocks;{self._why(s)} read its log ({s.log_path}). Log tail: {s.tail()}")
                if s.address is None or (serving and state != "up"):
                    pending.append(s)
            if not pending:
                return
            if time.monotonic() >= deadline:
                s = pending[0]
                what = "announced its address" if s.address is None else "served its blocks"
                raise SwarmError(
                    f"local swarm: {', '.join(p.label for p in pending)} not ready after "
                    f"{self.settings.start_timeout:.0f} s ({s.label} never {what}); raise the start timeout on a "
                    f"slow or busy machine, or read {s.log_path}. Log tail: {s.tail()}"
                )
            time.sleep(0.1)

    def _why(self, server: ServerProcess) -> str:
        """What a server that exited said about why, when it helps."""
        if self.settings.join_peers and _NO_SWARM_ANSWERED in (server.error or ""):
            return (f" No swarm answered at {' '.join(self.settings.join_peers)}: check the addresses (a running "
                    "swarm prints them) and that its servers' TCP ports are reachable from here.")
        return ""

    def note_sockets(self) -> None:
        """Remember the hivemind sockets the servers hold, to remove them at stop (see teardown)."""
        teardown.note_sockets(self.pgids, self.sockets)

    def stop(self, deadline: float, grace: float, drain_s: float, keep_logs: bool) -> None:
        """Stop the servers (:func:`teardown.terminate`), then remove what they left and what this start made
        (:func:`teardown.cleanup_files`; the logs stay with ``keep_logs``), and release the watchdog.
        """
        try:
            teardown.terminate(self.servers, self.sockets, deadline, grace, drain_s)
        finally:
            with self._ports_lock:
                self._stopped = True
                close_all(self.reserved)
            if self.forks is not None:
                self.forks.close()
            teardown.cleanup_files(self.sockets, self.workdir, self.servers, self.settings.log_dir, keep_logs,
                                   wait_for_shm_managers=bool(drain_s))
            self.watchdog.release()


def started(launch: Optional[Launch]) -> bool:
    """Whether ``launch`` started any server (an error then cites their logs)."""
    return launch is not None and any(s.pgid is not None for s in launch.servers)
