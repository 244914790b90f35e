"""A pytest plugin (loaded by conftest.py): no test leaves a process behind.

- Every process that a test's body started (a torchrun job, a rank, a server, a DHT
  helper, a p2pd daemon, ...) must be gone once the test's teardown has run; a
  module's processes (those of its module-scoped fixtures) once the module's last test
  has been torn down; a session-scoped fixture's (a swarm shared by several modules)
  once the last test of the run has been torn down: they are noted when the fixture is
  set up, so they are not charged to the module that happened to set it up first.
- A test's processes are its descendants when its body ends, and every process that
  shares a process group or a session with one of them: an orphan (its parent killed
  by the test) keeps its group and session when init adopts it, so it is still found.
- A process still alive ``GRACE_SECONDS`` after its test (or module) ended fails that
  test's teardown, naming the processes, and is killed so that it cannot disturb the
  tests after it.

Processes that belong to the test interpreter itself, whoever started them, are not
counted: torch's shared-memory manager and multiprocessing's resource tracker live as
long as the interpreter does.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from typing import Dict, NamedTuple, Set

import pytest

GRACE_SECONDS = 10.0
_INTERPRETER_DAEMONS = ("torch_shm_manager", "multiprocessing.resource_tracker")


class Proc(NamedTuple):
    ppid: int
    state: str
    pgid: int
    sid: int
    started: int  # clock ticks after boot: with the pid, names one process (pids are reused)


_module_before: Dict[str, Set[tuple]] = {}  # test module -> (pid, started) of descendants before its first test
_session_owned: Dict[tuple, str] = {}  # processes started by session-scoped fixtures: checked at the end
_session_groups: Set[int] = set()  # their process groups and sessions (a server's later children are in them)
_STARTED = pytest.StashKey[Dict[tuple, str]]()  # a test's processes: (pid, started) -> command line


# in the environment of the processes a pytest run starts (xdist's workers are exec'd with it, and what they start
# inherits it; not a process given an environment of its own, nor one forked from a run's one process, -n 0, whose
# /proc/PID/environ is the environment it was exec'd with): one value a run
RUN_MARK = "DIST_EVAL_TEST_RUN"
_sigterm_came = False


def stop_on_sigterm(config) -> None:
    """SIGTERM to this pytest process (a scheduler's cancel, ``timeout``, ``kill``) stops it as Ctrl-C does:
    every fixture torn down, so that what the tests started is stopped (pytest's default, dying at once, left a
    swarm a test had started as a user does, in a session of its own, serving on). A later SIGTERM is ignored:
    it does not cut the teardown short (SIGKILL still ends the process). xdist's controller passes the signal
    on to its workers (a worker started with SIGINT ignored, as by a shell's ``&``, cannot be interrupted
    otherwise, and went on with its test); since it ends them within 10 s, torn down or not, the run's last step
    (:func:`pytest_unconfigure`, in the controller or the one process) stops every process still marked as the
    run's (:data:`RUN_MARK`, set here). A process forked from a pytest process gets SIGTERM's default back.
    """
    if not hasattr(config, "workerinput"):  # a worker keeps its controller's mark; a run started by a test, its own
        os.environ[RUN_MARK] = uuid.uuid4().hex
    controller = not hasattr(config, "workerinput") and bool(config.getoption("numprocesses", None))

    def interrupt(signum, frame):
        global _sigterm_came
        _sigterm_came = True
        signal.signal(signal.SIGTERM, lambda *_: None)  # one interruption: the teardown runs to its end
        if controller:  # its children are its workers
            for pid, proc in _processes().items():
                if proc.ppid == os.getpid():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, interrupt)
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))


def pytest_unconfigure(config):
    """After a SIGTERM, in the controller (or the one process): every process still marked as this run's is
    stopped (SIGTERM, then SIGKILL after 10 s), whatever its group or session."""
    if not _sigterm_came or hasattr(config, "workerinput"):
        return
    mark = f"{RUN_MARK}={os.environ.get(RUN_MARK)}".encode()
    for _ in range(3):  # again for what a stopping process started meanwhile
        left = [pid for pid in _processes() if pid != os.getpid() and mark in _environ(pid)]
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(pid) for pid in left):
            time.sleep(0.1)
        for pid in left:
            if mark in _environ(pid):  # still the run's (not a pid reused meanwhile)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _environ(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:  # gone, or another user's
        return []


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _processes() -> Dict[int, Proc]:
    """Every process, from /proc.

    Read with os.open/os.read, not open(): this runs twice around every test's body, over every
    process of the machine, and a buffered file object per process was half of its time."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{entry}/stat", os.O_RDONLY)
            try:
                stat = os.read(fd, 4096)
            finally:
                os.close(fd)
            rest = stat.rpartition(b")")[2].split()
            found[int(entry)] = Proc(int(rest[1]), rest[0].decode(), int(rest[2]), int(rest[3]), int(rest[19]))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:200]
    except OSError:
        return "?"


def _ours(procs: Dict[int, Proc], pids) -> Dict[tuple, str]:
    """{(pid, started): command line} of the live ``pids``, interpreter daemons aside."""
    found = {}
    for pid in pids:
        if procs[pid].state != "Z":
            cmd = _cmdline(pid)
            if not any(d in cmd for d in _INTERPRETER_DAEMONS):
                found[(pid, procs[pid].started)] = cmd
    return found


def _descendants(procs: Dict[int, Proc]) -> Dict[tuple, str]:
    """This process's live descendants (children, theirs, ...)."""
    children: Dict[int, list] = {}
    for pid, p in procs.items():
        children.setdefault(p.ppid, []).append(pid)
    found, todo = [], list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        found.append(pid)
    return _ours(procs, found)


def _with_their_groups(procs: Dict[int, Proc], started: Dict[tuple, str], since: int) -> Dict[tuple, str]:
    """``started``, and every live process started at ``since`` or later that shares a
    process group or a session with one of them (not this process's own).
    """
    mine = {os.getpgid(0), os.getsid(0)}
    groups = {x for (pid, _) in started if pid in procs for x in (procs[pid].pgid, procs[pid].sid)} - mine
    kin = [pid for pid, p in procs.items() if (p.pgid in groups or p.sid in groups) and p.started >= since]
    return {**started, **_ours(procs, kin)}


def _left_after_grace(started: Dict[tuple, str]) -> Dict[tuple, str]:
    """Those of ``started`` still alive (zombies aside) after up to GRACE_SECONDS."""
    if not started:
        return {}
    deadline = time.monotonic() + GRACE_SECONDS
    while True:
        procs = _processes()
        left = {key: cmd for key, cmd in started.items()
                if key[0] in procs and procs[key[0]].started == key[1] and procs[key[0]].state != "Z"}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def _kill(keys) -> None:
    for pid, _ in keys:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _now_in_ticks() -> int:
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """A session-scoped fixture's processes (and their groups) are the session's, not the module's."""
    if fixturedef.scope != "session":
        return (yield)
    owned: Dict[tuple, str] = {}
    try:
        with _noting_started(owned):
            return (yield)
    finally:
        _session_owned.update(owned)
        procs, mine = _processes(), {os.getpgid(0), os.getsid(0)}
        _session_groups.update({x for (pid, _) in owned if pid in procs for x in (procs[pid].pgid, procs[pid].sid)}
                               - mine)


@contextlib.contextmanager
def _noting_started(into: Dict[tuple, str]):
    """Puts in ``into`` what the body started: new descendants, with their groups and sessions. A new
    process in the group or session of one that was there before the body (a module fixture's pipeline,
    still at work: its next step) is that one's, checked when its fixture ends."""
    since = _now_in_ticks() - 1
    procs = _processes()
    before = set(_descendants(procs))
    theirs = {x for (pid, _) in before if pid in procs for x in (procs[pid].pgid, procs[pid].sid)}
    theirs -= {os.getpgid(0), os.getsid(0)}
    try:
        yield
    finally:
        procs = _processes()
        started = {key: cmd for key, cmd in _descendants(procs).items() if key not in before
                   and not (key[0] in procs and (procs[key[0]].pgid in theirs or procs[key[0]].sid in theirs))}
        into.update(_with_their_groups(procs, started, since))


def _without_the_sessions(found: Dict[tuple, str]) -> Dict[tuple, str]:
    """``found`` less the processes in a session-scoped fixture's groups (checked at the end)."""
    if not found:
        return found
    procs = _processes()
    return {key: cmd for key, cmd in found.items() if key not in _session_owned and not (
        key[0] in procs and (procs[key[0]].pgid in _session_groups or procs[key[0]].sid in _session_groups))}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    module = item.nodeid.split("::")[0]
    if module not in _module_before:  # before its first test (not once per test: a scan of /proc each)
        _module_before[module] = set(_descendants(_processes()))
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    started: Dict[tuple, str] = {}
    try:
        with _noting_started(started):
            return (yield)
    finally:
        item.stash[_STARTED] = _without_the_sessions(started)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    leaks = _left_after_grace(item.stash.get(_STARTED, {}))
    module = item.nodeid.split("::")[0]
    if nextitem is None or nextitem.nodeid.split("::")[0] != module:  # the module's fixtures are gone too
        before = _module_before.pop(module, set())
        new = {k: c for k, c in _descendants(_processes()).items() if k not in before}
        leaks.update(_left_after_grace(_without_the_sessions(new)))
    if nextitem is None:  # the end of the run: the session's fixtures are gone too, with their groups
        procs = _processes()
        in_groups = [pid for pid, p in procs.items() if p.pgid in _session_groups or p.sid in _session_groups]
        leaks.update(_left_after_grace({**_session_owned, **_ours(procs, in_groups)}))
    if leaks:
        _kill(leaks)
        listed = "; ".join(f"pid {pid}: {cmd}" for (pid, _), cmd in sorted(leaks.items()))
        pytest.fail(f"{len(leaks)} process(es) started by this test (or its module) outlived it by "
                    f"{GRACE_SECONDS:.0f} s (now killed): {listed}", pytrace=False)
    return result
