"""The swarm's pieces talk through public methods (issue 47): one server process
(:class:`~dist_eval.swarm.process.ServerProcess`: start, state, stop, kill, restart) on a real
process group (a stand-in that reports its state as a server does, through
:mod:`dist_eval.swarm.state_file`, and keeps a child), a drained stop that waits for the drain the
server reports, and no module of the swarm reads another object's private members (an ``ast`` check)."""
from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import _pgid, _state, all_pids, stop_group

from dist_eval import procs
from dist_eval.swarm.process import ServerProcess

SWARM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dist_eval", "swarm")

# a server's reports, as dist_eval's server entry point makes them: its address, then "up" once a file
# "go" is beside it (its peer flags echoed, and petals' 'Started' line printed first: the swarm does not
# read it); a child in its group (as p2pd is) that only a signal to the whole group stops. Its SIGINT is
# handled (Python's KeyboardInterrupt) or ignored, as its argument says, set before anything else and
# inherited by its child: not whatever the shell that started pytest left (a background job of a
# non-interactive shell ignores SIGINT, and so does everything it starts). With "drains": SIGINT to it
# reports a drain and the stand-in lives on (a server finishing its shutdown).
STAND_IN = """import os, signal, subprocess, sys, time
signal.signal(signal.SIGINT, {"handled": signal.default_int_handler, "ignored": signal.SIG_IGN}[sys.argv[2]])
sys.path.insert(0, sys.argv[1])
from dist_eval.swarm import state_file
from dist_eval.swarm.server import take_state_file
port, *flags = take_state_file(sys.argv[3:])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print("peer flags:", " ".join(flags), flush=True)
if "drains" in flags:
    signal.signal(signal.SIGINT, lambda *_: [state_file.report(s) for s in (state_file.DRAINING, state_file.DRAINED)])
print("Nov 22 09:06:40.100 [INFO] Started", flush=True)
state_file.report(state_file.JOINING, addresses=["/ip4/127.0.0.1/tcp/%s/p2p/QmStandbyPeer" % port])
while not os.path.exists("go"):
    time.sleep(0.02)
state_file.report(state_file.UP)
while True:
    time.sleep(120)
"""
REPO = os.path.dirname(os.path.dirname(SWARM))


def _private_reads(path: str) -> list:
    """``obj._name`` read off anything but ``self``, and ``_name`` imported from another module of dist_eval,
    in the module at ``path``: (line, code)."""
    return _private_reads_of(ast.parse(open(path).read()))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_reads_of(tree: ast.AST) -> list:
    reads = [(node.lineno, ast.unparse(node)) for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and _private(node.attr)
             and not (isinstance(node.value, ast.Name) and node.value.id == "self")]
    imports = [(node.lineno, f"{node.module}.{alias.name}") for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dist_eval")
               for alias in node.names if _private(alias.name)]
    return sorted(reads + imports)


# every module of the swarm but those that reach into torch's, hivemind's and petals' own (a server's patches: its
# entry point, the wire's server half, its blocks' build and read; status' dials)
OWN_MODULES = sorted({name for name in os.listdir(SWARM) if name.endswith(".py")}
                     - {"server.py", "wire.py", "blocks.py", "status.py"})


@pytest.mark.parametrize("module", OWN_MODULES)
def test_the_swarms_modules_use_each_others_public_members_only(module):
    seen = _private_reads_of(ast.parse("self.swarm._lock\nswarm._servers[0]\ns._seen_gone\nself._rng\n"
                                       "from dist_eval.procs import _live_groups, reserve_ports\nfrom os import _exit"))
    assert seen == [(1, "self.swarm._lock"), (2, "swarm._servers"), (3, "s._seen_gone"),
                    (5, "dist_eval.procs._live_groups")]  # the check sees what it must
    assert _private_reads(os.path.join(SWARM, module)) == []


def _wait_for(server: ServerProcess, state: str, seconds: float = 30.0) -> None:
    end = time.monotonic() + seconds
    while server.state != state:
        assert time.monotonic() < end, f"{server.label} not {state} within {seconds} s: {server.tail()}"
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    """A process of group ``pgid`` that is not a zombie (an orphaned child may wait to be reaped)."""
    return any(_pgid(p) == pgid and _state(p) != "Z" for p in all_pids())


# how a stop ends a server, by what its SIGINT does: petals' graceful shutdown (KeyboardInterrupt) where it is
# handled; SIGTERM, which dist_eval's server drains as SIGINT (server.drain_on_sigterm), where it inherited
# an ignored SIGINT (a swarm started from a background job of a non-interactive shell)
ENDED_BY = {"handled": signal.SIGINT, "ignored": signal.SIGTERM}


@pytest.mark.parametrize("sigint", sorted(ENDED_BY))
def test_a_server_process_starts_serves_stops_and_restarts_on_its_port(tmp_path, sigint):
    """Which signal a stop sends depends on the server's SIGINT alone, which the stand-in sets itself:
    the test process's own may be ignored (a fresh-clone suite run as a background job got -SIGTERM
    where -SIGINT was asserted), and the verdict does not depend on how pytest was started."""
    kills, stand_in = [], tmp_path / "stand_in.py"
    stand_in.write_text(STAND_IN)  # a file: its lines in the command (the log's first line) would match
    server = ServerProcess(
        1, 40123, (0, 2), str(tmp_path / "server-1.log"), host="127.0.0.1", identity_path=str(tmp_path / "id.key"),
        command=lambda s, peer_args: [sys.executable, str(stand_in), REPO, sigint, str(s.port), *peer_args],
        env=dict(os.environ), cwd=str(tmp_path), before_kill=lambda: kills.append(1),
    )  # fmt: skip
    assert (server.state, server.pgid, server.returncode) == ("new", None, None)
    assert server.label == "server 1 (blocks 0:2, port 40123)"
    groups = []
    try:
        server.start(["--new_swarm"])
        groups.append(server.pgid)
        end = time.monotonic() + 60.0
        while server.address is None:  # it reported its address: the others may join it
            assert server.state == "starting", server.tail()
            assert time.monotonic() < end, f"no address reported within 60 s: {server.tail()}"
            time.sleep(0.02)
        assert server.address == "/ip4/127.0.0.1/tcp/40123/p2p/QmStandbyPeer"
        assert "[INFO] Started" in server.read_log() and server.state == "starting"  # its report, not its log
        (tmp_path / "go").touch()
        _wait_for(server, "up")
        assert server.read_log().startswith("$ ") and "peer flags: --new_swarm" in server.read_log()
        assert server.state_path == str(tmp_path / "state-1.json") and os.path.exists(server.state_path)
        assert server.returncode is None and _group_alive(server.pgid)

        assert procs.ignores_sigint(server.pgid) == (sigint == "ignored")
        assert server.stop(grace=10.0) == -ENDED_BY[sigint]  # its group got that signal: the child went with it
        assert server.state == "exited" and server.seen_gone and not _group_alive(groups[0])

        server.restart(["/ip4/127.0.0.1/tcp/40124/p2p/QmOther"])  # the same port and identity, its log appended
        groups.append(server.pgid)
        assert server.pgid != groups[0] and server.address is None  # the last start's report is not this one's
        _wait_for(server, "up")
        assert server.address == "/ip4/127.0.0.1/tcp/40123/p2p/QmStandbyPeer"
        assert server.read_log().count("$ ") == 1  # read from its restart on
        assert "peer flags: --initial_peers /ip4/127.0.0.1/tcp/40124/p2p/QmOther" in server.read_log()
        with open(server.log_path) as f:
            assert f.read().count("\n$ ") == 1  # the first start's lines kept above

        server.kill()
        assert kills == [1] and server.returncode == -signal.SIGKILL and server.gone()
        assert server.state == "exited" and not _group_alive(groups[1])
        server.kill()  # its group was seen gone: never signalled again
        assert kills == [1]
    finally:
        for pgid in groups:
            stop_group(pgid, grace=0.0)


def test_a_server_that_exits_says_so_with_its_code_and_log(tmp_path):
    server = ServerProcess(
        0, 40125, (0, 4), str(tmp_path / "server-0.log"), host="127.0.0.1", identity_path=str(tmp_path / "id.key"),
        command=lambda s, peer_args: [sys.executable, "-c", "import sys; print('no such flag'); sys.exit(3)"],
        env=dict(os.environ), cwd=str(tmp_path),
    )  # fmt: skip
    server.start(["--new_swarm"])
    _wait_for(server, "exited")
    assert server.returncode == 3 and server.address is None and server.tail(1) == "no such flag"
    assert server.stop() == 3 and server.seen_gone


def test_a_drained_stop_kills_the_server_once_it_reports_its_drain(tmp_path):
    """A drained stop (teardown.terminate with ``drain_s``) sends SIGINT to the main process alone and
    SIGKILL to the group ``grace`` after the server reports "drained" in its state file, not at the
    drain's bound (an hour here, past the stop's deadline of 60 s: a stop that did not read the report
    leaves the stand-in alive at the deadline, and fails, on any machine; no duration is asserted);
    the report is all it goes by (the stand-in's log says nothing)."""
    from dist_eval.swarm import teardown

    (tmp_path / "stand_in.py").write_text(STAND_IN)
    (tmp_path / "go").touch()
    server = ServerProcess(
        0, 40126, (0, 4), str(tmp_path / "server-0.log"), host="127.0.0.1", identity_path=str(tmp_path / "id.key"),
        command=lambda s, peer_args: [sys.executable, str(tmp_path / "stand_in.py"), REPO, "handled", str(s.port),
                                      *peer_args],
        env=dict(os.environ), cwd=str(tmp_path),
    )  # fmt: skip
    server.start(["drains"])
    try:
        _wait_for(server, "up")
        teardown.terminate([server], set(), time.monotonic() + 60.0, grace=0.2, drain_s=3600.0)
        assert server.drained and server.returncode == -signal.SIGKILL and server.gone()
    finally:
        stop_group(server.pgid, grace=0.0)


# a parent's shared tensor released in a forked child, as a server's connection handler does:
# the parent's file while it holds the tensor, then once it let it go, as torch does, then kept
_FORK_RELEASE = """import gc, glob, os
import torch, torch.multiprocessing
torch.multiprocessing.set_sharing_strategy("file_system")  # hivemind's

def files_while_held_and_after():
    mine = lambda: len(glob.glob(f"/dev/shm/torch_{os.getpid()}_*"))
    buffer = torch.zeros(16, dtype=torch.uint8).share_memory_()
    pid = os.fork()
    if pid == 0:
        buffer = None
        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
    held = mine()
    buffer = None
    gc.collect()
    return held, mine()

print(*files_while_held_and_after())
from dist_eval.backends.petals.shims import apply
from dist_eval.swarm.server import _inherited_shared_memory_kept
apply("inherited_shared_memory", "server", _inherited_shared_memory_kept)
print(*files_while_held_and_after())
"""


def test_a_fork_server_closed_before_its_start_starts_no_process(tmp_path):
    """A stop while a swarm starts may close its fork server before the start reaches it (Launch.stop): the start
    then starts nothing, and nothing is forked. Before, close() of a fork server not yet started did nothing, and
    the start that followed left it running past the swarm's stop."""
    from dist_eval.swarm.forks import SERVER_MODULE, ForkServer

    fork_server = ForkServer(dict(os.environ), str(tmp_path), str(tmp_path / "fork-server.log"))
    fork_server.close()
    try:
        fork_server.start(time.monotonic() + 60)
        assert fork_server._proc is None
        assert fork_server.spawn([sys.executable, "-m", SERVER_MODULE, "folder"], str(tmp_path / "server.log")) is None
    finally:
        fork_server.close()


@pytest.mark.swarm
def test_a_fork_server_closed_as_its_popen_returns_is_ended_by_its_start(tmp_path, monkeypatch):
    """A stop that closes the fork server the moment its Popen returns (close() then sees the process: it ends its
    stdin, then kills it, still importing): the start kills it too, closes its pipes and returns, raising nothing,
    and nothing is forked. A first form of this re-check (communicate() after the kill) raised ValueError there,
    flushing the stdin close() had closed."""
    import builtins

    from dist_eval.swarm import forks

    fork_server = forks.ForkServer(dict(os.environ), str(tmp_path), str(tmp_path / "fork-server.log"))

    class ClosedOnExit:  # the log file start() opens around its Popen: the stop comes as it is let go
        def __init__(self, *args):
            self.file = builtins.open(*args)

        def __enter__(self):
            return self.file.__enter__()

        def __exit__(self, *exc):
            self.file.__exit__(*exc)
            fork_server.close()

    monkeypatch.setattr(forks, "open", ClosedOnExit, raising=False)
    try:
        fork_server.start(time.monotonic() + 60)
        proc = fork_server._proc
        assert proc is not None and proc.returncode is not None and proc.stdin.closed and proc.stdout.closed
        assert fork_server.spawn([sys.executable, "-m", forks.SERVER_MODULE, "folder"], str(tmp_path / "s.log")) is None
    finally:
        fork_server.close()


def test_a_servers_forked_child_leaves_its_parents_shared_memory_alone():
    """torch counts a named shared storage's holders in the file, and a fork copies a holder
    uncounted: a child's release unlinked the parent's file while the parent used it, and a later
    release aborted its process ("could not unlink the shared memory file"; a server's connection
    handler died so at its start). A server's children keep what they inherit
    (swarm.server._inherited_shared_memory_kept): the file lives while the parent holds it."""
    done = subprocess.run([sys.executable, "-c", _FORK_RELEASE], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(SWARM)), timeout=120)
    as_torch_does, kept = done.stdout.splitlines()
    assert as_torch_does == "0 0", done  # the child's release unlinked the parent's file
    assert kept == "1 0", done  # there while the parent holds the tensor; gone once it let it go
    assert "Warning" not in done.stderr, done.stderr


# servers forked from one process, as the fork server forks them (swarm.forks._fork), and, for comparison, by a
# plain os.fork: a "holder" takes hivemind's SharedBytes._lock (what every MPFuture takes first) and is SIGKILLed
# holding it, as a server killed mid-task is; a "maker" forked after it then makes an MPFuture, as a sibling
# server's next request does. Prints {"plain": ..., "forks": ...}: "ok" or "hung" (no MPFuture within 5 s)
_SIBLING_KILLED = """import json, os, signal, sys, threading, time
import hivemind.utils.mpfuture as mpfuture
from dist_eval.swarm import forks

folder = sys.argv[1]
wakeup = os.pipe()
parent = os.getpid()

def child(mode, role):
    if mode == "forks":
        argv = forks._fork({"argv": [role], "log": os.path.join(folder, "children.log")}, wakeup)
    else:
        argv = None if os.fork() else [role]
    if argv is None:
        return  # the parent
    mark = os.path.join(folder, f"{mode}-{role}")
    if role == "holder":  # its pid once it holds the lock; "hung" where a killed holder's lock is this one's too
        held = mpfuture.SharedBytes._lock.acquire(timeout=5.0)
        open(mark + ".tmp", "w").write(str(os.getpid()) if held else "hung")
        os.rename(mark + ".tmp", mark)
        while held and os.getppid() == parent:  # until killed, or this script ended (no child outlives the test)
            time.sleep(0.1)
        os._exit(0)
    made = threading.Thread(target=mpfuture.MPFuture, daemon=True)
    made.start()
    made.join(5.0)
    open(mark + ".tmp", "w").write("hung" if made.is_alive() else "ok")
    os.rename(mark + ".tmp", mark)
    os._exit(0)

def wait_for(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        assert time.monotonic() < deadline, path
        time.sleep(0.05)
    return open(path).read()

said = {}
for mode in ("plain", "forks"):
    child(mode, "holder")
    holder = wait_for(os.path.join(folder, f"{mode}-holder"))
    if holder == "hung":
        said[mode] = holder
        continue
    os.kill(int(holder), signal.SIGKILL)
    child(mode, "maker")
    said[mode] = wait_for(os.path.join(folder, f"{mode}-maker"))
print(json.dumps(said))
"""


def test_a_server_killed_holding_a_hivemind_lock_hangs_no_other_server(tmp_path):
    """hivemind makes multiprocessing locks at its import, shared by every process forked from the importer: the
    servers of one fork server shared them, and one SIGKILLed while holding one (SharedBytes._lock, taken by every
    MPFuture a task makes) hung every other server at its next request (the failover test's healthy servers timed
    out, about one run in eight). A server forked by swarm.forks takes locks of its own
    (shims.own_hivemind_locks). The plain fork beside it shows the hazard the test guards against."""
    done = subprocess.run([sys.executable, "-c", _SIBLING_KILLED, str(tmp_path)], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(SWARM)), timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"plain": "hung", "forks": "ok"}, done


def test_a_servers_reserved_port_is_its_own():
    """A local swarm's ports are held from their choice to the swarm's stop (procs.reserve_ports, Launch): no
    plain bind takes one meanwhile, the server's p2pd binds it all the same, and every client sent to the server
    reaches it (the reservation does not listen: it takes no connection). Before, a port was let go once chosen;
    another p2pd of this user that got it from the OS meanwhile (a client's, on port 0) shared it with the server
    (p2pd binds with SO_REUSEPORT), and a client then reached the other daemon about one time in three: "failed to
    connect to bootstrap peers" in the suite under load (benchmarks/RESULTS.md, 2026-11-29 04:40)."""
    import asyncio
    import socket

    from dist_eval.backends.petals.shims import import_petals

    import_petals()  # hivemind as petals' processes have it
    from hivemind.p2p import P2P

    reserved = procs.reserve_ports("127.0.0.1", count=1)
    port = reserved[0].getsockname()[1]

    async def connect_clients() -> int:
        server = await P2P.create(host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"])
        reached = 0
        try:
            for _ in range(4):
                client = await P2P.create(initial_peers=[f"/ip4/127.0.0.1/tcp/{port}/p2p/{server.peer_id}"])
                reached += 1
                await client.shutdown()
        finally:
            await server.shutdown()
        return reached

    try:
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        assert asyncio.run(connect_clients()) == 4
    finally:
        procs.close_all(reserved)
    with socket.socket() as plain:  # let go at the end (the closed connections' TIME_WAIT no obstacle)
        plain.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        plain.bind(("127.0.0.1", port))
