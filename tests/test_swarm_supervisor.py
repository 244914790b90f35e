"""A swarm that outlives its servers (issue 42): the supervisor of ``dist_eval/swarm/supervisor.py``
restarting dead servers with a backoff and a limit, SIGTERM draining a server, and
``python -m dist_eval.swarm status``.

The real-swarm part is one test on one swarm of three full replicas (each event depends on the
one before it, and a swarm start is seconds of the suite's budget): a replica SIGKILLed mid-run
(the run == the local backend bitwise, the replica back), the bootstrap server killed (a client
given another's address runs; it rejoins through that address), one SIGTERMed mid-run (drained:
the run == the local backend, the server not restarted), the limit reached (it stays down, one
line, another serves), the last one SIGTERMed (the swarm's check fails). Marked ``swarm``; not
``multiproc``: the runs are one rank each, in this process or a plain ``python -m dist_eval`` (forked from
conftest's rank_zygote, without its imports).
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import (
    REPO,
    one_thread_swarm,
    read_jsonl,
    read_stdout_line,
    reference_160_args,
    swarm_servers_of,
    write_csv,
)
from inprocess_cli import run_cli_in_process

from dist_eval.procs import hivemind_socket_paths, live_groups
from dist_eval.swarm import SwarmError
from dist_eval.swarm.status import render
from dist_eval.swarm.supervisor import RestartPolicy, describe_exit, ranges

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
       "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
POLICY = RestartPolicy(max_restarts=1, window=600.0, backoff=0.5, unserved_timeout=120.0)
# the runs' figures nobody looks at: matplotlib hidden (run_cli_in_process; conftest's no_figures for a process)
NO_FIGURES = ("matplotlib",)


# --------------------------------------------------------------------------- no servers


def test_the_restart_policy():
    policy, rng = RestartPolicy(backoff=2.0, max_backoff=10.0, jitter=0.0), random.Random(0)
    assert [policy.delay(k, rng) for k in (1, 2, 3, 4, 5)] == [2.0, 4.0, 8.0, 10.0, 10.0]
    jittered = RestartPolicy(backoff=2.0, jitter=0.25)
    assert all(1.5 <= jittered.delay(1, rng) <= 2.5 for _ in range(200))
    for bad, name in (({"max_restarts": -1}, "max_restarts"), ({"window": 0}, "window"),
                      ({"backoff": 90.0}, "backoff"), ({"unserved_timeout": -1.0}, "unserved_timeout")):
        with pytest.raises(SwarmError, match=name):
            RestartPolicy(**bad)
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(3) == "exit code 3"
    assert ranges([0, 1, 2, 5, 7, 8]) == "0:3, 5:6, 7:9"


def test_a_restart_joins_the_servers_up_or_waits_for_a_new_swarms_address():
    from types import SimpleNamespace

    from dist_eval.swarm.supervisor import Supervisor

    servers = [SimpleNamespace(address=f"/ip4/127.0.0.1/tcp/{i + 1}/p2p/Qm{i}") for i in range(3)]
    swarm = SimpleNamespace(servers=servers, restart=RestartPolicy(), join_peers=[])
    supervisor = Supervisor(swarm, log=print)
    states = lambda *s: [setattr(w, "state", state) for w, state in zip(supervisor.watches, s)]  # noqa: E731
    states("waiting", "up", "waiting")
    assert supervisor.peers_for(servers[0]) == [servers[1]]
    states("waiting", "down", "starting")
    assert supervisor.peers_for(servers[0]) == [servers[2]]  # restarting, its address known (the same identity)
    servers[2].address = None
    assert supervisor.peers_for(servers[0]) is None  # a new swarm on its way: wait for its address
    swarm.join_peers = ["/ip4/10.0.0.5/tcp/31337/p2p/QmA"]
    assert supervisor.peers_for(servers[0]) == []  # joins the swarm this host joined
    swarm.join_peers = []
    states("waiting", "down", "down")
    assert supervisor.peers_for(servers[0]) == []  # nobody left: a new swarm


def test_when_the_swarm_gives_up():
    from types import SimpleNamespace

    from dist_eval.swarm.supervisor import Supervisor

    servers = [SimpleNamespace(blocks=(0, 4), label="server 0 (blocks 0:4, port 1)")]
    swarm = SimpleNamespace(servers=servers, restart=RestartPolicy(unserved_timeout=5.0), join_peers=[],
                            block_range=(0, 4))
    supervisor = Supervisor(swarm, log=print)
    assert supervisor.failure() is None  # every block served
    supervisor.watches[0].state, supervisor.unserved = "waiting", [0, 1, 2, 3]
    supervisor.unserved_since = time.monotonic() - 1.0
    assert supervisor.failure() is None  # a restart may bring them back
    supervisor.unserved_since = time.monotonic() - 6.0
    assert "blocks 0:4 have no live server for 6 s (--unserved-timeout 5)" in supervisor.failure()
    supervisor.watches[0].state, supervisor.unserved_since = "down", time.monotonic() - 1.0
    assert "every server holding them stays down (server 0 (blocks 0:4, port 1): down)" in supervisor.failure()


def _status(*args, timeout: float = 90.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dist_eval.swarm", "status", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=REPO)


def _status_here(capsys, *args) -> subprocess.CompletedProcess:
    """:func:`_status`'s command in this process (status.main; the entry point's own dispatch and exit
    codes are the subprocess test's: a peer that does not answer): petals is imported here already, a
    process start is ~1-3 s."""
    from dist_eval.swarm import status

    capsys.readouterr()
    try:
        code = status.main(list(args))
    except SystemExit as e:  # argparse's refusals
        code = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["status", *args], code, out, err)


@pytest.mark.parametrize("args, message", [
    ([], "--initial-peers"),
    (["--initial-peers", "not-an-address", "--dht-prefix", "p"], "expected a multiaddr"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/QmPZ4KWFQPiKRiaRQrYdS8SrgLnjpyB6PPj643UBXCkvd4"], "--dht-prefix"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/QmPZ4KWFQPiKRiaRQrYdS8SrgLnjpyB6PPj643UBXCkvd4",
      "--dht-prefix", "p", "--num-blocks", "0"], "--num-blocks"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/QmPZ4KWFQPiKRiaRQrYdS8SrgLnjpyB6PPj643UBXCkvd4",
      "--dht-prefix", "p", "--timeout", "10"], "--initial-peers: no peer answered"),  # nobody at that port
])
def test_status_bad_flags_exit_2_with_one_line(args, message, capsys):
    """The refusals in this process (status.main, as _status_here: a peer that does not answer too, its
    DHT's p2pd a process of its own all the same); the malformed address also through the entry point
    (``python -m dist_eval.swarm status``: its dispatch, and the code status.main returns as its exit
    code; a fresh process that imports no hivemind for it, where the unanswered peer's cost ~6 CPU-s)."""
    r = _status_here(capsys, *args)
    if "not-an-address" in args:
        launched = _status(*args)
        assert (launched.returncode, launched.stdout, launched.stderr) == (r.returncode, r.stdout, r.stderr)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_restart_flags_are_checked_and_named():
    r = subprocess.run([sys.executable, "-m", "dist_eval.swarm", str(REPO), "--max-restarts", "-1"],
                       capture_output=True, text=True, timeout=60, env=ENV, cwd=REPO)
    assert r.returncode == 2 and "--max-restarts -1" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_dead_daemons_socket_is_removed():
    """What a p2pd that exited on its own leaves (no peer answered: the status command above, a client's
    ranks; hivemind removes a daemon's socket only while it runs): removed when no process holds it and it
    was bound since the call's start; a socket held, or one older, is left alone."""
    import socket
    import uuid

    from dist_eval.procs import remove_dead_hivemind_sockets

    since = time.time()
    paths = [f"/tmp/hivemind-p2pd-test-{uuid.uuid4().hex[:8]}-{what}.sock" for what in ("dead", "held", "old")]
    held = []
    try:
        for path in paths:
            s = socket.socket(socket.AF_UNIX)
            s.bind(path)
            if path.endswith("held.sock"):
                held.append(s)
            else:
                s.close()  # its file stays, as a dead p2pd's
        os.utime(paths[2], (since - 60, since - 60))
        remove_dead_hivemind_sockets(since)
        assert [os.path.exists(p) for p in paths] == [False, True, True]
    finally:
        for s in held:
            s.close()
        for path in paths:
            if os.path.exists(path):
                os.remove(path)


def test_status_table():
    server = {"addresses": ["/ip4/10.0.0.5/tcp/31337"], "reachable": True, "state": "ONLINE", "blocks": [0, 2],
              "torch_dtype": "torch.float16", "throughput": 12.5, "version": "2.2.0"}
    status = {"dht_prefix": "m", "num_blocks": 3, "num_blocks_from": "given", "unserved": [2], "healthy": False,
              "servers": [{**server, "peer_id": "QmA"}, {**server, "peer_id": "QmB", "reachable": False}],
              "blocks": [{"block": b, "servers": ["QmA", "QmB"] if b < 2 else [], "online": ["QmA"] if b < 2 else []}
                         for b in range(3)]}
    text = render(status)
    assert "S0  ONLINE   blocks 0:2  float16  throughput 12.5  petals 2.2.0  reachable  " \
           "/ip4/10.0.0.5/tcp/31337/p2p/QmA" in text, text
    assert "UNREACHABLE" in text and "blocks 0:2: S0, S1 (not serving)" in text
    assert "blocks 2:3: NO SERVER (none)" in text and text.endswith("unserved: blocks 2")


def test_status_table_escapes_what_the_peers_announce():
    """Issue 50. Before: a server's self-announced version, dtype or address reached the terminal
    raw: an escape sequence in it could recolour the table, move the cursor or set the title."""
    server = {"addresses": ["/ip4/10.0.0.5/tcp/1\x1b[2J"], "reachable": True, "state": "ONLINE", "blocks": [0, 1],
              "torch_dtype": "torch.float16\x9b31m", "throughput": 1.0, "peer_id": "QmA",
              "version": "2.2.0\x1b]0;owned\x07\x1b[32m ok\u202egnp.exe\r\nfake line"}
    status = {"dht_prefix": "m", "num_blocks": 1, "num_blocks_from": "given", "unserved": [], "healthy": True,
              "servers": [server], "blocks": [{"block": 0, "servers": ["QmA"], "online": ["QmA"]}]}
    text = render(status)
    assert not any(ch in text for ch in "\x1b\x07\x9b\u202e\r"), repr(text)
    assert "petals 2.2.0\\x1b]0;owned\\x07\\x1b[32m ok\\u202egnp.exe\\r\\nfake line  reachable" in text, text
    assert "float16\\x9b31m" in text and "/ip4/10.0.0.5/tcp/1\\x1b[2J/p2p/QmA" in text
    assert len(text.splitlines()) == 4  # the announced newline is no line of the table


# --------------------------------------------------------------------------- a real swarm


@pytest.fixture(scope="module")
def local_run(local_reference_160):
    """(the rows, the local backend's predictions of them): what every run on a swarm must give
    (conftest's local_reference_160, shared with test_swarm_failover.py)."""
    data, predictions, _ = local_reference_160
    return data, predictions


@pytest.fixture(scope="module")
def events():
    return []


@pytest.fixture(scope="module")
def swarm(tiny_model, events):
    def log(line):
        events.append(line)
        print(f"dist_eval.swarm: {line}", file=sys.stderr, flush=True)

    yield from one_thread_swarm(tiny_model, num_servers=3, dht_prefix="dist-eval-supervised", restart=POLICY, log=log)


def _wait_for(condition, seconds: float, what: str) -> float:
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < seconds, f"not within {seconds} s: {what}"
        time.sleep(0.1)
    return time.monotonic() - began


def _kill(swarm, index: int, sig=signal.SIGKILL) -> None:
    os.killpg(swarm.pgids[index], sig) if sig == signal.SIGKILL else os.kill(swarm.pgids[index], sig)


def _lines(events, index: int, text: str) -> list:
    return [e for e in events if e.startswith(f"server {index} ") and text in e]


def _run_killing(swarm, index, sig, args, events, env, zygote) -> str:
    """A plain ``python -m dist_eval`` run of ``args`` (one rank; torchrun's own start-up adds nothing
    here; forked from ``zygote`` by conftest's start_ranks: its imports are not what is tested) whose
    server ``index`` gets ``sig`` a second into its loop; its stderr, once it finished with code 0
    and no traceback. ``env``: additions to its environment (no_figures).
    """
    from test_swarm_failover import BackgroundCli

    run = BackgroundCli(args, nproc=0, env=env, zygote=zygote)
    try:
        assert run.evaluating.wait(timeout=240), "".join(run.err)[-3000:]
        # 0.3 s into the loop: one rank's 160 rows take ~1.3 s on a quiet machine, and 1.0 s left the
        # signal too late once (the run had ended); the first batches are done by then
        time.sleep(0.3)
        assert run.proc.poll() is None, "the run ended before the signal"
        _kill(swarm, index, sig)
        code, _, err = run.wait(timeout=300)
    finally:
        run.stop()
    assert code == 0 and "Traceback" not in err, err[-3000:] + "\n".join(events)
    return err


def _run_args(model, checkpoint, data, out, peers=None, prefix=None):
    """local_run's batch plan (batch size 2, in flight 1), on the swarm of ``peers`` (or the local backend)."""
    swarm_args = ["--initial-peers", *peers, "--dht-prefix", prefix] if peers else ["--backend", "local"]
    return reference_160_args(model, checkpoint, data, out, *swarm_args)


@pytest.mark.swarm
def test_a_swarm_outlives_its_servers(swarm, events, tiny_model, tiny_checkpoint, local_run, tmp_path, no_figures,
                                      capsys, rank_zygote):
    assert swarm.placement == [(0, 4)] * 3
    data, reference = local_run
    peers, prefix = list(swarm.initial_peers), swarm.dht_prefix

    # 1. a replica SIGKILLed mid-run: the run finishes == the local backend; the replica is back
    _run_killing(swarm, 1, signal.SIGKILL, _run_args(tiny_model, tiny_checkpoint, data, tmp_path / "killed", peers,
                                                      prefix), events, no_figures, rank_zygote)
    assert read_jsonl(tmp_path / "killed" / "predictions.jsonl") == reference  # logits bitwise
    back = _wait_for(lambda: swarm.server_state(1) == "up" and swarm.restarts(1) == 1, 60, "server 1 restarted")
    assert len(_lines(events, 1, "died (killed by SIGKILL); restarting in")) == 1, events
    assert len(_lines(events, 1, "serves again (restart 1")) == 1, events
    assert swarm.initial_peers == peers  # the same identity: the same addresses
    # the restarted server's hivemind sockets are noted, so that the stop removes them however it ends
    held = hivemind_socket_paths(live_groups({swarm.servers[1].pgid})[swarm.servers[1].pgid])
    assert held and held <= swarm.sockets, (held, swarm.sockets)
    swarm.check()
    print(f"server 1 back {back:.1f} s after the run ended")

    # it rejoined the same swarm: server 1's address alone shows both, ONLINE and reachable
    r = _status_here(capsys, "--initial-peers", peers[1], "--dht-prefix", prefix, "--json")
    assert r.returncode == 0, r.stderr
    status = json.loads(r.stdout)
    assert status["healthy"] and status["num_blocks"] == 4 and status["unserved"] == []
    assert sorted(s["peer_id"] for s in status["servers"]) == sorted(p.rsplit("/", 1)[1] for p in peers)
    assert all(s["state"] == "ONLINE" and s["reachable"] and s["blocks"] == [0, 4] for s in status["servers"])
    assert all(len(b["online"]) == 3 for b in status["blocks"])

    # 2. the bootstrap server killed: a client given the other's address runs; it rejoins through that address
    _kill(swarm, 0)  # the client in this process (one thread: a rank's bits), as a plain `python -m dist_eval` was
    assert run_cli_in_process(_run_args(tiny_model, tiny_checkpoint, data, tmp_path / "bootstrap", peers[1:],
                                        prefix), hide_modules=NO_FIGURES) == 0
    assert read_jsonl(tmp_path / "bootstrap" / "predictions.jsonl") == reference
    _wait_for(lambda: swarm.server_state(0) == "up" and swarm.restarts(0) == 1, 60, "server 0 restarted")
    with open(swarm.log_paths[0]) as f:
        restart_command = [line for line in f if line.startswith("$ ")][-1]
    assert f"--initial_peers {peers[1]}" in restart_command and "--new_swarm" not in restart_command

    # 3. SIGTERM to server 2 mid-run drains it: the run == the local backend, at most a warning; not restarted
    # (its figures drawn: without matplotlib the run warns once more, and the warnings are what is counted)
    err = _run_killing(swarm, 2, signal.SIGTERM, _run_args(tiny_model, tiny_checkpoint, data, tmp_path / "drained",
                                                           peers, prefix), events, None, rank_zygote)
    assert read_jsonl(tmp_path / "drained" / "predictions.jsonl") == reference
    assert len([line for line in err.splitlines() if line.startswith("dist_eval: warning")]) <= 1, err[-3000:]
    _wait_for(lambda: swarm.server_state(2) == "down", 30, "server 2 drained")
    assert swarm.servers[2].proc.returncode == 0
    assert len(_lines(events, 2, "left the swarm (exit code 0")) == 1 and not _lines(events, 2, "restarting in"), events

    # 4. killed again past the limit: it stays down, one line; the other serves
    _kill(swarm, 1)
    _wait_for(lambda: swarm.server_state(1) == "down", 30, "server 1 down")
    gave_up = _lines(events, 1, "not restarted")
    assert len(gave_up) == 1 and "killed by SIGKILL" in gave_up[0] and "--max-restarts 1" in gave_up[0], events
    assert "stays down; the other servers still serve its blocks" in gave_up[0]
    time.sleep(2 * POLICY.backoff)
    assert swarm.server_state(1) == "down" and swarm.restarts(1) == 1
    swarm.check()  # server 0 serves every block
    # the table, asked for a 5th block that nobody announces: exit 1 for it alone
    r = _status_here(capsys, "--initial-peers", peers[0], "--dht-prefix", prefix, "--num-blocks", "5")
    lines = r.stdout.splitlines()
    assert r.returncode == 1 and lines[-1] == "unserved: blocks 4", r.stdout + r.stderr
    assert "UNREACHABLE" in r.stdout and "blocks 4:5: NO SERVER (none)" in lines, r.stdout
    # blocks 0-3: one server serves each, servers 1 and 2 at most listed as not serving (their records in
    # the DHT, OFFLINE or stale, may differ from block to block while they expire: so ranges may split)
    ranges = [line for line in lines if line.startswith("blocks ") and not line.startswith("blocks 4:5")]
    covered = set()
    for line in ranges:
        start, end = map(int, line.split()[1].rstrip(":").split(":"))
        covered |= set(range(start, end))
        serving = [entry for entry in line.split(": ", 1)[1].split(", ") if "(not serving)" not in entry]
        assert len(serving) == 1, r.stdout  # server 0 alone (status numbers the servers its own way)
    assert covered == {0, 1, 2, 3}, r.stdout

    # 5. SIGTERM drains server 0, the last one: OFFLINE announced, exit 0, not restarted; the swarm then fails its check
    _kill(swarm, 0, signal.SIGTERM)
    _wait_for(lambda: swarm.server_state(0) == "down", 30, "server 0 drained")
    assert swarm.servers[0].proc.returncode == 0
    with open(swarm.log_paths[0]) as f:
        assert "are offline" in f.read()  # petals' graceful path announced it
    assert len(_lines(events, 0, "left the swarm (exit code 0")) == 1, events
    with pytest.raises(SwarmError, match="blocks 0:4 have no live server and every server holding them stays down"):
        swarm.check()


def _start_host(env, log_path, *args):
    """``launch/start_server.sh [args]`` (one server) in its own session: (the process, its INITIAL_PEERS)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([os.path.join(REPO, "launch", "start_server.sh"), *args], env=env, cwd=REPO,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    line = read_stdout_line(proc, timeout=150)
    assert line.startswith("INITIAL_PEERS="), (line, open(log_path).read()[-3000:])
    return proc, line.strip().split("=", 1)[1].split(" ")


# petals' forward handlers, once imported in a server and while the file SLOW_FORWARD_WHEN exists, write
# SLOW_FORWARD_MARK and wait SLOW_FORWARD_S seconds before they serve: a request that stays in flight
SLOW_FORWARD_SITECUSTOMIZE = """import asyncio, functools, importlib.abc, importlib.util, os, sys


def _slowed(forward, stream):
    async def wait():
        if not os.path.exists(os.environ["SLOW_FORWARD_WHEN"]):
            return  # not slowed (yet): served as any server serves
        open(os.environ["SLOW_FORWARD_MARK"], "a").close()
        await asyncio.sleep(float(os.environ["SLOW_FORWARD_S"]))

    @functools.wraps(forward)
    async def rpc_forward(self, request, context):
        await wait()
        return await forward(self, request, context)

    @functools.wraps(forward)
    async def rpc_forward_stream(self, requests, context):
        await wait()
        async for response in forward(self, requests, context):
            yield response

    return rpc_forward_stream if stream else rpc_forward


class SlowForwards(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "petals.server.handler":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_slow(module):
            exec_module(module)
            cls = module.TransformerConnectionHandler
            cls.rpc_forward = _slowed(cls.rpc_forward, False)
            cls.rpc_forward_stream = _slowed(cls.rpc_forward_stream, True)

        spec.loader.exec_module = exec_and_slow
        return spec


sys.meta_path.insert(0, SlowForwards())
"""


@pytest.mark.swarm
def test_a_hosts_swarm_process_dying_leaves_the_others_serving_then_a_request_in_flight_finishes_on_it_told_to_stop(
        tiny_model, tiny_checkpoint, local_run, tmp_path, capsys, no_figures, rank_zygote):
    """Two hosts (launch/start_server.sh, one server each, each serving every block), B joined to A. In this
    order, on the same two hosts (each case started hosts of its own before: two host starts, ~7 CPU-s each,
    became one): A's swarm process SIGKILLed leaves B serving (:func:`hosts_swarm_process_dying_leaves_the_
    others_serving`); then B, the one server left, SIGTERMed while it serves a forward 4 s long drains it
    (:func:`request_in_flight_finishes_on_a_server_told_to_stop`). B's forwards are slowed only from the
    second case on (a file its sitecustomize looks for at each forward)."""
    from test_swarm_failover import BackgroundCli

    data8 = write_csv(str(tmp_path / "rows.csv"), 8, seed=11)
    # the second case's reference in this process, one thread (== a torchrun rank bitwise; was a one-rank torchrun)
    assert run_cli_in_process([*_run_args(tiny_model, tiny_checkpoint, data8, tmp_path / "local"), "--batch-size",
                               "8"], hide_modules=NO_FIGURES) == 0
    slow, slowed, mark = tmp_path / "slow_forwards", tmp_path / "slowed", tmp_path / "forward_began"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_FORWARD_SITECUSTOMIZE)
    env = {**ENV, "PYTHON": sys.executable, "MODEL_DIR": tiny_model, "DHT_PREFIX": "dist-eval-hosts",
           "HOST": "127.0.0.1", "SERVERS": "1", "DEVICE": "cpu"}
    env_b = {**env, "PYTHONPATH": f"{slow}{os.pathsep}{ENV['PYTHONPATH']}", "SLOW_FORWARD_S": "4",
             "SLOW_FORWARD_MARK": str(mark), "SLOW_FORWARD_WHEN": str(slowed)}
    hosts, groups, run = [], [], None
    try:
        host_a, peers_a = _start_host(env, tmp_path / "a.log")
        hosts.append(host_a)
        host_b, peers_b = _start_host({**env_b, "INITIAL_PEERS": " ".join(peers_a)}, tmp_path / "b.log",
                                      "--log-dir", str(tmp_path / "logs"))
        hosts.append(host_b)
        groups = _server_groups(host_a.pid) + _server_groups(host_b.pid)
        assert len(groups) == 2, groups
        hosts_swarm_process_dying_leaves_the_others_serving(host_a, host_b, peers_b, groups, tiny_model,
                                                            tiny_checkpoint, local_run, tmp_path, capsys)
        slowed.touch()
        run = BackgroundCli([*_run_args(tiny_model, tiny_checkpoint, data8, tmp_path / "drained", peers_b,
                                        "dist-eval-hosts"), "--batch-size", "8", "--swarm-timeout", "15"], nproc=0,
                            env=no_figures, zygote=rank_zygote)
        request_in_flight_finishes_on_a_server_told_to_stop(host_b, run, mark, groups, tmp_path)
    finally:
        if run is not None:
            run.stop()
        _stop_hosts(hosts, groups)


def hosts_swarm_process_dying_leaves_the_others_serving(host_a, host_b, peers_b, groups, tiny_model, tiny_checkpoint,
                                                        local_run, tmp_path, capsys):
    """A's swarm process SIGKILLed (its watchdog stops its server): B serves on; a client given B's address
    runs, == the local backend; status through B says every block is served."""
    from test_swarm_failover import _group

    data, reference = local_run
    host_a.kill()
    host_a.wait(timeout=10)
    _wait_for(lambda: not _group(groups[0]), 15, "host A's server stopped by its watchdog")
    assert host_b.poll() is None and _group(groups[1]), open(tmp_path / "b.log").read()[-3000:]
    # the client in this process (one thread: a rank's bits), as a plain `python -m dist_eval` was
    assert run_cli_in_process(_run_args(tiny_model, tiny_checkpoint, data, tmp_path / "via_b", peers_b,
                                        "dist-eval-hosts"), hide_modules=NO_FIGURES) == 0
    assert read_jsonl(tmp_path / "via_b" / "predictions.jsonl") == reference
    r = _status_here(capsys, "--initial-peers", *peers_b, "--dht-prefix", "dist-eval-hosts", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    status = json.loads(r.stdout)
    assert status["unserved"] == [] and all(b["online"] == [peers_b[0].rsplit("/", 1)[1]] for b in status["blocks"])


def request_in_flight_finishes_on_a_server_told_to_stop(host, run, mark, groups, tmp_path):
    """SIGTERM to a swarm process (launch/start_server.sh, one server, the swarm's last) while its server
    serves a forward 4 s long, the run's one batch: the server drains (the forward finishes; petals'
    shutdown cut it, and the run failed: no other server), the swarm process waits for the
    drain, both exit 0, no process is left; the run == the local backend."""
    from test_swarm_failover import _group

    _wait_for(lambda: mark.exists() or run.proc.poll() is not None, 240, "the forward began")
    host.send_signal(signal.SIGTERM)
    code, _, err = run.wait(timeout=120)
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert host.wait(timeout=60) == 0, open(tmp_path / "b.log").read()[-3000:]
    log = open(tmp_path / "logs" / "server-0.log").read()
    assert "dist_eval.swarm.server: draining: 1 request(s) in flight, new ones refused" in log, log[-3000:]
    assert re.search(r"^dist_eval.swarm.server: drained in [3-9]\.\d s$", log, re.MULTILINE), log[-3000:]
    # torch's shared-memory manager had time to clean up after the server (procs.shm_managers_under)
    assert "terminate called" not in log and "Traceback" not in log, log[-3000:]
    assert read_jsonl(tmp_path / "drained" / "predictions.jsonl") == read_jsonl(tmp_path / "local" /
                                                                                "predictions.jsonl")
    assert not [g for g in groups if _group(g)], log[-3000:]


def _stop_hosts(hosts, groups) -> None:
    """Whatever a test left running: its swarm processes, then their servers' process groups."""
    for proc in hosts:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass


def _server_groups(pid) -> list:
    """The process groups of the swarm servers that ``pid`` started."""
    return list(swarm_servers_of(pid))
