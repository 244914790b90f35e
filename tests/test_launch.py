"""Beyond one machine, shown on one: the launch/ scripts, multi-node torchrun (c10d
rendezvous) and a swarm whose servers run as separate "hosts".

Every "node" is its own torchrun process (launch/run_multinode.sh) and every "host" its
own ``python -m dist_eval.swarm`` process (launch/start_server.sh), exactly as they would
run on separate machines, only all on 127.0.0.1. Each is started in its own process
group and stopped in ``finally``. The swarm test is marked ``swarm``; the others start
no server.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
from conftest import (
    REPO,
    build_checkpoint,
    eval_args,
    free_port,
    outputs,
    read_stdout_line,
    run_in_own_group,
    split_into_shards,
    stop_group,
    swarm_server_pids,
    write_csv,
)
from fake_hub import fake_hub
from inprocess_cli import run_cli_in_process

LAUNCH = os.path.join(REPO, "launch")
SCRIPTS = ["run_local.sh", "run_multinode.sh", "start_server.sh", "slurm.sbatch"]
ENV = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
# a peer id: 12D3KooW... (Ed25519) or Qm... (RSA: the identity files dist_eval's servers keep over restarts)
MADDR = re.compile(r"^/ip4/127\.0\.0\.1/tcp/(\d+)/p2p/(?:12D3KooW|Qm)[1-9A-HJ-NP-Za-km-z]+$")


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("multinode")
    return build_checkpoint(str(folder / "ck.pt")), write_csv(str(folder / "data.csv"), 41, seed=11)


def run_script(script, args, env=None, timeout=240):
    return run_in_own_group(["bash", os.path.join(LAUNCH, script), *args], timeout=timeout, env={**ENV, **(env or {})})


def start_in_own_group(cmd, env, stdout=subprocess.PIPE, stderr=None):
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                            start_new_session=True)


def run_nodes(args, tmp_path, nnodes=2, nproc_per_node=1, timeout=240, node_env=None):
    """``nnodes`` separate torchrun processes (launch/run_multinode.sh, NODE_RANK 0..n-1)
    meeting at a c10d rendezvous on 127.0.0.1; returns [(returncode, log text)] per node.
    ``node_env``: {node rank: environment variables of that node alone}."""
    port = free_port()
    env = {**ENV, "NNODES": str(nnodes), "NPROC_PER_NODE": str(nproc_per_node), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "RDZV_ID": f"test-{port}", "RDZV_TIMEOUT": "120", "LOCAL_ADDR": "127.0.0.1"}
    nodes, logs = [], []
    try:
        for rank in reversed(range(nnodes)):  # the rendezvous host last: the others must wait for it
            log = open(tmp_path / f"node{rank}.log", "w+")
            logs.insert(0, log)
            nodes.insert(0, start_in_own_group(["bash", os.path.join(LAUNCH, "run_multinode.sh"), *args],
                                               {**env, **(node_env or {}).get(rank, {}), "NODE_RANK": str(rank)},
                                               stdout=log, stderr=subprocess.STDOUT))
        end = time.monotonic() + timeout
        for node in nodes:
            node.wait(timeout=max(1.0, end - time.monotonic()))
    finally:
        for node in nodes:
            stop_group(node.pid)  # a node that failed or timed out must not leave its ranks behind
            node.wait()
    out = []
    for node, log in zip(nodes, logs):
        log.seek(0)
        out.append((node.returncode, log.read()))
        log.close()
    return out


def children_running_server(pid):
    """pids of the swarm server processes that ``pid`` started (each leads its own group)."""
    found = []
    for server in swarm_server_pids():
        try:
            with open(f"/proc/{server}/stat", "rb") as f:
                ppid = int(f.read().decode("utf-8", "replace").rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            found.append(server)
    return found


def live_in_groups(pgids):
    pgids, live = set(pgids), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    rest = f.read().decode("utf-8", "replace").rpartition(")")[2].split()
            except OSError:
                continue
            if rest[0] != "Z" and int(rest[2]) in pgids:
                live.append(int(entry))
    return live


def port_is_free(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def assert_ok(returncode, log):
    # torchrun's failure summary ends the log: show the lines that say what failed too
    said = "\n".join(line for line in log.splitlines() if "error" in line.lower() or "Traceback" in line)
    assert returncode == 0, f"{said[-3000:]}\n---\n{log[-2000:]}"
    assert "Traceback" not in log, log[-3000:]


@pytest.fixture(scope="module")
def local_reference(tiny_model, inputs, tmp_path_factory):
    """The single-node run of the local backend, one rank: in this process (one thread, as a
    torchrun rank: the same bits; launch/run_local.sh itself runs in the two-hosts test)."""
    out = tmp_path_factory.mktemp("reference")
    assert run_cli_in_process(eval_args(tiny_model, inputs, out, "--backend", "local")) == 0
    return outputs(out)


# --------------------------------------------------------------------------- no servers


def test_launch_scripts_are_executable_and_say_how_to_call_them():
    for name in SCRIPTS:
        path = os.path.join(LAUNCH, name)
        assert os.access(path, os.X_OK), f"{name} is not executable"
        with open(path) as f:
            head = f.read(1500)
        assert head.startswith("#!/usr/bin/env bash"), name
        assert f"launch/{name}" in head, f"{name}: its top should show how to call it"
        subprocess.run(["bash", "-n", path], check=True)


@pytest.mark.parametrize("script, variable", [("run_multinode.sh", "MASTER_ADDR"), ("start_server.sh", "MODEL_DIR")])
def test_scripts_name_a_missing_required_variable(script, variable):
    env = {k: v for k, v in ENV.items() if k != variable}
    proc = subprocess.run(["bash", os.path.join(LAUNCH, script)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert f"{variable}: set {variable}" in proc.stderr, proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--host", "0.0.0.0"], "nobody's address"),
    (["--host", "192.0.2.123"], "not an address of this machine"),
    (["--initial-peers", "127.0.0.1:31337"], "expected a multiaddr"),
    (["--block-indices", "2:2"], "block range 2:2: expected A:B"),
    (["--block-indices", "0:5"], "0 <= A < B <= 4"),
    (["--block-indices", "two"], "expected A:B"),
])
def test_swarm_cli_refuses_bad_multi_host_arguments(tiny_model, args, message, capsys):
    from dist_eval.swarm import main

    try:
        code = main([tiny_model, *args])
    except SystemExit as e:  # argparse's errors
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_local_rank_beyond_the_gpus_is_a_usage_error_with_nccl(monkeypatch):
    """NCCL needs a GPU per rank (gloo, the default, does not: tests/test_ranks_devices.py)."""
    import torch

    from dist_eval import ranks
    from dist_eval.errors import UsageError

    env = dict(RANK="1", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert ranks.launched_on_several_nodes()  # 4 ranks, 2 on this node
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device before the check"))
    with pytest.raises(UsageError, match=r"NCCL needs one CUDA device per rank, and LOCAL_RANK 1 finds 1 visible"):
        ranks.init_process_group_from_env(10, dist_backend="nccl")


FAKE_SCONTROL = """#!/usr/bin/env bash
# fake `scontrol show hostnames LIST`: one host per line
[[ "$1 $2" == "show hostnames" ]] || { echo "fake scontrol: unexpected: $*" >&2; exit 2; }
tr ',' '\\n' <<< "$3"
"""
FAKE_SRUN = """#!/usr/bin/env bash
# fake srun: the command once per node of the job, here, with that node's SLURM_NODEID
echo "$*" >> "$FAKE_SLURM_LOG"
while [[ "$1" == --* ]]; do shift; done
pids=()
# each node its own HF_HOME (FAKE_HF_HOME<node>), as separate machines have
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i HF_HOME="$FAKE_HF_HOME$i" "$@" & pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


# the ranks of the node it is imported on (torchrun sets LOCAL_RANK) exit this many seconds late
SLOW_EXIT_SITECUSTOMIZE = """import atexit, os, time
if os.environ.get("LOCAL_RANK") is not None:
    atexit.register(time.sleep, float(os.environ["SLOW_EXIT_S"]))
"""


@pytest.mark.multiproc
def test_a_multi_node_run_without_initial_peers_is_refused_with_its_code_on_every_node(tiny_model, inputs,
                                                                                        tmp_path):
    """A local swarm listens on 127.0.0.1 of rank 0's node: no use to other nodes. Refused (rank 0's
    usage error, in a phase): no server started, no report, dist_eval's usage code on every node
    (torchrun's own exit is 1) and the run's one line all the output there is, no torchrun report
    after it, also with node 1's rank 3 s slower to exit than the rendezvous host's: the host's
    launcher leaves once its own ranks end after a failure, and the store goes with it; node 1's
    rank took its launcher's poll of the store with it (a traceback, exit 1, torch's C++ store
    warnings). One two-node launch for both (each was a test of its own, issue 69: the suite's time)."""
    slow = tmp_path / "slow_exit"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_EXIT_SITECUSTOMIZE)
    node_env = {1: {"PYTHONPATH": str(slow), "SLOW_EXIT_S": "3"}}
    before = set(swarm_server_pids())
    nodes = run_nodes(eval_args(tiny_model, inputs, tmp_path / "out", "--backend", "petals"), tmp_path, timeout=120,
                      node_env=node_env)
    assert [code for code, _ in nodes] == [2, 2], "\n---\n".join(text[-3000:] for _, text in nodes)
    lines = [line for _, text in nodes for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dist_eval: error:"), lines[:40]  # said once, by rank 0
    assert "--initial-peers" in lines[0] and "launch/start_server.sh" in lines[0], lines[0]
    assert set(swarm_server_pids()) <= before  # no server was started
    assert not (tmp_path / "out" / "metrics.json").exists()


# --------------------------------------------------------------------------- a two-host swarm


def fake_slurm_env(bin_dir, tmp_path):
    """launch/slurm.sbatch's environment under the stand-in srun/scontrol (in ``bin_dir``): a job of
    two nodes, both this host (127.0.0.1, localhost), 2 CPUs a task; each node its own HF_HOME."""
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SLURM_LOG": str(tmp_path / "srun.log"),
        "FAKE_HF_HOME": str(tmp_path / "hf_home"),  # + the node's id
        "SLURM_JOB_NODELIST": "127.0.0.1,localhost",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_CPUS_PER_TASK": "2",
        "SLURM_SUBMIT_DIR": REPO,
        "MASTER_PORT": str(free_port()),
        "LOCAL_ADDR": "127.0.0.1",
        "RDZV_TIMEOUT": "120",
    }


@pytest.fixture(scope="module")
def two_hosts(tiny_model, inputs, tmp_path_factory):
    """Host A starts a swarm serving blocks 0:2 (launch/start_server.sh), host B joins it by multiaddr
    and serves 2:4 (so every forward crosses both); one node (launch/run_local.sh, one rank) evaluates
    against it entering at A, then a 2-node job (launch/slurm.sbatch under a stand-in srun/scontrol,
    INITIAL_PEERS B: two run_multinode.sh nodes, c10d rendezvous) given the model as a hub id
    (``--model org/name``, a fake hub on 127.0.0.1), each node its own HF_HOME; then the hosts are
    stopped (SIGTERM, B first). What each step gave, for the two tests that read it (issue 69: the
    SLURM script's 2-node run was a launch of its own, with the local backend; one launch now)."""
    tmp_path = tmp_path_factory.mktemp("two_hosts")
    repo_id = "tiny-org/tiny-llama"
    prefix = f"multinode-{uuid.uuid4().hex[:8]}"
    hosts, servers, peers, logs = [], [], {}, []
    began, took, got = time.monotonic(), {}, {"tmp_path": tmp_path, "prefix": prefix}
    try:
        for name, blocks, join in (("A", "0:2", None), ("B", "2:4", "A")):
            env = {**ENV, "MODEL_DIR": tiny_model, "DHT_PREFIX": prefix, "BLOCKS": blocks, "HOST": "127.0.0.1"}
            if join:
                env["INITIAL_PEERS"] = peers[join]
            logs.append(open(tmp_path / f"host{name}.log", "w"))
            host = start_in_own_group(["bash", os.path.join(LAUNCH, "start_server.sh")], env, stderr=logs[-1])
            hosts.append(host)
            line = read_stdout_line(host, timeout=150)
            assert line.startswith("INITIAL_PEERS="), (
                line,
                host.poll(),
                (tmp_path / f"host{name}.log").read_text()[-3000:],
            )
            peers[name] = line.strip().split("=", 1)[1]
            assert MADDR.match(peers[name]), peers[name]
            servers += children_running_server(host.pid)
            took[f"host {name} up"] = time.monotonic() - began
        got.update(peers=dict(peers), servers=list(servers))
        got["host logs"] = {name: (tmp_path / f"host{name}.log").read_text() for name in peers}

        # the single-node run enters the swarm at host A, the two nodes at host B: any server will do
        swarm = ["--backend", "petals", "--dht-prefix", prefix, "--swarm-timeout", "30"]
        got["one node"] = run_script(
            "run_local.sh",
            eval_args(tiny_model, inputs, tmp_path / "one", *swarm, "--initial-peers", peers["A"]),
            env={"NPROC": "1"},
        )
        took["1 node run"] = time.monotonic() - began
        with fake_hub({repo_id: split_into_shards(tiny_model, str(tmp_path / "sharded"))}) as hub:
            env = {**fake_slurm_env(tmp_path / "bin", tmp_path), "INITIAL_PEERS": peers["B"], "DHT_PREFIX": prefix,
                   "HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0"}
            got["two nodes"] = run_script("slurm.sbatch", eval_args(repo_id, inputs, tmp_path / "two",
                                                                    "--swarm-timeout", "30"), env=env)
            got["fetched"] = hub.files("GET")
        took["2 nodes run"] = time.monotonic() - began
    finally:
        for host in reversed(hosts):  # B, then A: as hosts leave a swarm
            if host.poll() is None:
                os.killpg(host.pid, signal.SIGTERM)
            try:
                host.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            stop_group(host.pid)
            host.wait()
        for log in logs:
            log.close()
        took["hosts stopped"] = time.monotonic() - began
        print("elapsed: " + ", ".join(f"{k} {v:.1f} s" for k, v in took.items()))
    got["host codes"] = [h.returncode for h in hosts]
    got["left"] = (live_in_groups(servers), set(servers) & set(swarm_server_pids()))
    got["ports free"] = {p: port_is_free(int(MADDR.match(p).group(1))) for p in peers.values()}
    return got


@pytest.mark.swarm
@pytest.mark.multiproc
def test_slurm_batch_script_on_one_host(two_hosts, local_reference):
    """launch/slurm.sbatch under a stand-in srun/scontrol: the head node comes from the node list, one
    torchrun per node (two run_multinode.sh nodes, c10d rendezvous, 1 rank each), the job's INITIAL_PEERS
    and DHT_PREFIX its swarm flags; the result equals the single-process local run, row for row (the
    two-host swarm's 2-node run: :func:`two_hosts`)."""
    proc, tmp_path = two_hosts["two nodes"], two_hosts["tmp_path"]
    assert_ok(proc.returncode, proc.stdout + proc.stderr)
    srun_args = (tmp_path / "srun.log").read_text()
    assert srun_args.startswith("--nodes=2 --ntasks-per-node=1 --cpus-per-task=2 "), srun_args  # the job's CPUs
    assert "run_multinode.sh" in srun_args, srun_args
    assert (f"run_multinode.sh --backend petals --initial-peers {two_hosts['peers']['B']} "
            f"--dht-prefix {two_hosts['prefix']} --model ") in srun_args, srun_args
    predictions, metrics, run = outputs(tmp_path / "two")
    assert run["world_size"] == 2  # both nodes joined the one process group
    assert predictions.count("\n") == 41
    assert (predictions, metrics) == local_reference[:2]


@pytest.mark.swarm
@pytest.mark.multiproc
def test_two_hosts_swarm_and_two_nodes_equal_one_node(two_hosts, local_reference):
    """Host A serves blocks 0:2, host B joins it by multiaddr and serves 2:4 (so every forward
    crosses both); one node entering at A and 2 nodes entering at B (launch/slurm.sbatch's job: the
    SLURM test) evaluate against it and match exactly, and the local backend too (bitwise logits);
    both hosts stop cleanly on SIGTERM, leaving no server and their ports free.

    The two nodes are given the model as a hub id (``--model org/name``, a fake hub on 127.0.0.1)
    and share no HF_HOME: rank 0 resolves the id, the other node fetches the same snapshot into
    its own cache; no blocks-only shard is fetched (a test of its own before, on conftest's
    tiny_swarm: the same two-node launch once, issue 69)."""
    peers, servers, tmp_path = two_hosts["peers"], two_hosts["servers"], two_hosts["tmp_path"]
    assert peers["A"] != peers["B"] and len(servers) == 2, (peers, servers)
    assert "blocks 0:2 (of 4)" in two_hosts["host logs"]["A"]  # so every forward crosses both
    assert "blocks 2:4 (of 4)" in two_hosts["host logs"]["B"]
    assert f"joined to the swarm at {peers['A']}" in two_hosts["host logs"]["B"]
    assert_ok(two_hosts["one node"].returncode, two_hosts["one node"].stderr)
    two_nodes = two_hosts["two nodes"]
    assert_ok(two_nodes.returncode, two_nodes.stdout + two_nodes.stderr)
    fetched = two_hosts["fetched"]
    assert not [f for f in fetched if f.startswith("model-blocks-")], fetched
    for node in (0, 1):  # each node's own cache holds the client's files
        home = tmp_path / f"hf_home{node}"
        assert list(home.glob("hub/models--tiny-org--tiny-llama/snapshots/*/config.json")), home

    one, two = outputs(tmp_path / "one"), outputs(tmp_path / "two")
    assert one[2]["world_size"] == 1 and two[2]["world_size"] == 2 and two[2]["backend"] == "petals"
    assert two[0].count("\n") == 41
    assert two[:2] == one[:2]  # predictions (with logits) and every metric
    assert two[0] == local_reference[0]  # the swarm computes what the model computes in-process

    assert two_hosts["host codes"] == [0, 0]  # stopped cleanly on SIGTERM
    live, listed = two_hosts["left"]
    assert not live, "server processes left behind"
    assert not listed
    assert all(two_hosts["ports free"].values()), two_hosts["ports free"]
