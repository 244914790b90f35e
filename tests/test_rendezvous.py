"""The rendezvous port of a multi-node run, from the run's id (dist_eval/rendezvous.py), and
the launch scripts that use it: two runs with different ids, or two SLURM jobs, never share one."""
import os
import socket
import subprocess
import sys

from conftest import REPO

from dist_eval.rendezvous import PORT_BASE, PORT_SPAN, first_free_port, main, port_for, port_is_free


def test_a_job_id_gives_its_own_port_and_every_node_the_same():
    assert port_for("4242") == port_for(" 4242\n") == PORT_BASE + 4242
    ports = [port_for(str(job)) for job in range(1000, 1000 + PORT_SPAN)]
    assert len(set(ports)) == PORT_SPAN  # consecutive jobs: distinct ports, all in the range
    assert min(ports) == PORT_BASE and max(ports) == PORT_BASE + PORT_SPAN - 1
    assert max(ports) < 32768  # below Linux's ephemeral ports


def test_names_give_different_ports_as_a_rule():
    names = [f"eval-{i}" for i in range(200)]
    ports = {port_for(name) for name in names}
    assert len(ports) >= 195  # a CRC-32 spread over 10,000 ports
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert port_for("dist_eval") == port_for("dist_eval")  # the same in every process (not Python's hash)


def test_free_moves_past_a_port_taken_on_this_host():
    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        assert not port_is_free(port)
        wrapped = first_free_port(port)
        assert wrapped != port and port_is_free(wrapped)
    finally:
        taken.close()
    start = port_for("4242")
    if port_is_free(start):
        assert first_free_port(start) == start


def test_the_command_prints_the_port(capsys):
    assert main(["4242"]) == 0 and capsys.readouterr().out == f"{PORT_BASE + 4242}\n"
    assert main([]) == 2 and "usage:" in capsys.readouterr().err
    out = subprocess.run([sys.executable, "-m", "dist_eval.rendezvous", "job-7"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": REPO}, check=True, timeout=30)
    assert out.stdout == f"{port_for('job-7')}\n"


FAKE_PYTHON_LAUNCHER = """#!/usr/bin/env bash
# stands in for the interpreter: the rendezvous port is computed for real, the launch only echoed
if [[ "$1 $2" == "-m dist_eval.rendezvous" ]]; then exec "$REAL_PYTHON" "$@"; fi
echo "OMP_NUM_THREADS=$OMP_NUM_THREADS $*"
"""


def _multinode_command(tmp_path, **env):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON_LAUNCHER)
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "OMP_NUM_THREADS", "RDZV_ID")}
    env = {**base, "PYTHON": str(fake), "REAL_PYTHON": sys.executable, "MASTER_ADDR": "127.0.0.1", **env}
    out = subprocess.run(["bash", os.path.join(REPO, "launch", "run_multinode.sh"), "--batch-size", "4"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_run_multinode_port_threads_and_launcher(tmp_path):
    """launch/run_multinode.sh: the port from RDZV_ID (MASTER_PORT overrides), the threads per
    rank from the CPUs it may use, and dist-eval's launcher (one exit code, no torchrun report)."""
    cpus = len(os.sched_getaffinity(0))
    a = _multinode_command(tmp_path, RDZV_ID="run-a", NPROC_PER_NODE="1")
    b = _multinode_command(tmp_path, RDZV_ID="run-b", NPROC_PER_NODE="1")
    assert f"--rdzv-endpoint 127.0.0.1:{port_for('run-a')} --rdzv-id run-a" in a
    assert f"--rdzv-endpoint 127.0.0.1:{port_for('run-b')} " in b and port_for("run-a") != port_for("run-b")
    assert a.startswith(f"OMP_NUM_THREADS={cpus} -m dist_eval.launcher --nnodes 2")
    assert a.endswith("-- --batch-size 4")
    many = _multinode_command(tmp_path, NPROC_PER_NODE=str(cpus * 2), MASTER_PORT="29999")
    assert many.startswith("OMP_NUM_THREADS=1 ") and "127.0.0.1:29999 --rdzv-id dist_eval " in many
    kept = _multinode_command(tmp_path, OMP_NUM_THREADS="3")
    assert kept.startswith("OMP_NUM_THREADS=3 ")


ECHO_SRUN = """#!/usr/bin/env bash
echo "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT RDZV_ID=$RDZV_ID srun $*"
"""
ECHO_SCONTROL = """#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") tr ',' '\\n' <<< "$3" ;;
  "show node") echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.1.2.3 NodeHostName=$3" ;;
esac
"""


def _sbatch_step(tmp_path, **env):
    """launch/slurm.sbatch's batch step with a stand-in scontrol and an srun that only prints."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", ECHO_SRUN), ("scontrol", ECHO_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RDZV_ID", "NPROC_PER_NODE")}
    env = {**base, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable,
           "SLURM_JOB_NODELIST": "node7,node8", "SLURM_JOB_NUM_NODES": "2", "SLURM_SUBMIT_DIR": REPO, **env}
    out = subprocess.run(["bash", os.path.join(REPO, "launch", "slurm.sbatch"), "--backend", "local"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), out.stderr.strip()


def test_slurm_batch_step_port_address_and_cpus(tmp_path):
    """The port from the job id (free on the first node), its NodeAddr, the job's CPUs passed
    on to srun, and one line when the ranks outnumber them."""
    job = "7001"
    while not port_is_free(port_for(job)):  # a job id whose port is free here, for an exact check
        job = str(int(job) + 1)
    out, err = _sbatch_step(tmp_path, SLURM_JOB_ID=job, SLURM_CPUS_PER_TASK="2")
    assert out.startswith(f"MASTER_ADDR=10.1.2.3 MASTER_PORT={port_for(job)} RDZV_ID={job} srun --nodes=2 "
                          "--ntasks-per-node=1 --cpus-per-task=2 --kill-on-bad-exit=1 "), out
    assert err == ""
    taken = socket.socket()
    taken.bind(("", port_for(job)))
    taken.listen(1)
    try:  # another job's rendezvous on that port already: the next one
        out, _ = _sbatch_step(tmp_path, SLURM_JOB_ID=job, SLURM_CPUS_PER_TASK="2")
        assert f"MASTER_PORT={first_free_port(port_for(job))} " in out and f"MASTER_PORT={port_for(job)} " not in out
    finally:
        taken.close()
    out, err = _sbatch_step(tmp_path, SLURM_JOB_ID=job, SLURM_CPUS_PER_TASK="2", NPROC_PER_NODE="4",
                            MASTER_PORT="29999")
    assert "MASTER_PORT=29999 " in out and "--cpus-per-task=2 " in out
    assert err == ("slurm.sbatch: warning: 4 ranks a node share 2 CPU(s): submit with --cpus-per-task=4 "
                   "for a core per rank")
