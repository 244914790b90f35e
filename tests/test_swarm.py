"""dist_eval.swarm: a real local Petals swarm (real processes, no mocks).

Tests that start servers are marked ``swarm``; they share one tiny Llama (4 blocks,
hidden 64). The swarm of 2 that test_started_in_the_background_and_stopped_while_starting
starts whole is the one whose addresses, processes and stop are checked; the client's forward
is sent to conftest's tiny_swarm (a swarm of this module's own started for them before).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import read_pipe_until, read_stdout_line, swarm_servers_of
from float_promises import assert_within_rounding

from dist_eval.swarm import LocalSwarm, SwarmError, plan_blocks

ROOT = Path(__file__).resolve().parents[1]
# a peer id: 12D3KooW... (Ed25519) or Qm... (RSA: the identity files dist_eval's servers keep over restarts)
MADDR = re.compile(r"^/ip4/127\.0\.0\.1/tcp/(\d+)/p2p/(?:12D3KooW|Qm)[1-9A-HJ-NP-Za-km-z]+$")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


# --------------------------------------------------------------------------- helpers


def _procs_in_groups(pgids) -> dict:
    """{pid: state} of every process (zombies included) whose process group is in pgids."""
    pgids, found = set(pgids), {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                rest = Path(f"/proc/{entry}/stat").read_bytes().decode("utf-8", "replace").rpartition(")")[2].split()
            except OSError:
                continue
            if int(rest[2]) in pgids:
                found[int(entry)] = rest[0]
    return found


def _children(pid: int) -> dict:
    """{child pid: cmdline} of the direct children of pid."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                rest = Path(f"/proc/{entry}/stat").read_bytes().decode("utf-8", "replace").rpartition(")")[2].split()
                if int(rest[1]) == pid:
                    out[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
    return out


def _assert_groups_gone(pgids, grace: float = 3.0) -> None:
    """No live process may be left at once; zombies get ``grace`` seconds to be reaped by init."""
    live = {p: st for p, st in _procs_in_groups(pgids).items() if st != "Z"}
    assert not live, f"processes of groups {sorted(pgids)} still alive: {live}"
    end = time.monotonic() + grace
    while _procs_in_groups(pgids) and time.monotonic() < end:
        time.sleep(0.1)
    assert not _procs_in_groups(pgids), f"unreaped processes of groups {sorted(pgids)}: {_procs_in_groups(pgids)}"


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
            return True
        except OSError:
            return False


def _ports_held_here() -> set:
    """The TCP ports this process's IPv4 sockets are bound to (a bound socket that neither listens nor connects,
    as a reservation, is in no table of /proc/net/tcp: asked of each socket itself)."""
    ports = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:["):
                continue
            with socket.socket(fileno=os.dup(int(fd))) as s:
                if s.family == socket.AF_INET and s.type == socket.SOCK_STREAM:
                    ports.add(s.getsockname()[1])
        except OSError:
            continue
    return ports - {0}


def _kill_groups(pgids) -> None:
    for g in pgids:
        try:
            os.killpg(g, signal.SIGKILL)
        except OSError:
            pass


def _make_model(path: Path) -> Path:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        pad_token_id=0,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return _make_model(tmp_path_factory.mktemp("models") / "tiny.llama")


# --------------------------------------------------------------------------- no servers


def test_plan_blocks_default_puts_every_block_on_two_servers():
    assert plan_blocks(4, 1) == [(0, 4)]
    assert plan_blocks(4, 2) == [(0, 4), (0, 4)]
    assert plan_blocks(4, 3) == [(0, 2), (2, 4), (0, 4)]
    assert plan_blocks(4, 4) == [(0, 2), (2, 4), (0, 2), (2, 4)]
    for blocks in (1, 2, 3, 5, 7, 32, 80):
        for servers in range(2, 10):
            plan = plan_blocks(blocks, servers)
            assert len(plan) == servers
            coverage = [sum(a <= b < e for a, e in plan) for b in range(blocks)]
            assert min(coverage) >= 2, (blocks, servers, plan)
            assert all(0 <= a < e <= blocks for a, e in plan)
            assert max(e - a for a, e in plan) <= -(-blocks // ((servers) // 2))  # about 2L/K


def test_plan_blocks_with_blocks_per_server():
    assert plan_blocks(4, 2, blocks_per_server=2) == [(0, 2), (2, 4)]
    assert plan_blocks(4, 2, blocks_per_server=3) == [(0, 3), (1, 4)]
    assert plan_blocks(4, 3, blocks_per_server=9) == [(0, 4)] * 3
    assert plan_blocks(10, 3, blocks_per_server=4) == [(0, 4), (3, 7), (6, 10)]
    with pytest.raises(SwarmError, match="cannot cover"):
        plan_blocks(10, 2, blocks_per_server=4)


def test_bad_library_arguments(tmp_path, llama_dir):
    with pytest.raises(SwarmError, match="no such folder"):
        LocalSwarm(str(tmp_path / "missing"))
    with pytest.raises(SwarmError, match="no config.json"):
        LocalSwarm(str(tmp_path))
    with pytest.raises(SwarmError, match="num_servers"):
        LocalSwarm(str(llama_dir), num_servers=0)
    with pytest.raises(SwarmError, match="dht_prefix"):
        LocalSwarm(str(llama_dir), dht_prefix="a.b")
    s = LocalSwarm(str(llama_dir), num_servers=3)
    assert s.dht_prefix == "dist_eval-tiny_llama"  # sanitised folder name
    assert s.num_blocks == 4 and s.initial_peers == []
    s.stop()  # never started: a no-op, and idempotent
    s.stop()


def test_port_in_use_is_a_clear_error_and_starts_nothing(llama_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        s = LocalSwarm(str(llama_dir), num_servers=1, port=port)
        with pytest.raises(SwarmError, match=f"port {port} .*in use"):
            s.start()
        assert s.pgids == [] and not os.path.exists(s.workdir)


@pytest.mark.parametrize(
    "args, message",
    [
        (["/no/such/model"], "no such folder"),
        (["{empty}"], "no config.json"),
        (["{model}", "--servers", "0"], "num_servers"),
        (["{model}", "--servers", "two"], "invalid int value"),
        ([], "required"),
    ],
)
def test_cli_bad_arguments_exit_2_with_one_line(tmp_path, args, message):
    empty = tmp_path / "empty"
    empty.mkdir()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    argv = [a.format(empty=empty, model=model) for a in args]
    r = subprocess.run(
        [sys.executable, "-m", "dist_eval.swarm", *argv], capture_output=True, text=True, timeout=60, env=ENV, cwd=ROOT
    )
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert message in lines[0] and "Traceback" not in r.stderr


# --------------------------------------------------------------------------- real servers


@pytest.mark.swarm
def test_petals_client_forward_matches_local_model(tiny_swarm):
    """petals' own client (not dist_eval's) on conftest's swarm of its tiny Llama: its logits are
    transformers' on the same weights, within rounding."""
    import torch
    from transformers import LlamaForSequenceClassification

    from dist_eval.backends.families import FAMILIES
    from dist_eval.backends.petals.helpers import shutdown_petals_client
    from dist_eval.backends.petals.shims import import_petals

    import_petals()
    from petals import DistributedLlamaForSequenceClassification

    swarm, model_dir = tiny_swarm, tiny_swarm.model_dir
    model = DistributedLlamaForSequenceClassification.from_pretrained(
        model_dir, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix, num_labels=3,
        request_timeout=30.0, max_retries=3, daemon_startup_timeout=30,
    )  # fmt: skip
    try:
        torch.manual_seed(0)
        input_ids = torch.randint(1, 62, (2, 8))  # the tiny Llama's vocabulary: 62 (conftest's WORDS)
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits
        assert logits.shape == (2, 3) and torch.isfinite(logits).all()
        local = LlamaForSequenceClassification.from_pretrained(model_dir, num_labels=3)
        local.score.weight.data.copy_(model.score.weight.data)
        with torch.no_grad():
            expected = local(input_ids=input_ids).logits
        assert_within_rounding(logits, expected, "petals' own client on the swarm, against transformers'",
                               why="another implementation: petals' own client and server path, in its own shapes")
    finally:
        llama = FAMILIES["llama"]
        shutdown_petals_client(llama.get(model, llama.blocks).sequence_manager)


def _check_started(swarm, measured_start_seconds: float):
    """A started swarm of 2 (every block on each): two well-formed addresses, each a process group of
    a dozen processes, the prefix from the folder's name, its own start measured (a test of its own
    on a module swarm before: the swarm test_started_in_the_background_and_stopped_while_starting
    starts whole is checked)."""
    assert len(swarm.initial_peers) == 2
    ports = [int(MADDR.match(a).group(1)) for a in swarm.initial_peers]
    assert ports == swarm.ports and len(set(ports)) == 2
    assert set(ports) <= _ports_held_here()  # reserved by this process until the stop (procs.reserve_ports)
    assert len({a.rsplit("/", 1)[1] for a in swarm.initial_peers}) == 2  # two peer ids
    assert swarm.dht_prefix == "dist_eval-tiny_llama"
    assert swarm.num_blocks == 4 and swarm.placement == [(0, 4), (0, 4)]
    assert 0 < swarm.start_seconds <= measured_start_seconds  # it measures its own start, in seconds
    for pgid in swarm.pgids:  # a petals server is a dozen processes, all in its own group
        assert len(_procs_in_groups([pgid])) > 5
    # forked from the swarm's fork server, which imported their libraries once (dist_eval/swarm/forks.py):
    # the servers this process started, each its own group, children of the one fork server
    servers = swarm_servers_of(os.getpid())  # this swarm's, and those of others this process started
    assert set(swarm.pgids) <= set(servers)
    fork_server = {servers[pgid] for pgid in swarm.pgids}
    assert len(fork_server) == 1 and None not in fork_server, servers
    swarm.check()  # every server alive
    print(f"swarm of 2 started in {swarm.start_seconds:.1f} s")


def _check_stop(swarm):
    """stop() of a started swarm of 2 leaves no process (its fork server's neither), no port, no files
    (checked on the swarm that test_started_in_the_background_and_stopped_while_starting starts whole)."""
    pgids, ports, workdir = list(swarm.pgids), list(swarm.ports), swarm.workdir
    sockets = swarm.sockets
    servers = swarm_servers_of(os.getpid())
    fork_servers = {servers[pgid] for pgid in pgids}  # its own group too
    assert len(pgids) == 2 and os.path.isdir(workdir) and len(fork_servers) == 1
    began = time.monotonic()
    swarm.stop(timeout=15.0)
    print(f"swarm of 2 stopped in {time.monotonic() - began:.1f} s")
    _assert_groups_gone(pgids + list(fork_servers))
    assert all(_port_free(p) for p in ports), ports
    assert not set(ports) & _ports_held_here()  # the reservations let go
    assert not os.path.exists(workdir)  # private TMPDIR (pymp-*, torch shm) and logs
    assert sockets and not any(os.path.exists(p) for p in sockets)  # /tmp/hivemind-*.sock
    swarm.stop()  # idempotent


@pytest.mark.swarm
def test_server_that_exits_early_is_a_swarm_error_with_its_log(llama_dir, tmp_path):
    s = LocalSwarm(str(llama_dir), num_servers=1, log_dir=str(tmp_path), extra_server_args=["--no_such_flag"])
    try:
        with pytest.raises(SwarmError) as info:
            s.start()
        message = str(info.value)
        assert "\n" not in message
        assert "server 0" in message and "exited with code" in message
        assert "unrecognized arguments: --no_such_flag" in message  # the log's tail
        assert (tmp_path / "server-0.log").is_file()
        _assert_groups_gone(s.pgids)
    finally:
        s.stop()
        _kill_groups(s.pgids)


@pytest.mark.swarm
def test_start_timeout_stops_everything(llama_dir, tmp_path):
    s = LocalSwarm(str(llama_dir), num_servers=2, start_timeout=1.0, log_dir=str(tmp_path))
    try:
        with pytest.raises(SwarmError, match="not ready after 1 s"):
            s.start()
        assert s.pgids
        _assert_groups_gone(s.pgids)
        assert all(_port_free(p) for p in s.ports) and not set(s.ports) & _ports_held_here()
    finally:
        s.stop()
        _kill_groups(s.pgids)


def test_a_joining_server_waits_for_its_peers_file(tmp_path):
    from dist_eval.swarm.server import server_argv

    assert server_argv(["folder", "--new_swarm", "--port", "1"]) == ["folder", "--new_swarm", "--port", "1"]
    peers = tmp_path / "peers"
    written = tmp_path / "peers.tmp"  # renamed into place whole, as LocalSwarm writes it (atomic_write)
    written.write_text("/ip4/127.0.0.1/tcp/1/p2p/A\n/ip4/127.0.0.1/tcp/2/p2p/B\n")
    threading.Timer(0.3, lambda: written.rename(peers)).start()
    began = time.monotonic()
    argv = server_argv(["folder", "--initial_peers_file", str(peers), "--dht_prefix", "p"])
    assert time.monotonic() - began >= 0.25  # it waited for the file
    assert argv == ["folder", "--initial_peers", "/ip4/127.0.0.1/tcp/1/p2p/A", "/ip4/127.0.0.1/tcp/2/p2p/B",
                    "--dht_prefix", "p"]


@pytest.mark.swarm
def test_started_in_the_background_and_stopped_while_starting(llama_dir, tmp_path):
    """stop() while the servers start (a run interrupted during "starting the local swarm"): no
    server is left, whatever the start was doing; wait_started() raises. Left alone, it starts like
    start() does (_check_started: its addresses and processes); then its stop() leaves no process,
    no port, no files (_check_stop: a test of its own started a swarm of 2 for that before)."""
    for delay in (0.0, 0.5, 2.0):
        s = LocalSwarm(str(llama_dir), num_servers=2, log_dir=str(tmp_path / f"logs-{delay}"))
        try:
            s.start_in_background()
            time.sleep(delay)
            s.stop()
            with pytest.raises(SwarmError):
                s.wait_started()
            _assert_groups_gone(s.pgids)
            assert not s.starting_in_background
        finally:
            s.stop()
            _kill_groups(s.pgids)
    # ... and when left alone it starts like start() does
    placement = LocalSwarm(str(llama_dir), num_servers=2).placement  # decided before any server starts
    began = time.monotonic()
    s = LocalSwarm(str(llama_dir), num_servers=2).start_in_background()
    try:
        assert s.wait_started() is s and len(s.initial_peers) == 2 and s.placement == placement
        _check_started(s, time.monotonic() - began)
        _check_stop(s)
    finally:
        s.stop()
        _kill_groups(s.pgids)
    _assert_groups_gone(s.pgids)


def test_a_stop_the_moment_the_ports_are_reserved_leaves_make_servers_their_ports(llama_dir):
    """A stop from another thread (the interrupted start above) takes the ports lock the moment make_servers lets
    go of it, and closes the reservations: make_servers read their ports under that lock, so it plans its servers
    on them, and the start that follows starts nothing (SwarmError, as a stop while starting is). Before, it read
    them after the lock: "OSError: Bad file descriptor" (seen once in the suite under load)."""
    from dist_eval.swarm.launch import Launch

    swarm = LocalSwarm(str(llama_dir), num_servers=2)
    launch = Launch(swarm.settings, swarm._command)
    lock, stops = threading.Lock(), []

    class StoppedAtRelease:  # the lock, with the other thread's stop run as soon as it is let go
        def __enter__(self):
            lock.acquire()

        def __exit__(self, *exc):
            lock.release()
            if not stops:
                stops.append(1)
                launch.stop(time.monotonic() + 5, grace=1, drain_s=0, keep_logs=False)

    launch._ports_lock = StoppedAtRelease()
    try:
        servers = launch.make_servers()
        assert stops and launch._stopped and len(servers) == 2
        assert all(r.fileno() == -1 for r in launch.reserved)  # let go by the stop
        with pytest.raises(SwarmError, match="stopped while starting"):  # and the start starts nothing
            launch.start(lambda server, peer_args: pytest.fail(f"{server.label} started"), time.monotonic() + 60)
        assert launch.forks._proc is None  # nor a fork server
    finally:
        launch.stop(time.monotonic() + 5, grace=1, drain_s=0, keep_logs=False)


# ``python -m dist_eval.swarm`` as it is, which also says, once its servers serve, whether
# torch was imported in its own process (the servers import it; the CLI must not)
SWARM_CLI_TELLING_TORCH = (
    "import runpy, sys\n"
    "import dist_eval.swarm.cli as cli\n"
    "ready = cli._say_ready\n"
    # printed before the INITIAL_PEERS line: the test sends SIGTERM as soon as it reads that
    # line, so a line printed after it could be cut off by the signal
    "def say_ready(swarm):\n"
    "    print(f'torch imported by the CLI: {\"torch\" in sys.modules}', file=sys.stderr, flush=True)\n"
    "    ready(swarm)\n"
    "cli._say_ready = say_ready\n"
    "runpy.run_module('dist_eval.swarm', run_name='__main__', alter_sys=True)\n"
)


def _read_until(stream, text: str, timeout: float) -> str:
    """What ``stream`` (a pipe) gives until a whole line holding ``text`` came, or ``timeout``."""
    return read_pipe_until(stream, lambda buf: text.encode() in buf and buf.endswith(b"\n"), timeout)


@pytest.mark.swarm
def test_cli_prints_initial_peers_and_stops_on_sigterm(llama_dir):
    proc = subprocess.Popen(
        [sys.executable, "-c", SWARM_CLI_TELLING_TORCH, str(llama_dir), "--servers", "2", "--restart-backoff", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, cwd=ROOT,
    )  # fmt: skip
    groups = []
    try:
        line = read_stdout_line(proc, timeout=150)
        assert line.startswith("INITIAL_PEERS="), (line, proc.poll())
        peers = line.strip().split("=", 1)[1].split(" ")
        assert len(peers) == 2 and all(MADDR.match(p) for p in peers), peers
        children, servers = _children(proc.pid), swarm_servers_of(proc.pid)
        groups = [*servers, *children]  # the servers, the watchdog and the servers' fork server
        assert len(servers) == 2, (servers, children)
        assert all(os.getpgid(g) == g for g in groups)  # each its own group

        # a server SIGKILLed: the swarm process restarts it (issue 42), one line for each event
        victim = min(servers)
        os.killpg(victim, signal.SIGKILL)
        early = _read_until(proc.stderr, "serves again", timeout=90)
        assert "died (killed by SIGKILL); restarting in" in early and "serves again" in early, early
        groups += [pid for pid in swarm_servers_of(proc.pid) if pid not in groups]

        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
        took = time.monotonic() - began
        print(f"CLI stopped in {took:.1f} s")
        assert proc.returncode == 0, early + err.decode()
        assert out == b""  # INITIAL_PEERS was the only stdout line
        err = early + err.decode()
        assert "--dht-prefix dist_eval-tiny_llama" in err and "torchrun" in err and "Traceback" not in err
        assert "torch imported by the CLI: False" in err, err  # a real model folder read without torch
        _assert_groups_gone(groups)
        assert all(_port_free(int(MADDR.match(p).group(1))) for p in peers)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_groups(groups)


@pytest.mark.swarm
def test_watchdog_stops_servers_when_owner_is_killed(llama_dir):
    code = (
        "import json, sys, time\n"
        "from dist_eval.swarm import LocalSwarm\n"
        "s = LocalSwarm(sys.argv[1], num_servers=1).start()\n"
        "print(json.dumps({'pgids': s.pgids, 'ports': s.ports, 'workdir': s.workdir}), flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code, str(llama_dir)], stdout=subprocess.PIPE, env=ENV, cwd=ROOT)
    info = {}
    try:
        line = read_stdout_line(owner, timeout=150)
        info = json.loads(line)
        assert _procs_in_groups(info["pgids"])
        owner.kill()  # no atexit, no __exit__: only the watchdog can clean up
        owner.wait()
        end = time.monotonic() + 15
        while any(st != "Z" for st in _procs_in_groups(info["pgids"]).values()) and time.monotonic() < end:
            time.sleep(0.2)
        _assert_groups_gone(info["pgids"])
        assert all(_port_free(p) for p in info["ports"])
        end = time.monotonic() + 5
        while os.path.exists(info["workdir"]) and time.monotonic() < end:
            time.sleep(0.1)
        assert not os.path.exists(info["workdir"])
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        _kill_groups(info.get("pgids", []))
