"""dist_eval.backends.petals.helpers on real processes: a DHT-process stand-in with a child named
p2pd (the real client is killed mid-run in tests/test_swarm_failover.py)."""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from dist_eval.backends.petals.helpers import HelperDied, HelperWatch, client_helper_pids, is_running
from dist_eval.watchdog import Watchdog

# a process that starts a child named p2pd (a copy of sleep), as hivemind's DHT process does
_DHT_STAND_IN = """
import subprocess, sys, time
subprocess.Popen([sys.argv[1], "600"])
time.sleep(600)
"""


@pytest.fixture
def helpers(tmp_path):
    p2pd = str(tmp_path / "p2pd")
    shutil.copy(shutil.which("sleep"), p2pd)
    dht = subprocess.Popen([sys.executable, "-c", _DHT_STAND_IN, p2pd])
    try:
        deadline = time.monotonic() + 30
        while len(client_helper_pids(dht)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = client_helper_pids(dht)
        assert sorted(pids.values()) == ["DHT process", "p2pd daemon"], pids
        yield dht, {name: pid for pid, name in pids.items()}
    finally:
        for pid in client_helper_pids(dht):
            os.kill(pid, signal.SIGKILL)
        dht.kill()
        dht.wait()


def _manager(dht):
    return SimpleNamespace(dht=dht, ready=threading.Event(), state=SimpleNamespace(p2p=None))


def _wait_gone(pid, seconds=10.0):
    deadline = time.monotonic() + seconds
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not is_running(pid)


def test_is_running_tells_a_reused_pid_apart():
    from dist_eval.procs import start_time as _start_time

    assert is_running(os.getpid()) and is_running(os.getpid(), _start_time(os.getpid()))
    assert not is_running(os.getpid(), "0")
    child = subprocess.Popen(["true"])
    child.wait()
    assert not is_running(child.pid)


@pytest.mark.parametrize("victim", ["DHT process", "p2pd daemon"])
def test_a_dead_helper_is_named_and_the_survivor_killed(helpers, victim):
    dht, pids = helpers
    manager = _manager(dht)
    watch = HelperWatch(manager, poll_seconds=0.05).start()
    try:
        assert watch.check() is None
        os.kill(pids[victim], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while watch.died is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert isinstance(watch.died, HelperDied)
        assert f"the petals client's {victim} (pid {pids[victim]}) died" in str(watch.died)
        assert manager.dist_eval_helper_died is watch.died  # the failover patch raises it on the next failure
    finally:
        watch.close()
    survivor = pids["p2pd daemon" if victim == "DHT process" else "DHT process"]
    assert _wait_gone(survivor), "close() left the other helper running"


def test_the_watchdog_kills_the_helpers_when_their_owner_dies(helpers):
    _, pids = helpers
    from dist_eval.procs import start_time as _start_time

    watchdog = Watchdog()
    for pid in pids.values():
        watchdog.watch_pid(pid, _start_time(pid))
    watchdog._proc.stdin.close()  # the owner is gone: EOF without "done"
    assert all(_wait_gone(pid) for pid in pids.values())
    watchdog._proc.wait(timeout=10)


def test_a_watchdog_signalled_with_its_owner_still_stops_what_it_guards(helpers):
    """A sweep (pkill -f of the venv's python) sends SIGTERM to the owner and its watchdog at once: the watchdog
    ignored nothing and died first, leaving the servers it guarded running (seen: 18 orphaned swarm servers of a
    killed suite). It ignores SIGTERM, SIGINT and SIGHUP now, and stops them when its owner is gone."""
    _, pids = helpers
    from dist_eval.procs import start_time as _start_time

    watchdog = Watchdog()
    for pid in pids.values():
        watchdog.watch_pid(pid, _start_time(pid))
    def ignored() -> int:  # the signals its process ignores (/proc: SigIgn), set once its code runs
        with open(f"/proc/{watchdog._proc.pid}/status") as f:
            return int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)

    # all three: a process started under nohup has SIGHUP ignored before its code runs (the suite's run by nohup
    # sent SIGTERM before the watchdog's handler was set: it died of it)
    wanted = sum(1 << (sig - 1) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
    deadline = time.monotonic() + 30
    while ignored() & wanted != wanted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ignored() & wanted == wanted, "the watchdog did not ignore SIGTERM, SIGINT and SIGHUP within 30 s"
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        watchdog._proc.send_signal(sig)
    time.sleep(0.5)
    assert watchdog._proc.poll() is None and all(is_running(pid) for pid in pids.values())
    watchdog._proc.stdin.close()  # then the owner is gone
    assert all(_wait_gone(pid) for pid in pids.values())
    watchdog._proc.wait(timeout=10)


def test_a_released_watchdog_leaves_them_alone(helpers):
    _, pids = helpers
    from dist_eval.procs import start_time as _start_time

    watchdog = Watchdog()
    for pid in pids.values():
        watchdog.watch_pid(pid, _start_time(pid))
    watchdog.release()
    time.sleep(0.5)
    assert all(is_running(pid) for pid in pids.values())


def test_a_daemons_socket_left_after_it_exits_is_removed_once_it_has_exited():
    """As a p2pd that found no peer at the initial peers: a child of this process binds a hivemind
    socket and exits a moment later without removing it. Called while the child still holds it, the
    clean-up leaves the file with no wait (as before: one stale socket in 2 of 4 runs of
    test_unanswered_initial_peers_fail_fast on a loaded machine); it waits for the process under this
    one, then removes it."""
    import contextlib
    import uuid

    from dist_eval.procs import remove_dead_hivemind_sockets

    path = f"/tmp/hivemind-dist-eval-test-{uuid.uuid4().hex[:12]}.sock"
    code = ("import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); "
            "print('bound', flush=True); time.sleep(2.0)")
    since = time.time()
    child = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "bound"
        assert path not in remove_dead_hivemind_sockets(since, wait=0.0) and os.path.exists(path)  # still held
        removed = remove_dead_hivemind_sockets(since, wait=30.0)
        # returned once the holder let its socket go (removed: no process held it), not while it held it;
        # the holder closes its descriptors a moment before its exit completes, so it ends right after
        # (poll() at once failed now and then on a loaded machine: 3 of 14 runs)
        assert path in removed and not os.path.exists(path)
        assert child.wait(timeout=10) == 0
    finally:
        child.kill()
        child.wait()
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


# a rank's resource sharer hands a pipe end to a receiver that dies before answering the sharer's
# challenge, as a scheduler's cancel kills the DHT process mid-handoff; then an unrelated error
_LOST_HANDOFF = """
import os, select, socket, sys
from multiprocessing import reduction, resource_sharer
if sys.argv[1] == "patched":
    from dist_eval.backends.petals import helpers, shims
    shims.apply("quiet_lost_handoffs", "client", helpers.quiet_lost_handoffs)
read_end, _ = os.pipe()
address, _key = reduction.DupFd(read_end)._id  # served by this process's resource-sharer thread
child = os.fork()
if child == 0:
    receiver = socket.socket(socket.AF_UNIX)
    receiver.connect(address)
    select.select([receiver], [], [], 30)  # the challenge arrived, unread: the kernel resets the connection
    os._exit(0)
os.waitpid(child, 0)
resource_sharer.stop(timeout=30)  # the sharer takes connections in order: the reset one is handled once it stops
try:
    raise ValueError("an error of this process's own")
except ValueError:
    sys.excepthook(*sys.exc_info())
"""


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "stock"])
def test_a_handoff_cut_by_its_receivers_death_prints_no_traceback(patched):
    """helpers.quiet_lost_handoffs: a reset handoff prints nothing (stock Python prints a traceback: the
    test can fail); any other error reaching sys.excepthook is printed as before."""
    done = subprocess.run([sys.executable, "-c", _LOST_HANDOFF, "patched" if patched else "stock"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ValueError: an error of this process's own" in done.stderr
    handoff_error = "ConnectionResetError" in done.stderr or "EOFError" in done.stderr
    assert handoff_error != patched, done.stderr
    assert done.stderr.count("Traceback") == (1 if patched else 2), done.stderr


@pytest.mark.parametrize("then", ["nothing", "p2pd daemon", "DHT process", "stop", "close", "stop, then close"])
def test_an_own_daemon_error_is_a_servers_only_while_the_rank_and_its_helpers_run(helpers, then, monkeypatch,
                                                                                  capsys):
    """failover: a P2PDaemonError (raised by the rank's own p2pd: a server that died mid-request, or the daemon
    stopping) is warned about as the server's failure after the grace, or at once when the client closes, unless the
    client's HelperWatch finds a helper dead or the rank is told to stop first (a cancel signals them all): decided
    on those conditions, not on the time the rank takes to hear its own signal (60 s of grace, answered at once)."""
    from dist_eval.backends.petals import failover
    from dist_eval.errors import stopping

    dht, pids = helpers
    manager = _manager(dht)
    watch = HelperWatch(manager, poll_seconds=0.05, watchdog=False).start()
    monkeypatch.setattr(failover, "OWN_DAEMON_GRACE_S", 1.0 if then == "nothing" else 60.0)
    failover._warn_server_failed(manager, "12D3KooWserver", type("P2PDaemonError", (Exception,), {})())
    waiting = failover._pending[-1]
    try:
        if then.startswith("stop"):
            stopping.set()
        elif then in pids:
            os.kill(pids[then], signal.SIGKILL)
        if then.endswith("close"):
            failover.flush_daemon_error_warnings()
        waiting.join(timeout=30)
    finally:
        stopping.clear()
        failover._pending.clear()
        watch.stop()
        for pid in pids.values():  # a p2pd whose DHT process was killed is nobody's child to reap
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert not waiting.is_alive()
    assert ("...oWserver failed a request" in capsys.readouterr().err) == (then in ("nothing", "close"))


def test_a_close_while_a_daemon_errors_warning_starts_joins_only_started_threads(monkeypatch, capsys):
    """failover: the client's close (flush_daemon_error_warnings, the main thread) may run while petals' routing
    thread is starting a daemon error's waiting thread; a thread listed before it started made the close's join
    raise "cannot join thread before it is started" (a rank's traceback on a SIGTERM, under two busy loops as an
    ordinary user). The close runs here at that very moment, inside start(): the warning is said once, no error."""
    import threading

    from dist_eval.backends.petals import failover

    class CloseDuringStart(threading.Thread):
        def start(self):
            failover.flush_daemon_error_warnings(timeout=5.0)  # the main thread's close, now
            super().start()

    monkeypatch.setattr(failover.threading, "Thread", CloseDuringStart)
    monkeypatch.setattr(failover, "OWN_DAEMON_GRACE_S", 0.2)
    manager = type("Manager", (), {})()
    try:
        failover._warn_server_failed(manager, "12D3KooWserver", type("P2PDaemonError", (Exception,), {})())
        failover.flush_daemon_error_warnings(timeout=5.0)
    finally:
        failover._pending.clear()
    assert capsys.readouterr().err.count("...oWserver failed a request") == 1


@pytest.mark.parametrize("thread_names", [True, False], ids=["logThreads", "no logThreads"])
def test_a_stopped_clients_routing_refresh_still_running_says_nothing_of_the_stop(thread_names, monkeypatch):
    """A fresh clone's suite under load (root's, beside another suite): SIGTERM to a rank printed petals' routing
    thread's traceback ("OSError: handle is closed"): its refresh, still pinging when the client's shutdown gave up
    waiting for it, met the DHT the shutdown stopped next. petals' own thread, a refresh that outlasts the wait and
    then fails so: nothing said; another thread's error on that logger is said as ever; also where logging records
    no thread (logging.logThreads off)."""
    import logging
    from weakref import WeakMethod

    from dist_eval.backends.petals import helpers
    from dist_eval.backends.petals.shims import import_petals

    import_petals()
    from petals.client.routing.sequence_manager import _SequenceManagerUpdateThread

    class Refresh:
        def __init__(self):
            self.stopped = threading.Event()

        def update(self):
            self.stopped.wait(10)  # until the DHT below is stopped
            raise OSError("handle is closed")

    refresh, said = Refresh(), []
    monkeypatch.setattr(logging, "logThreads", thread_names)

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    routing = logging.getLogger(helpers.ROUTING_LOGGER)
    keep, filters = Keep(), list(routing.filters)
    routing.addHandler(keep)
    thread = _SequenceManagerUpdateThread(60, WeakMethod(refresh.update))
    thread.start()
    dht = SimpleNamespace(shutdown=refresh.stopped.set)
    try:
        helpers.shutdown_petals_client(SimpleNamespace(_thread=thread, state=None, dht=dht))
        thread.join(10)
        assert not thread.is_alive() and said == []
        routing.error("another client's routing failed")
        assert said == ["another client's routing failed"]
    finally:
        routing.removeHandler(keep)
        routing.filters[:] = filters
