"""launch/slurm.sbatch under a real SLURM (Debian's slurm-wlm, installed where missing):
munged, slurmctld and two slurmd nodes on this host (tests/slurm_cluster.py), one cluster for
the module, every daemon stopped at its end.

2-node jobs equal one process bit for bit; two jobs on one node at once (each its own
rendezvous port, from its job id); a usage error ends every job with dist_eval's exit code 2
and its one line; ``scancel`` mid-run against a real swarm leaves no process within 5 s and no
warning about a healthy server. The ranks' threads follow the CPUs the job was given. Issue 53:
an array of 3 shards (launch/slurm_array.sbatch), one requeued, then launch/slurm_merge.sbatch
after it: one rank's report. The jobs write no figures (matplotlib hidden).

Where SLURM is missing and this user may not install it (not root), those tests are deselected with
one summary line saying why, never an error nor a pass; where someone else installed it, the
cluster runs as this user.
"""
from __future__ import annotations

import os
import pwd
import re
import subprocess
import sys
import time

import pytest
import slurm_cluster
from conftest import REPO, build_checkpoint, eval_args, outputs, write_csv
from inprocess_cli import run_cli_in_process, without_modules
from slurm_cluster import SlurmCluster

from dist_eval.output.shard_files import read_manifest
from dist_eval.rendezvous import port_for

# scancel to the last process of the job gone (srun's included): 1-3 s on a quiet machine; srun itself took
# over 5 s once at load 12 (an ordinary user's run beside two busy loops and two other suites). What the bound
# guards is a rank that does not stop: one waiting out the run's --swarm-timeout (30 s) would pass 25 s
STOPPED_WITHIN_S = 25.0
SBATCH = os.path.join(REPO, "launch", "slurm.sbatch")
ARRAY, MERGE = (os.path.join(REPO, "launch", name) for name in ("slurm_array.sbatch", "slurm_merge.sbatch"))
# what a job inherits from sbatch (--export=ALL): no OMP_NUM_THREADS, so that the script sets it
JOB_ENV = {"PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "LOCAL_ADDR": "127.0.0.1", "OMP_NUM_THREADS": ""}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The module's cluster; its jobs write no figures (matplotlib hidden: the same function of
    the same metrics, and the most of a small run's CPU after its imports, on a machine its jobs share)."""
    folder = tmp_path_factory.mktemp("slurm")
    with SlurmCluster(str(folder)) as c:
        hidden = without_modules(folder / "hidden", "matplotlib")
        c.job_env = {"PYTHONPATH": os.pathsep.join(p for p in (hidden, os.environ.get("PYTHONPATH")) if p)}
        yield c


# each test's runs, by name, for a later test to compare with (the one-rank job: the array's merge)
FINISHED: dict = {}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slurm_inputs")
    return build_checkpoint(str(folder / "ck.pt")), write_csv(str(folder / "data.csv"), 41, seed=5)


def submit(cluster, sbatch_options, args, script=SBATCH, **env):
    job_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    job_env.update({k: v for k, v in {**JOB_ENV, **cluster.job_env, **env}.items() if v})
    return cluster.sbatch([*sbatch_options, script, *args], cwd=REPO, env=job_env)


def assert_completed(cluster, job):
    state, code = cluster.wait(job)
    text = cluster.output(job)
    assert (state, code) == ("COMPLETED", 0), f"job {job}: {state} {code}\n{text[-3000:]}"
    assert "Traceback" not in text, text[-3000:]


def on_the_cluster(test):
    """A test of jobs on the module's cluster: it starts SLURM (``slurm``: deselected where SLURM cannot run
    here) and its jobs torchrun (``multiproc``)."""
    return pytest.mark.multiproc(pytest.mark.slurm(test))


@on_the_cluster
def test_a_two_node_job_and_a_one_rank_job_share_a_node(cluster, tiny_model, inputs, tmp_path):
    """A 2-node job (n1, n2) and a 1-rank job on n1 at once: two rendezvous on n1, each on its
    job's own port (a fixed one made the second fail: EADDRINUSE); the 2-node job == the one
    rank, bit for bit."""
    args = ("--backend", "local")
    one_cpu = ["--cpus-per-task=1"]
    two = submit(cluster, ["--nodes=2", *one_cpu], eval_args(tiny_model, inputs, tmp_path / "two", *args))
    one = submit(cluster, ["--nodes=1", "--nodelist=n1", *one_cpu],
                 eval_args(tiny_model, inputs, tmp_path / "one", *args))
    together, end = False, time.monotonic() + 120
    while time.monotonic() < end and not together:
        states = [cluster.job(job)["JobState"] for job in (two, one)]
        together = states == ["RUNNING", "RUNNING"]
        if any(s in ("COMPLETED", "FAILED", "CANCELLED") for s in states):
            break
        time.sleep(0.1)
    for job in (two, one):
        assert_completed(cluster, job)
    assert together, "the two jobs did not run at the same time"
    assert cluster.job(two)["NodeList"] == "n[1-2]" and cluster.job(one)["NodeList"] == "n1"
    assert port_for(str(two)) != port_for(str(one))
    reference, result = outputs(tmp_path / "one"), outputs(tmp_path / "two")
    assert reference[2]["world_size"] == 1 and result[2]["world_size"] == 2
    assert result[:2] == reference[:2]  # predictions with logits, and every metric
    FINISHED["one rank"] = tmp_path / "one"


@on_the_cluster
def test_a_usage_error_is_exit_2_and_one_line_every_time(cluster, tiny_model, inputs, tmp_path):
    """On 2 nodes, twice at once: exit code 2 (not torchrun's 1, not 143 from srun's
    --kill-on-bad-exit), the one error line, no torchrun ChildFailedError report."""
    args = eval_args(tiny_model, inputs, tmp_path / "out", "--backend", "local", "--batch-size", "0")
    jobs = [submit(cluster, ["--nodes=2", "--cpus-per-task=1"], args) for _ in range(2)]
    for job in jobs:
        state, code = cluster.wait(job)
        text = cluster.output(job)
        assert (state, code) == ("FAILED", 2), f"job {job}: {state} {code}\n{text[-3000:]}"
        # SLURM's own lines (srun: error: n2: task 1: Exited with exit code 2, slurmstepd-n1: ... CANCELLED) aside
        ours = [line for line in text.splitlines() if line.strip() and not line.startswith(("srun:", "slurmstepd"))]
        assert ours == ["dist_eval: error: --batch-size 0: expected a positive integer."], text[-3000:]
    assert not (tmp_path / "out" / "metrics.json").exists()


def _job_processes(cluster, job):
    """Live processes (not zombies) of SLURM job ``job`` of ``cluster`` on this host: those whose
    environment says SLURM_JOB_ID=job and this cluster's SLURM_CONF (another may run here too)."""
    needles = {f"SLURM_JOB_ID={job}".encode(), f"SLURM_CONF={cluster.env['SLURM_CONF']}".encode()}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if not needles <= set(f.read().split(b"\0")):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rpartition(b")")[2].split()[0] == b"Z":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found.append((int(entry), f.read().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:
            continue
    return found


def _ranks(cluster, job):
    """{pid: (OMP_NUM_THREADS, the CPUs it may run on)} of the job's dist_eval ranks."""
    ranks, commands = {}, dict(_job_processes(cluster, job))
    for pid, cmd in commands.items():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                parent = int(f.read().rpartition(b")")[2].split()[1])
            if "-m dist_eval " not in cmd or "dist_eval.launcher" not in commands.get(parent, ""):
                continue  # not a rank (torchrun's launcher, a rank's helper processes)
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            ranks[pid] = (env.get(b"OMP_NUM_THREADS", b"").decode(), len(os.sched_getaffinity(pid)))
        except (FileNotFoundError, ProcessLookupError):
            # ended since the listing (a short-lived helper of a rank: seen in a loaded run, 4 pytest workers);
            # the caller lists the job's processes again
            continue
    return ranks


@on_the_cluster
@pytest.mark.swarm
def test_scancel_mid_run_on_a_swarm(cluster, tiny_swarm, tiny_model, tmp_path):
    """2 nodes x 2 ranks against a real swarm: each rank 1 thread of the node's 2 CPUs;
    scancel mid-run leaves no process of the job within seconds and no warning about a server."""
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"))
    data = write_csv(str(tmp_path / "big.csv"), 4000, seed=9)
    args = ["--model", tiny_model, "--checkpoint", checkpoint, "--data-files", data, "--batch-size", "4",
            "--output-dir", str(tmp_path / "out"), "--progress", "log", "--swarm-timeout", "30"]
    job = submit(cluster, ["--nodes=2"], args, NPROC_PER_NODE="2", INITIAL_PEERS=" ".join(tiny_swarm.initial_peers),
                 DHT_PREFIX=tiny_swarm.dht_prefix)
    end, ranks, mid_run = time.monotonic() + 120, {}, re.compile(r"progress [1-9]\d*/4000 ")
    while time.monotonic() < end and not mid_run.search(cluster.output(job)):
        ranks = _ranks(cluster, job) or ranks
        assert cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), cluster.output(job)[-3000:]
        time.sleep(0.2)
    assert mid_run.search(cluster.output(job)), cluster.output(job)[-3000:]  # rows done, the requests flowing
    ranks = _ranks(cluster, job) or ranks
    assert len(ranks) == 4 and set(ranks.values()) == {("1", 2)}, ranks  # 2 CPUs a node, over 2 ranks
    cluster.run(["scancel", str(job)])
    cancelled = time.monotonic()
    while _job_processes(cluster, job) and time.monotonic() < cancelled + STOPPED_WITHIN_S:
        time.sleep(0.1)
    assert not _job_processes(cluster, job), _job_processes(cluster, job)
    print(f"every process of the job gone {time.monotonic() - cancelled:.1f} s after scancel")
    state, _ = cluster.wait(job)
    text = cluster.output(job)
    assert state == "CANCELLED", text[-3000:]
    assert "failed a request" not in text and "Traceback" not in text, text[-3000:]
    assert "death signal" not in text, text[-3000:]  # torchrun's launcher logs stay quiet
    assert not (tmp_path / "out" / "metrics.json").exists()


def wait_for(cluster, job: str, state: tuple, timeout: float = 120) -> None:
    """Until ``job`` is in ``state`` (JobState, Reason; a Reason of None: any)."""
    end = time.monotonic() + timeout
    while True:
        info = cluster.job(job)
        if info.get("JobState") == state[0] and state[1] in (None, info.get("Reason")):
            return
        assert time.monotonic() < end, f"job {job} not {state} after {timeout:.0f} s: {info}"
        time.sleep(0.05)


@on_the_cluster
def test_an_array_of_shards_one_requeued_then_the_merge(cluster, tiny_model, inputs, tmp_path):
    """Issue 53: launch/slurm_array.sbatch as an array of 3 tasks (shards 0/3..2/3, from the array's
    ids 4-6), task 5 requeued once running (scontrol requeue: it runs again, into its own folder);
    launch/slurm_merge.sbatch after the array (--dependency=afterok): the merged report == one rank
    over every row, bit for bit (the first test's one-rank job of the same flags, else a run here)."""
    out = tmp_path / "shards"
    args = [a for a in eval_args(tiny_model, inputs, "-", "--backend", "local") if a not in ("--output-dir", "-")]
    array = submit(cluster, ["--array=4-6", "--cpus-per-task=1"], args, ARRAY, OUT=str(out))
    merge = submit(cluster, [f"--dependency=afterok:{array}"], [], MERGE, OUT=str(out))
    wait_for(cluster, f"{array}_5", ("RUNNING", None))
    cluster.run(["scontrol", "requeue", f"{array}_5"])
    # a requeued job waits for a begin time (about 2 minutes) unless told otherwise: told once slurmctld has set it
    # (told while the killed run was still completing, on a loaded machine, the begin time came after, and the
    # merge's wait ran out)
    wait_for(cluster, f"{array}_5", ("PENDING", "BeginTime"))
    cluster.run(["scontrol", "update", f"JobId={array}_5", "StartTime=now"])
    one = FINISHED.get("one rank")
    if one is None:  # this test alone
        one = tmp_path / "one"
        assert run_cli_in_process([*args, "--output-dir", str(one), "--progress", "none", "--quiet"]) == 0
    assert_completed(cluster, merge)
    assert cluster.job(f"{array}_5")["Restarts"] == "1"
    shards = [outputs(out / f"shard-{task}") for task in (4, 5, 6)]
    assert [run["world_size"] for _, _, run in shards] == [1, 1, 1]
    assert [read_manifest(str(out / f"shard-{task}"))["shard"] for task in (4, 5, 6)] == ["0/3", "1/3", "2/3"]
    assert outputs(out / "merged")[:2] == outputs(one)[:2]


# a session of pytest on a machine without SLURM, for any user: nothing searched but PATH (an empty folder, so
# no apt-get either); two tests of a SLURM cluster and one other, on one worker and on two (xdist)
NO_SLURM_CONFTEST = """import slurm_cluster
import suite_plugin
slurm_cluster.SBIN_DIRS = ()

def pytest_addoption(parser):
    suite_plugin.add_options(parser)

def pytest_configure(config):
    config.pluginmanager.register(suite_plugin, "dist_eval_suite_plugin")
"""
NO_SLURM_TESTS = """import pytest
import slurm_cluster

@pytest.mark.slurm
@pytest.mark.parametrize("nodes", [1, 2])
def test_a_job(tmp_path, nodes):
    with slurm_cluster.SlurmCluster(str(tmp_path)):
        pass

def test_another():
    pass
"""


@pytest.mark.parametrize("workers", ["0", "2"])
def test_where_slurm_cannot_run_its_tests_are_deselected_in_one_line(tmp_path, workers):
    """SLURM missing and not installable by this user: the slurm tests are deselected (not errors, not
    passes), and the summary says so once, with why; the other tests run."""
    tests = os.path.dirname(os.path.abspath(__file__))
    (tmp_path / "conftest.py").write_text(NO_SLURM_CONFTEST)
    (tmp_path / "test_cluster.py").write_text(NO_SLURM_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slurm: starts SLURM\n    gpu: needs CUDA\n")
    (tmp_path / "empty").mkdir()
    env = {**os.environ, "PATH": str(tmp_path / "empty"), "PYTHONPATH": os.pathsep.join([tests, REPO])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", workers, "-c",
                           str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    lines = done.stdout.splitlines()
    counted = "1 passed, 2 deselected" if workers == "0" else "1 passed"  # xdist's workers deselect, not its count
    assert done.returncode == 0 and f" {counted} in " in lines[-1], done.stdout[-3000:] + done.stderr
    said = [line for line in lines if line.startswith("dist_eval:")]
    user = f"({pwd.getpwuid(os.geteuid()).pw_name}, uid {os.geteuid()})"
    assert said == [f"dist_eval: 2 slurm test(s) deselected: SLURM is not installed here (munged, slurmctld, "
                    f"slurmd, sbatch, scontrol, scancel, sinfo not found; searched PATH) and this user {user} cannot "
                    "install it "
                    "(they run where it is installed, or as root with apt-get: apt-get install slurm-wlm munge); "
                    "none is counted as passed"], done.stdout[-3000:]


def test_a_cluster_runs_as_the_user_who_starts_it(tmp_path, monkeypatch):
    """SLURM installed by someone else (every program found) can run for any user: its daemons run as
    that user (SlurmUser, SlurmdUser), with every file in the cluster's folder; without it, only root may
    install it."""
    monkeypatch.setattr(slurm_cluster, "SBIN_DIRS", ())
    monkeypatch.setenv("PATH", str(tmp_path))
    assert slurm_cluster.why_not_here() is not None  # nothing installed, and no apt-get
    for name in slurm_cluster.NEEDED:
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    assert slurm_cluster.why_not_here() is None
    user = pwd.getpwuid(os.geteuid()).pw_name
    conf = slurm_cluster._conf(str(tmp_path), 6817, [6818, 6819], str(tmp_path / "munge.sock"))
    assert f"\nSlurmUser={user}\nSlurmdUser={user}\n" in conf
    paths = re.findall(r"=(/\S*)", conf)  # the state, spool, pid and log files, munge's socket
    assert len(paths) == 7 and all(path.startswith(f"{tmp_path}/") for path in paths), conf
