"""A local swarm's servers forked from one process that imported their libraries once.

Most of a server's start is its imports (torch, transformers, hivemind, petals: ~5 s of CPU each);
a swarm of K servers on one machine paid them K times, at once, on the same cores. The fork server
(``python -m dist_eval.swarm.server --dist_eval_fork_server``, one per swarm start, with the
servers' environment and folder) imports them once, then forks each server, which runs as
``python -m dist_eval.swarm.server ARGS`` would: its own session and process group, its log as
stdout and stderr, stdin from /dev/null, its exit code or signal as Popen reports it. A command it
cannot serve (another module, environment or folder), or a fork server that failed to start, is
started by Popen instead.

Protocol (JSON lines): the swarm writes ``{"argv": [...], "log": PATH}`` to its stdin; it answers
each with ``{"pid": N}`` (or ``{"error": ...}``) on its stdout, in order, and says ``{"exited": N,
"code": C}`` when a server it forked exits. It ends at the end of its stdin (the swarm stopped, or
died: the servers, in their own sessions, are stopped by the swarm or its watchdog as before).

Standard library only in the swarm's process.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

SERVER_MODULE = "dist_eval.swarm.server"
# ``python -m dist_eval.swarm.server FORK_SERVER_FLAG``: the fork server (so that ``ps``, and whatever finds a
# swarm's processes by their command line, names the fork server and the servers forked from it as servers)
FORK_SERVER_FLAG = "--dist_eval_fork_server"
# what a server imports before its model's own part: imported once here (import_petals applies the
# client patches every petals process gets; the server's own patches are applied by each server)
_PRELOAD = ("dist_eval.swarm.wire", "dist_eval.backends.blocks", "dist_eval.swarm.blocks", "dist_eval.swarm.drain",
            "dist_eval.swarm.merged_forward", SERVER_MODULE)


class ForkedProcess:
    """A server forked by a :class:`ForkServer`, used as a ``subprocess.Popen`` is: ``pid`` (it leads
    its own process group), ``poll``, ``wait``, ``returncode``, ``send_signal``.
    """

    def __init__(self, forks: ForkServer, pid: int, args: List[str]):
        self._forks, self.pid, self.args = forks, pid, args

    @property
    def returncode(self) -> Optional[int]:
        return self._forks.exit_code(self.pid)

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        with self._forks.changed:
            if not self._forks.changed.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


class ForkServer:
    """The fork server of one swarm start: its servers' environment ``env`` and folder ``cwd``; its own
    output in ``log_path``; ``watchdog`` told its process group. Started by :meth:`start`.
    """

    def __init__(self, env: Dict[str, str], cwd: str, log_path: str, watchdog=None):
        self.env, self.cwd, self.log_path, self._watchdog = dict(env), cwd, log_path, watchdog
        self._proc: Optional[subprocess.Popen] = None
        self._failed = False
        self._lock = threading.Lock()  # one request at a time: the answers come in order
        self.changed = threading.Condition()
        self._answers: List[dict] = []
        self._codes: Dict[int, int] = {}
        self._pids: List[int] = []  # the servers forked here
        self._reader: Optional[threading.Thread] = None
        self._reader_done = False

    def serves(self, cmd: List[str]) -> bool:
        """Whether ``cmd`` (run with this fork server's environment, in its folder) can be forked from here
        (else: Popen).
        """
        return not self._failed and cmd[:3] == [sys.executable, "-m", SERVER_MODULE]

    def start(self, deadline: float) -> None:
        """Start the fork server and wait (until the ``time.monotonic()`` ``deadline``) for its imports;
        a fork server that failed or is not ready by then is not used (:meth:`spawn` returns None).
        """
        with self._lock:
            if self._proc is not None or self._failed:
                return
            try:
                with open(self.log_path, "ab") as log:
                    self._proc = subprocess.Popen(
                        [sys.executable, "-m", SERVER_MODULE, FORK_SERVER_FLAG], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=log, env=self.env, cwd=self.cwd, start_new_session=True,
                    )  # fmt: skip
            except OSError:  # e.g. the swarm stopped meanwhile and removed its folder: the servers' start says
                self._failed = True
                return
            if self._failed:  # closed meanwhile (a stop while the swarm starts), maybe before this Popen
                self._proc.kill()
                self._proc.wait()
                for pipe in (self._proc.stdin, self._proc.stdout):  # close() may have closed stdin already
                    pipe.close()
                return
            if self._watchdog is not None:
                self._watchdog.watch_group(self._proc.pid)
            self._reader = threading.Thread(target=self._read, name="dist_eval-fork-server", daemon=True)
            self._reader.start()
        with self.changed:
            ready = self.changed.wait_for(lambda: self._answers or self._reader_done,
                                          max(0.0, deadline - time.monotonic()))
            said = self._answers.pop(0) if ready and self._answers else {}
        if not said.get("ready"):
            self.close()  # not used: its servers start as processes of their own

    def spawn(self, cmd: List[str], log_path: str) -> Optional[ForkedProcess]:
        """Fork ``cmd``'s server (its output appended to ``log_path``); None if this fork server cannot
        (it failed to start or ended: the caller starts the command itself).
        """
        with self._lock:
            if self._failed or self._proc is None:
                return None
            try:
                self._proc.stdin.write((json.dumps({"argv": cmd[3:], "log": log_path}) + "\n").encode())
                self._proc.stdin.flush()
            except OSError:
                self._failed = True
                return None
            with self.changed:
                self.changed.wait_for(lambda: self._answers or self._reader_done)
                answer = self._answers.pop(0) if self._answers else {}
        if "pid" not in answer:
            self._failed = True
            return None
        with self.changed:
            self._pids.append(answer["pid"])
        if self._watchdog is not None:
            self._watchdog.watch_group(answer["pid"])
        return ForkedProcess(self, answer["pid"], cmd)

    def exit_code(self, pid: int) -> Optional[int]:
        """The exit code of the server ``pid`` forked here (Popen's: -N for signal N), None while it runs."""
        with self.changed:
            return self._codes.get(pid)

    def close(self, timeout: float = 2.0) -> None:
        """End the fork server (the end of its stdin), SIGKILL after ``timeout`` s; the servers it forked
        are the swarm's to stop.
        """
        self._failed = True  # nothing more is forked, nor started (start() checks it again after its Popen)
        if self._proc is None:
            return
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()  # e.g. still importing: it has forked nothing
            self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=timeout)

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                said = json.loads(line)
            except ValueError:
                continue
            with self.changed:
                if "exited" in said:
                    self._codes[said["exited"]] = said["code"]
                else:
                    self._answers.append(said)
                self.changed.notify_all()
        with self.changed:
            # it ended: its servers' exits are no longer told; each one gone is read as killed
            self._reader_done = True
            self.changed.notify_all()
        self._watch_orphans()

    def _watch_orphans(self) -> None:
        """After the fork server's end (normally once every server it forked was stopped): a server
        still listed as running and no longer alive exited unseen (SIGKILL, as far as anyone can tell).
        """
        from dist_eval import procs

        while True:
            with self.changed:
                running = [pid for pid in self._pids if pid not in self._codes]
                for pid in running:
                    if not procs.is_running(pid):
                        self._codes[pid] = -signal.SIGKILL
                        self.changed.notify_all()
                running = [pid for pid in running if pid not in self._codes]
            if not running:
                return
            time.sleep(0.2)


# --- the fork server's own process -------------------------------------------------------------------

def _reply(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _fork(request: dict, wakeup: tuple) -> Optional[List[str]]:
    """Fork one server; in the child: its arguments (it becomes the server), in this process: None."""
    session_made = os.pipe()
    pid = os.fork()
    if pid:
        os.close(session_made[1])
        os.read(session_made[0], 1)  # its end: once it leads its group, so a signal to the group reaches it
        os.close(session_made[0])
        _reply({"pid": pid})
        return None
    try:  # the child: never back into the fork server's loop, whatever fails here
        os.close(session_made[0])
        os.setsid()  # its own session and group, as Popen's start_new_session
        os.close(session_made[1])
        # hivemind's locks, made at its import here, are not shared with the other servers (one killed while
        # holding one hung them all)
        from dist_eval.backends.petals.shims import own_hivemind_locks

        own_hivemind_locks()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in wakeup:
            os.close(fd)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        return list(request["argv"])
    except BaseException as e:  # its exit (1) is told as any server's; the fork server's log says why
        os.write(2, f"dist_eval fork server: a forked server failed to start: {type(e).__name__}: {e}\n".encode())
        sys.exit(1)  # past serve()'s handler, out of the fork server's loop


def serve() -> Optional[List[str]]:
    """The fork server's loop: import once, then fork a server per request until stdin ends. Returns
    only in a forked child (its server's arguments) or at the end (None).
    """
    import importlib

    from dist_eval.backends.petals.shims import import_petals

    import_petals()
    for module in _PRELOAD:
        importlib.import_module(module)
    if threading.active_count() != 1:  # a fork copies one thread: refuse rather than fork a broken server
        print(f"dist_eval fork server: {threading.active_count()} threads after the imports; not forking",
              file=sys.stderr)
        return None
    _reply({"ready": True})
    wakeup = os.pipe()
    for fd in wakeup:
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wakeup[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
    pending = b""
    while True:
        try:
            ready, _, _ = select.select([0, wakeup[0]], [], [])
        except InterruptedError:
            continue
        if wakeup[0] in ready:
            try:
                os.read(wakeup[0], 4096)
            except BlockingIOError:
                pass
            _reap()
        if 0 in ready:
            data = os.read(0, 65536)
            if not data:
                _reap()  # the exits that came with the end
                return None
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    argv = _fork(json.loads(line), wakeup)
                except (OSError, ValueError, KeyError) as e:  # before the fork (a child never returns here)
                    _reply({"error": f"{type(e).__name__}: {e}"})
                    continue
                if argv is not None:
                    return argv


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
