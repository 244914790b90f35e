"""A real SLURM cluster on this host, for tests and benchmarks: munged, slurmctld and two
slurmd "nodes" (n1, n2: ``slurmd -N``, each its own port), all state under one folder.

    with SlurmCluster(folder) as cluster:
        job = cluster.sbatch(["--nodes=2", "launch/slurm.sbatch", "--backend", "local", ...])
        cluster.wait(job)       # -> (state, exit code), e.g. ("COMPLETED", 0)

The daemons run as the user who starts them (``SlurmUser`` and ``SlurmdUser``: root, or an ordinary
user where SLURM was installed by someone else), every file in ``folder``, which that user owns.
Debian's ``slurm-wlm`` and ``munge`` are installed (``apt-get install``, as root) where a daemon is
missing; an install that fails raises, naming what failed. :func:`why_not_here` says why a cluster
cannot run here (SLURM missing, and this user may not install it): the suite deselects the ``slurm``
tests then (``tests/suite_plugin.py``). Every daemon is started by this process and stopped at exit
(SIGTERM, then SIGKILL), with the job steps' ``slurmstepd`` left by them. Process tracking and
confinement: ``proctrack/linuxproc`` and ``task/affinity`` (each task bound to the CPUs it was given),
which work in a container; ``task/cgroup`` needs a cgroup hierarchy slurmd may own.
"""
from __future__ import annotations

import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from typing import Dict, List, Optional, Tuple

# where the daemons are looked for beside PATH (an ordinary user's PATH may hold no sbin): Debian's, a
# source build's
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")
# what a cluster runs: the daemons, and the commands that the tests and the launch scripts call
NEEDED = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
NODES = ("n1", "n2")
CPUS_PER_NODE = 2


def _search_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), *SBIN_DIRS])


def _program(name: str) -> Optional[str]:
    return shutil.which(name, path=_search_path())


def _missing() -> List[str]:
    return [name for name in NEEDED if _program(name) is None]


def _user() -> str:
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def why_not_here() -> Optional[str]:
    """Why no cluster can run on this host for this user, or None: SLURM is installed (by anyone: the
    daemons run as this user), or this user is root with apt-get (:func:`ensure_installed` installs it)."""
    missing = _missing()
    if not missing or (os.geteuid() == 0 and _program("apt-get")):
        return None
    return (f"SLURM is not installed here ({', '.join(missing)} not found; searched {', '.join(['PATH', *SBIN_DIRS])}) "
            f"and this user ({_user()}, uid {os.geteuid()}) cannot install it (they run where it is installed, "
            "or as root with apt-get: apt-get install slurm-wlm munge)")


def ensure_installed() -> None:
    """slurm-wlm and munge from Debian's archive where a program of theirs is missing (as root)."""
    if not _missing():
        return
    why = why_not_here()
    if why:
        raise RuntimeError(why)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "slurm-wlm", "munge"]):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {out.returncode}); the SLURM tests need Debian's "
                               f"slurm-wlm and munge:\n{(out.stdout + out.stderr)[-2000:]}")


def _free_ports(count: int) -> List[int]:
    """``count`` distinct free ports for the daemons, below the kernel's ephemeral range (conftest.free_port): a port
    the OS gave here (a bind to port 0) and let go could be given meanwhile to another process of the suite (a p2pd
    listening on port 0) before the daemon bound it.
    """
    from conftest import free_port

    ports: List[int] = []
    while len(ports) < count:
        port = free_port()
        ports += [] if port in ports else [port]
    return ports


def _conf(folder: str, ctld_port: int, node_ports: List[int], munge_socket: str) -> str:
    # job ids (so the rendezvous ports taken from them) that another cluster on this host is unlikely to use
    first_job_id = 1000 + random.randrange(8000)
    nodes = "\n".join(f"NodeName={name} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 Port={port} "
                      f"CPUs={CPUS_PER_NODE} RealMemory=2000 State=UNKNOWN" for name, port in zip(NODES, node_ports))
    return f"""ClusterName=dist-eval-test
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser={_user()}
SlurmdUser={_user()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=5
MinJobAge=600
FirstJobId={first_job_id}
MessageTimeout=20
{nodes}
PartitionName=test Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """munged + slurmctld + slurmd n1, n2 on this host; ``env`` is what SLURM's commands need."""

    def __init__(self, folder: str):
        self.folder = folder
        self.daemons: Dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": os.path.join(folder, "slurm.conf")}

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        ensure_installed()
        f = self.folder
        for sub in ("state", "spool/n1", "spool/n2", "munge"):
            os.makedirs(os.path.join(f, sub), exist_ok=True)
        key, sock = os.path.join(f, "munge", "munge.key"), os.path.join(f, "munge", "munge.sock")
        with open(key, "wb") as out:
            out.write(os.urandom(1024))
        os.chmod(key, 0o400)
        os.chmod(os.path.join(f, "munge"), 0o700)
        ctld, *nodes = _free_ports(1 + len(NODES))
        with open(self.env["SLURM_CONF"], "w") as out:
            out.write(_conf(f, ctld, nodes, sock))
        self._daemon("munged", [_program("munged"), "-F", "--force", f"--key-file={key}", f"--socket={sock}",
                                f"--pid-file={f}/munge/munged.pid", f"--log-file={f}/munge/munged.log",
                                f"--seed-file={f}/munge/munged.seed"])
        self._wait_for(lambda: os.path.exists(sock), timeout, "munged's socket")
        self._daemon("slurmctld", [_program("slurmctld"), "-D", "-i"])
        for name in NODES:
            self._daemon(f"slurmd {name}", [_program("slurmd"), "-D", "-N", name])
        self._wait_for(self._nodes_idle, timeout, "both nodes idle (sinfo)")

    def _daemon(self, name: str, cmd: List[str]) -> None:
        log = open(os.path.join(self.folder, f"{name.replace(' ', '-')}.out"), "w")
        self.daemons[name] = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not ready():
            dead = [name for name, p in self.daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > end:
                raise RuntimeError(f"SLURM test cluster: no {what} after {timeout:.0f} s "
                                   f"({'exited: ' + ', '.join(dead) if dead else 'timed out'}); {self.logs()}")
            time.sleep(0.2)

    def _nodes_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
        return all(states.get(name) == "idle" for name in NODES)

    def logs(self, tail: int = 1500) -> str:
        texts = []
        for name in sorted(os.listdir(self.folder)):
            if name.endswith((".log", ".out")) and not name.startswith("job-"):
                with open(os.path.join(self.folder, name), errors="replace") as f:
                    texts.append(f"--- {name}\n{f.read()[-tail:]}")
        return "\n".join(texts)

    def run(self, cmd: List[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}: {out.stderr.strip()}")
        return out

    def sbatch(self, args: List[str], cwd: str, env: Optional[Dict[str, str]] = None) -> int:
        """Submit; the job's output goes to FOLDER/job-ID.out (``output(job)``)."""
        cmd = ["sbatch", "--parsable", f"--output={self.folder}/job-%j.out", f"--chdir={cwd}", *args]
        out = subprocess.run(cmd, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=30,
                             cwd=cwd)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch failed (exit {out.returncode}): {out.stderr.strip()}")
        return int(out.stdout.strip().split(";")[0])

    def output(self, job: int) -> str:
        path = os.path.join(self.folder, f"job-{job}.out")
        return open(path, errors="replace").read() if os.path.exists(path) else ""

    def job(self, job: int) -> Dict[str, str]:
        text = self.run(["scontrol", "show", "job", "-o", str(job)]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job: int, timeout: float = 120) -> Tuple[str, int]:
        """(state, exit code) once the job has ended."""
        end = time.monotonic() + timeout
        while True:
            info = self.job(job)
            if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return info["JobState"], int(info.get("ExitCode", "0:0").split(":")[0])
            if time.monotonic() > end:
                raise TimeoutError(f"job {job} still {info.get('JobState')} after {timeout:.0f} s:\n"
                                   f"{self.output(job)[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancel every job, then stop every daemon this object started, and the step daemons
        (slurmstepd) of its slurmd, found by the SLURM_CONF they inherited."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--partition=test"], check=False)
        for name in [n for n in self.daemons if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            self._stop(self.daemons.get(name))
        for pid in self._own_step_daemons():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _stop(self, proc: Optional[subprocess.Popen], grace: float = 10.0) -> None:
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def _own_step_daemons(self) -> List[int]:
        needle = f"SLURM_CONF={self.env['SLURM_CONF']}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if not f.read().startswith(b"slurmstepd"):
                        continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
        return found
