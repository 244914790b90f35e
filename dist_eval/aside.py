"""Work done beside this process, in a forked child (issue 74): rank 0's report of a big set, while the other ranks
leave their cores idle, draws its figures and writes part of predictions.jsonl in children as it writes the rest.

A child is a fork: it has the parent's data as they were (nothing is sent to it), runs one function and sends
back its result (picklable) or the error it raised, named, through a pipe. It never returns into the parent's
code (it ends with ``os._exit``: no atexit handler, no buffered output of the parent's written twice), takes the
default signal handlers and no wakeup fd of the parent's, and dies with its parent (``PR_SET_PDEATHSIG``, Linux).
:meth:`Aside.close` kills and reaps it where its result is not wanted any more (an error, an interrupt).
Whatever goes wrong in it, the parent is told (:class:`AsideFailed`) and does the work itself: an aside changes
when the work is done, never what it gives.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import time
from typing import Any, Callable, Optional

# the signals whose handlers the parent may have set (dist_eval's interrupt handling): the default in a child
_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1


class AsideFailed(Exception):
    """The child gave no result: the error it raised (named), its death, or no result within the time."""


class Aside:
    """``work()`` run in a forked child from now on; :meth:`result` waits for what it returned."""

    def __init__(self, work: Callable[[], Any]):
        """:class:`AsideFailed` where no child can be started (no pipe, no fork: out of memory or processes)."""
        parent = os.getpid()
        try:
            read, write = os.pipe()
        except OSError as e:
            raise AsideFailed(f"no pipe for a child: {e}") from None
        # the handled signals held until the child has the default handlers: one that came between the fork and
        # their reset would run the parent's handler in the child (an interrupt unwinding the parent's stack there)
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
        try:
            pid = os.fork()
        except OSError as e:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            os.close(read)
            os.close(write)
            raise AsideFailed(f"no child started: {e}") from None
        if pid == 0:
            _run_child(work, read, write, parent, held)  # never returns
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        os.close(write)
        self.pid: Optional[int] = pid
        self._read = read

    def result(self, timeout: float = 600.0) -> Any:
        """What ``work()`` returned in the child; :class:`AsideFailed` if it raised (its type and message), died,
        or gave nothing within ``timeout`` seconds. The child is reaped either way.
        """
        try:
            data = self._read_all(time.monotonic() + timeout)
        finally:
            self.close()
        try:
            status, value = pickle.loads(data)
        except Exception as e:  # a child killed mid-message, or dead before it wrote one
            raise AsideFailed(f"the child gave no result ({len(data)} bytes read: {type(e).__name__})") from None
        if status != "ok":
            raise AsideFailed(value)
        return value

    def close(self) -> None:
        """Kill the child if it still runs, and reap it. Idempotent (also after an interrupt inside it)."""
        if self.pid is None:
            return
        try:
            try:
                os.kill(self.pid, signal.SIGKILL)  # a child that ended is a zombie until reaped: the pid is its
            except ProcessLookupError:
                pass
            os.waitpid(self.pid, 0)
            self.pid = None
        finally:
            if self._read is not None and self.pid is None:
                os.close(self._read)
                self._read = None

    def _read_all(self, deadline: float) -> bytes:
        chunks = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not _readable(self._read, left):
                raise AsideFailed("no result in time")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:  # the child's end closed: it exited
                return b"".join(chunks)
            chunks.append(chunk)

    def __enter__(self) -> Aside:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def started(work: Callable[[], Any]) -> Optional[Aside]:
    """An :class:`Aside` running ``work``; None where no child can be had (out of memory or processes): the caller
    does the work itself.
    """
    try:
        return Aside(work)
    except AsideFailed:
        return None


def _readable(fd: int, seconds: float) -> bool:
    poller = select.poll()  # not select(): a rank's descriptors may be numbered past 1024
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(seconds * 1000))


def _run_child(work: Callable[[], Any], read: int, write: int, parent: int, held) -> None:
    code = 1
    try:
        os.close(read)
        signal.set_wakeup_fd(-1)  # the parent's wakeup pipe would be told of the child's signals
        for sig in _HANDLED:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        _die_with(parent)
        try:
            message = ("ok", work())
        except BaseException as e:  # noqa: BLE001 - named to the parent, which does the work itself
            message = ("error", f"{type(e).__name__}: {e}")
        view = memoryview(pickle.dumps(message))
        while view:
            view = view[os.write(write, view):]
        code = 0
    finally:
        os._exit(code)


def _die_with(parent: int) -> None:
    """Be killed when the parent dies (Linux; elsewhere the parent's close, or the run's cleanup, ends it)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the prctl took
        os._exit(1)
