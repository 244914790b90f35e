"""One server process of a local swarm: started with its command line and log, its state read from
the file it reports to (:mod:`~dist_eval.swarm.state_file`: its address, whether it serves, whether it
drained), stopped or killed with its whole process group, restarted on the same port, blocks and identity.

A petals server spawns about eleven processes (among them the p2pd daemon that holds its port),
so each server is its own session/process group and is signalled as a group; once that group
was seen empty it is never signalled again (pids wrap: a new group may carry the same id).

Standard library only.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from dist_eval import procs
from dist_eval.errors import one_line
from dist_eval.swarm import state_file
from dist_eval.swarm.forks import ForkServer

# its command line, given the server and its peer flags (``--new_swarm``, ``--initial_peers ...``)
Command = Callable[["ServerProcess", Sequence[str]], List[str]]
# What a server says in its state file, as :attr:`ServerProcess.state` names it
_STATES = {state_file.UP: "up", state_file.DRAINING: "stopping", state_file.DRAINED: "stopping"}


class ServerProcess:
    """Server ``index`` of a swarm: blocks ``blocks`` on ``host``:``port``, its output in
    ``log_path``, its peer id kept in ``identity_path`` (so its address survives a restart), its
    state reported in ``state_path`` (default: ``state-<index>.json`` in ``cwd``).

    ``command(server, peer_args)`` makes its command line (``--state_file PATH`` is added to it); it
    runs with ``env`` in ``cwd``; ``watchdog`` (a :class:`~dist_eval.watchdog.Watchdog`) is told each
    process group it starts; ``before_kill()`` runs before each :meth:`kill` (the swarm notes the
    sockets its servers hold); ``forks`` (a :class:`~dist_eval.swarm.forks.ForkServer`) forks it where it
    can, with the libraries a server imports already imported (else it is started as a new process).
    """

    def __init__(self, index: int, port: int, blocks: Tuple[int, int], log_path: str, *, host: str,
                 identity_path: str, command: Command, env: Dict[str, str], cwd: str, watchdog=None,
                 before_kill: Optional[Callable[[], object]] = None, state_path: Optional[str] = None,
                 forks: Optional[ForkServer] = None):
        self.index, self.port, self.blocks, self.log_path = index, port, blocks, log_path
        self.host, self.identity_path = host, identity_path
        self.state_path = state_path or os.path.join(cwd, f"state-{index}.json")
        self._command, self._env, self._cwd = command, env, cwd
        self._watchdog, self._before_kill = watchdog, before_kill
        self._forks = forks
        self.proc = None  # a subprocess.Popen, or a forks.ForkedProcess used as one
        self._log_offset = 0
        self._log_text = ""
        # its process group was seen empty: never signalled again, since pids wrap (pid_max may be
        # 32768) and a new group may then carry the same id: another swarm's server, say
        self._seen_gone = False

    @property
    def label(self) -> str:
        """How log lines and errors name it."""
        return f"server {self.index} (blocks {self.blocks[0]}:{self.blocks[1]}, port {self.port})"

    @property
    def pgid(self) -> Optional[int]:
        """Its process group id (its main process's pid), None before it started."""
        return self.proc.pid if self.proc is not None else None

    @property
    def seen_gone(self) -> bool:
        """Its process group was seen empty (by :meth:`gone`): it is never signalled again."""
        return self._seen_gone

    @property
    def returncode(self) -> Optional[int]:
        """Its main process's exit code as last polled (None: running, or not started)."""
        return self.proc.returncode if self.proc is not None else None

    @property
    def state(self) -> str:
        """Where it stands, by its exit and its state file: "new" (not started), "starting" (running,
        not serving yet), "up" (serving its blocks), "stopping" (told to stop: draining or drained)
        or "exited" (see :attr:`returncode`).
        """
        if self.proc is None:
            return "new"
        if self.poll() is not None:
            return "exited"
        return _STATES.get(self._said().get("state"), "starting")

    @property
    def address(self) -> Optional[str]:
        """Its multiaddr on ``host``:``port`` (else the first it announces) since this start, or None
        before its DHT runs.
        """
        addresses = [str(a) for a in self._said().get("addresses") or ()]
        mine = [a for a in addresses if a.startswith(f"/ip4/{self.host}/tcp/{self.port}/")]
        return (mine or addresses or [None])[0]

    @property
    def drained(self) -> bool:
        """It finished its requests in flight after it was told to stop (:mod:`~dist_eval.swarm.drain`)."""
        return self._said().get("state") == state_file.DRAINED

    @property
    def error(self) -> Optional[str]:
        """Why its start failed (the exception it raised, as the server reported it), or None."""
        said = self._said()
        return said.get("error") if said.get("state") == state_file.FAILED else None

    def _said(self) -> dict:
        return state_file.read(self.state_path, self.pgid)

    def start(self, peer_args: Sequence[str]) -> None:
        """Start it (its log written afresh) with ``peer_args``: ``--new_swarm``, or how it finds the swarm."""
        self._spawn(peer_args, mode="wb")

    def restart(self, peers: Sequence[str]) -> None:
        """Start it again (same port, blocks and identity; its log appended to), joining the swarm
        through the multiaddrs ``peers``, or starting a new swarm where there are none.
        """
        self._spawn(["--initial_peers", *peers] if peers else ["--new_swarm"], mode="ab")

    def _spawn(self, peer_args: Sequence[str], mode: str) -> None:
        cmd = [*self._command(self, peer_args), state_file.FLAG, self.state_path]
        try:
            os.unlink(self.state_path)  # an earlier start's (ignored anyway: another pid)
        except OSError:
            pass
        with open(self.log_path, mode) as log:
            self._log_offset, self._log_text = log.tell(), ""  # a restart's log is read from its own start
            log.write(("$ " + " ".join(cmd) + "\n").encode())
        self._seen_gone = False  # a new process, a new group
        forked = None
        if self._forks is not None and self._forks.serves(cmd):  # made with this env and cwd (launch.py)
            forked = self._forks.spawn(cmd, self.log_path)  # its output appended to the log
        if forked is not None:
            self.proc = forked
            return  # the fork server told the watchdog its group
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self._env, cwd=self._cwd, start_new_session=True,
            )  # fmt: skip
        if self._watchdog is not None:
            self._watchdog.watch_group(self.proc.pid)

    def poll(self) -> Optional[int]:
        """Reap its main process if it exited (a zombie leader keeps its group listed); its exit code or None."""
        return self.proc.poll() if self.proc is not None else None

    def wait(self, timeout: float) -> Optional[int]:
        """Wait up to ``timeout`` seconds for its main process to exit; its exit code, or None if it runs on."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def read_log(self) -> str:
        """Its log since its last (re)start (read on from where the last call stopped): for people and
        error messages; the swarm learns its state from its state file.
        """
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                chunk = f.read()
        except OSError:
            return self._log_text
        self._log_offset += len(chunk)
        self._log_text += chunk.decode("utf-8", "replace")
        return self._log_text

    def tail(self, lines: int = 6) -> str:
        """The last ``lines`` non-empty lines of its log, on one line."""
        kept = [one_line(line, 197) for line in self.read_log().splitlines() if line.strip()][-lines:]
        return " | ".join(kept) if kept else "(empty log)"

    def interrupt(self, main_only: bool = False) -> None:
        """SIGINT (petals' graceful shutdown; SIGTERM if it inherited an ignored SIGINT) to its
        group, or to its main process alone (``main_only``: its helpers serve on while it drains).
        """
        sig = signal.SIGTERM if procs.ignores_sigint(self.proc.pid) else signal.SIGINT
        if main_only:
            self.proc.send_signal(sig)
        else:
            procs.signal_group(self.proc.pid, sig)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to its whole process group, unless that group was seen gone."""
        if not self._seen_gone:
            procs.signal_group(self.proc.pid, sig)

    def kill(self, wait: float = 2.0) -> None:
        """SIGKILL what is left of its process group, and wait up to ``wait`` seconds to see it
        gone (then its id is never signalled again).
        """
        if self._seen_gone:
            return
        if self._before_kill is not None:
            self._before_kill()
        procs.signal_group(self.proc.pid, signal.SIGKILL)
        end = time.monotonic() + wait
        while not self.gone() and time.monotonic() < end:
            time.sleep(0.02)

    def gone(self) -> bool:
        """Whether its main process exited and no process of its group is left (checked now)."""
        if not self._seen_gone:
            self.proc.poll()  # reaped: a zombie leader keeps its group listed
            self._seen_gone = self.proc.returncode is not None and not procs.live_groups({self.proc.pid})
        return self._seen_gone

    def stop(self, grace: float = 0.25, timeout: float = 15.0) -> Optional[int]:
        """Stop it alone: :meth:`interrupt`, SIGKILL to its group after ``grace`` seconds, then
        wait up to ``timeout`` seconds to see the group gone; its exit code. (A swarm stops its
        servers together: :mod:`~dist_eval.swarm.teardown`.)
        """
        if self.proc is None or self._seen_gone:
            return self.returncode
        if self.poll() is None:
            self.interrupt()
        end = time.monotonic() + grace
        while not self.gone() and time.monotonic() < end:
            time.sleep(0.02)
        self.kill(wait=timeout)
        return self.poll()
