"""The petals client's helper processes in a rank, and a watch over them.

A rank's petals client forks hivemind's DHT process, which starts a ``p2pd`` daemon;
every request and every routing refresh goes through them. When one of them dies (the
OOM killer, an operator), petals waits forever: a routing refresh waits on the dead DHT
process with no time limit, and so does the model's shutdown (a rank was seen to wait until
an outside timeout stopped it: benchmarks/RESULTS.md, "Figures the backends' comments quoted").

:class:`HelperWatch` polls both every ``poll_seconds``. Once one is gone it

- marks the client dead: the next attempt of a forward raises :class:`HelperDied`
  (one line naming the process) instead of retrying;
- releases what waits on the dead processes (see
  :func:`release_waits_on_dead_helpers`), at every poll, so that every
  thread of the rank returns within a poll (a request already sent through a dead p2pd
  fails at once, one sent just before fails within the client's request timeout);
- on :meth:`HelperWatch.close`, kills the helper that outlived the other (a p2pd whose
  DHT process died is left running by hivemind, holding its port), and removes the unix
  sockets in /tmp that the helpers and the client held (hivemind removes them only on a
  clean shutdown of both: a p2pd killed, or found dead, left its own behind);
- holds a watchdog process that stops both helpers if the rank itself is killed
  outright (SIGKILL), when no code of the rank runs to stop them, and removes those sockets.

So a rank whose helper dies ends its forwards within about a second (at most the
client's ``request_timeout``, 60 s, for a request in flight), saves its finished batches
and fails the run with one error line; the other ranks stop at their next batch.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from typing import Optional

from dist_eval.errors import UsageError
from dist_eval.procs import child_pids, hivemind_socket_paths, is_hivemind_socket, is_running, start_time
from dist_eval.watchdog import Watchdog

_EXIT_WAIT = 2.0  # seconds the helpers get to exit after a normal client shutdown


class HelperDied(UsageError):
    """A helper process of this rank's petals client died; the rank cannot reach the swarm."""


def client_helper_pids(dht) -> dict[int, str]:
    """{pid: what it is} of the helpers behind a petals client's ``dht`` (a hivemind DHT,
    which runs as a child process of this one): the DHT process and its p2pd daemon.
    """
    helpers = {}
    if getattr(dht, "pid", None) and is_running(dht.pid):
        helpers[dht.pid] = "DHT process"
        for child in child_pids(dht.pid):
            try:
                with open(f"/proc/{child}/comm") as f:
                    if f.read().strip() == "p2pd":
                        helpers[child] = "p2pd daemon"
            except OSError:
                continue
    return helpers


class HelperWatch:
    """Polls a petals client's helper processes; see the module docstring.

    ``manager`` is the client's ``RemoteSequenceManager``. ``died`` is None, or the
    :class:`HelperDied` that every later forward of this client raises.
    """

    def __init__(self, manager, poll_seconds: float = 0.5, watchdog: bool = True):
        self.manager = manager
        self.poll_seconds = poll_seconds
        self.helpers = client_helper_pids(getattr(manager, "dht", None))  # none: nothing to watch
        self._start_times = {pid: start_time(pid) for pid in self.helpers}
        # if this rank is killed outright (SIGKILL, or torchrun's SIGKILL after SIGTERM), no
        # code of it runs: a watchdog process then stops the helpers, which would be orphans.
        # ``watchdog=False``: a client the caller owns (a model object it passed), whose
        # helpers are its own to stop: only watched.
        self._watchdog = Watchdog() if self.helpers and watchdog else None
        for pid, started in self._start_times.items() if self._watchdog else ():
            self._watchdog.watch_pid(pid, started)
        # the client's own (None: a caller's client, whose sockets are its own to remove)
        self.sockets = client_sockets(manager, self.helpers) if self._watchdog else set()
        for path in sorted(self.sockets):
            self._watchdog.watch_path(path)
        self.died: HelperDied | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dist_eval-helper-watch", daemon=True)

    def start(self) -> HelperWatch:
        self._thread.start()
        return self

    def check(self) -> HelperDied | None:
        """Look once; returns (and records) the failure when a helper is gone."""
        if self.died is None:
            gone = [(pid, name) for pid, name in self.helpers.items() if not is_running(pid, self._start_times[pid])]
            if gone:
                pid, name = gone[0]
                self.died = HelperDied(
                    f"the petals client's {name} (pid {pid}) died, so this rank cannot reach the swarm any more "
                    "(killed by the OOM killer or an operator?). Its finished batches are saved: run the same "
                    "command again to resume from them."
                )
                self.manager.dist_eval_helper_died = self.died
        return self.died

    def _run(self) -> None:
        while not self._stopping.wait(self.poll_seconds):
            if self.check() is not None:
                release_waits_on_dead_helpers(self.manager, self.died)

    def stop(self) -> None:
        """Stop watching (before a normal shutdown stops the helpers)."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def close(self) -> None:
        """After the client's shutdown: make sure no helper is left (SIGKILL the ones still
        running a moment later: a p2pd whose DHT process died, or a frozen one, is never
        stopped by hivemind), then end the watchdog process.
        """
        self.stop()
        self._wait_gone(0.0 if self.died is not None else _EXIT_WAIT)
        for pid in self._running():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self._wait_gone(_EXIT_WAIT)  # SIGKILL is not instant
        for path in self.sockets:  # their holders are gone (the client's replica was shut down before)
            with contextlib.suppress(OSError):
                os.unlink(path)
        if self._watchdog is not None:
            self._watchdog.release()

    def _running(self) -> list:
        return [pid for pid in self.helpers if is_running(pid, self._start_times[pid])]

    def _wait_gone(self, seconds: float) -> None:
        """Wait up to ``seconds`` for every helper to be gone."""
        deadline = time.monotonic() + seconds
        while self._running() and time.monotonic() < deadline:
            time.sleep(0.02)


def quiet_lost_handoffs() -> list:
    """A patch (applied by :func:`dist_eval.backends.petals.shims.apply_client_patches`): no traceback from
    multiprocessing's resource sharer when the process it hands a file descriptor to dies mid-handoff.

    Every request a rank sends its DHT process carries a pipe end (hivemind's ``MPFuture``), handed over by
    the rank's resource-sharer thread, which prints any error of a handoff with ``sys.excepthook``. A job
    scheduler's cancel signals the DHT process with the rank, so the handoff it was taking is reset and the
    rank printed a 16-line ``ConnectionResetError`` before its own one-line stop (tests/test_slurm.py::
    test_scancel_mid_run_on_a_swarm). A helper that died is the run's to report (:class:`HelperWatch`,
    one line); a reset handoff adds nothing. Any other error, or one raised elsewhere, is printed as before.
    """
    import sys

    previous = sys.excepthook

    def excepthook(kind, error, trace):
        if issubclass(kind, (ConnectionError, EOFError)) and _raised_in_resource_sharer(trace):
            return
        previous(kind, error, trace)

    return [(sys, "excepthook", excepthook)]


def _raised_in_resource_sharer(trace) -> bool:
    """True if the traceback's outermost frame is multiprocessing's resource-sharer loop."""
    code = trace.tb_frame.f_code if trace is not None else None
    return code is not None and code.co_name == "_serve" and code.co_filename.endswith(
        os.path.join("multiprocessing", "resource_sharer.py"))


def client_sockets(manager, helpers) -> set:
    """The /tmp/hivemind-* unix sockets of a petals client: those its helper processes
    ``helpers`` hold (the p2pd's and the DHT process's), and its P2P replica's in this process.
    """
    held = hivemind_socket_paths(list(helpers))
    p2p = getattr(getattr(manager, "state", None), "p2p", None)
    with contextlib.suppress(Exception):  # hivemind's P2P: the socket its replica listens on
        path = p2p._client_listen_maddr["unix"]
        if is_hivemind_socket(path):
            held.add(path)
    return held


def release_waits_on_dead_helpers(manager, error: BaseException) -> None:
    """Make every wait of this process on a dead DHT process or p2pd daemon end with ``error``.

    - calls into the DHT process (``MPFuture``): a routing refresh waits on one with no
      time limit, and would wait forever on a dead process;
    - the routing ``ready`` event that forwards wait for after a failure: set, so they go
      on to their next attempt, which raises ``error`` (see the failover patch);
    - requests waiting for an answer from a dead p2pd (its connection is gone, the
      answer never comes): failed on hivemind's event loop.

    Safe to call repeatedly (a refresh may start a new wait after the last release).
    """
    from hivemind.utils.mpfuture import MPFuture

    if MPFuture._active_pid == os.getpid():
        for ref in list((MPFuture._active_futures or {}).values()):
            future = ref()
            if future is not None and not future.done():
                with contextlib.suppress(Exception):
                    future.set_exception(error)
    manager.ready.set()
    control = getattr(getattr(getattr(manager.state, "p2p", None), "_client", None), "control", None)
    if control is None:
        return
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

    def fail_pending_calls() -> None:
        for future in list(control._pending_calls.values()):
            if not future.done():
                future.set_exception(error)

    with contextlib.suppress(Exception):
        RemoteExpertWorker._event_loop_fut.result(timeout=0).call_soon_threadsafe(fail_pending_calls)


def quiet_hivemind_logs(level: int = logging.WARNING) -> None:
    """Keep hivemind/petals INFO chatter (routes, DHT) out of the evaluator's output."""
    for name in ("hivemind", "petals"):
        logging.getLogger(name).setLevel(level)


def ensure_main_thread_event_loop() -> None:
    """Leave a current event loop set in the main thread.

    The petals client keeps a replica of its P2P handle in this process; at interpreter
    exit its ``__del__`` calls ``asyncio.get_event_loop()``, which under hivemind's
    uvloop policy raises when no loop is set, printing three tracebacks per process.
    """
    try:
        asyncio.get_event_loop()
    except RuntimeError:
        asyncio.set_event_loop(asyncio.new_event_loop())


_SHUTDOWN_WAIT = 2.0  # seconds each step of a client's shutdown may take (~0.1 s when healthy)
ROUTING_LOGGER = "petals.client.routing.sequence_manager"  # petals' routing thread logs its failures there


class _FromThread(logging.Filter):
    """Drops the records of one thread (``ident``): a stopped client's routing thread, still finishing its refresh."""

    def __init__(self, ident: Optional[int]):
        super().__init__()
        self.ident = ident

    def filter(self, record: logging.LogRecord) -> bool:
        # a logger's filters run in the thread that logs (record.thread is None where logging.logThreads is off)
        return threading.get_ident() != self.ident


def shutdown_petals_client(sequence_manager) -> None:
    """Stop a petals client's DHT and routing thread explicitly, given its sequence manager
    (``<the model's block stack>.sequence_manager``; None: nothing to stop).

    Without this, hivemind's ``__del__`` hooks run at interpreter exit after the event
    loop is gone and print "no current event loop" errors (the exit code stays 0).
    """
    ensure_main_thread_event_loop()
    if sequence_manager is None:
        return
    thread = getattr(sequence_manager, "_thread", None)
    try:  # bounded: a routing refresh stuck on a dead DHT process never ends
        thread.shutdown(timeout=_SHUTDOWN_WAIT)
    except Exception:  # best effort: shutting down must never mask a real error
        pass
    if thread is not None and thread.is_alive():
        # a refresh still running (a ping on a loaded machine): what it meets once the DHT below is stopped ("handle is
        # closed", logged with its traceback by petals' thread) is this stop's doing, not an error to show
        logging.getLogger(ROUTING_LOGGER).addFilter(_FromThread(thread.ident))
    # The P2P replica's tasks live on hivemind's worker event loop; close them there now.
    # Left to ``__del__`` at interpreter exit, asyncio is already torn down and each
    # process prints "Exception ignored in: P2P.__del__" tracebacks.
    p2p = getattr(getattr(sequence_manager, "state", None), "p2p", None)
    if p2p is not None:
        try:
            from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

            RemoteExpertWorker.run_coroutine(p2p.shutdown(), return_future=True).result(timeout=_SHUTDOWN_WAIT)
        except Exception:
            pass
    dht = getattr(sequence_manager, "dht", None)
    if dht is not None:
        try:
            dht.shutdown()
        except Exception:
            pass
