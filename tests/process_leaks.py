"""A pytest plugin (loaded by conftest.py): no test leaves a process behind.

- Every process that a test's body started (a torchrun job, a rank, a server, a DHT
  helper, a p2pd daemon, ...) must be gone once the test's teardown has run; a
  module's processes (those of its module-scoped fixtures, e.g. a shared swarm) once
  the module's last test has been torn down.
- The test process is made a child subreaper (PR_SET_CHILD_SUBREAPER): a process whose
  parent died is re-parented to it instead of to init, so an orphan is still seen as
  ours, and found. (Orphans that died are reaped at the end of each module.)
- A process still alive ``GRACE_SECONDS`` after its test (or module) ended fails that
  test's teardown, naming the processes, and is killed so that it cannot disturb the
  tests after it.

Processes that belong to the test interpreter itself, whoever started them, are not
counted: torch's shared-memory manager and multiprocessing's resource tracker live as
long as the interpreter does.
"""
from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import Dict

import pytest

_PR_SET_CHILD_SUBREAPER = 36
GRACE_SECONDS = 10.0
_INTERPRETER_DAEMONS = ("torch_shm_manager", "multiprocessing.resource_tracker")
_module_before: Dict[str, set] = {}  # test module -> its processes' pids before its first test
_STARTED = pytest.StashKey[Dict[int, str]]()  # a test's processes started by its body


def pytest_configure(config) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: orphans go to init and are not seen
        pass


def _processes() -> Dict[int, tuple]:
    """{pid: (ppid, state)} of every process, from /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                rest = f.read().decode("utf-8", "replace").rpartition(")")[2].split()
        except OSError:
            continue
        if len(rest) > 1:
            found[int(entry)] = (int(rest[1]), rest[0])
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:200]
    except OSError:
        return "?"


def _descendants(include_zombies: bool = False) -> Dict[int, str]:
    """{pid: command line} of this process's live descendants (children, theirs, ...)."""
    procs = _processes()
    children: Dict[int, list] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        if include_zombies or procs[pid][1] != "Z":
            found[pid] = _cmdline(pid)
    return {pid: cmd for pid, cmd in found.items() if not any(d in cmd for d in _INTERPRETER_DAEMONS)}


def _left_after_grace(started: Dict[int, str]) -> Dict[int, str]:
    """Those of ``started`` still alive (zombies aside) after up to GRACE_SECONDS."""
    deadline = time.monotonic() + GRACE_SECONDS
    while True:
        live = _descendants()
        left = {pid: cmd for pid, cmd in started.items() if pid in live and live[pid] == cmd}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _reap_orphaned_zombies(pids) -> None:
    """Orphans re-parented to this process (the subreaper) that died: reap them."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _module_before.setdefault(item.nodeid.split("::")[0], set(_descendants()))
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    before = set(_descendants())
    try:
        return (yield)
    finally:
        item.stash[_STARTED] = {pid: cmd for pid, cmd in _descendants().items() if pid not in before}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    leaks = _left_after_grace(item.stash.get(_STARTED, {}))
    module = item.nodeid.split("::")[0]
    if nextitem is None or nextitem.nodeid.split("::")[0] != module:  # the module's fixtures are gone too
        before = _module_before.pop(module, set())
        everything = _descendants(include_zombies=True)
        leaks.update(_left_after_grace({p: c for p, c in _descendants().items() if p not in before}))
        _reap_orphaned_zombies(p for p in everything if p not in before)
    if leaks:
        _kill(leaks)
        listed = "; ".join(f"pid {pid}: {cmd}" for pid, cmd in sorted(leaks.items()))
        pytest.fail(f"{len(leaks)} process(es) started by this test (or its module) outlived it by "
                    f"{GRACE_SECONDS:.0f} s (now killed): {listed}", pytrace=False)
    return result
