"""Ranks forked from a process that has imported them already (tests/rank_zygote.py): a launch of
N real rank processes in a real gloo group, running ``python -m dist_eval`` as torchrun would,
without the ~4 s of imports each rank and the ~2 s of the torchrun launcher itself spend on
this 2-core machine (benchmarks/RESULTS.md, the suite's time: most of its CPU was process starts).

For the tests whose point is what N ranks compute or how every rank fails (N=2 == N=1 bit for
bit, one error line, exit code 2 on every rank), not the launch itself: torchrun's own behaviour
(its signals, its summary, several nodes, a rank's siblings as torchrun's children) is tested
under torchrun (tests/test_launch.py, tests/test_swarm_failover.py, test_cli's outputs test, ...).
What differs from torchrun, and why it does not matter to those tests:

- rank 0 hosts the group's store (TORCHELASTIC_USE_AGENT_STORE=False), not the agent;
- a rank's /proc/PID/environ is the fork server's (the environment a process was exec'd with),
  so a rank cannot see its siblings' RANK there (dist_eval.ranks.siblings: who reports rank 0's
  death; tested under torchrun);
- the exit codes come from the launcher, not from torchrun's ChildFailedError summary
  (``CompletedProcess.rank_codes``); as torchrun does, the launcher stops the other ranks with
  SIGTERM once one failed (so a rank's code may be -15).

A launch whose environment differs from the fork server's in what a library reads when it is
imported (HF_HOME, HF_HUB_OFFLINE, ...) cannot be served by it: :func:`run_ranks` then runs torchrun.
"""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Dict, List, Optional

from process_leaks import alive

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# what a launch may set differently from the fork server: read by dist_eval when it runs, not when
# a module is imported (the PYTHONPATH: only entries put before the server's, e.g. a hidden matplotlib)
# KMP_*: set by scikit-learn's import in the test process (KMP_DUPLICATE_LIB_OK, KMP_INIT_AT_FORK), read by
# Intel's OpenMP runtime, which nothing here loads (torch and scikit-learn ship GNU's libgomp)
_CALL_TIME_PREFIXES = ("DIST_EVAL_", "KMP_")
_IGNORED = {"PYTEST_CURRENT_TEST", "PYTHONPATH",
            # set in the test process by a CLI run in it (backends.compat.quiet_third_party_output, which
            # a rank runs too, and which applies the two datasets reads at import to a datasets imported
            # already); tokenizers reads its variable when it decides on threads
            "TOKENIZERS_PARALLELISM", "HF_DATASETS_DISABLE_PROGRESS_BARS", "DATASETS_VERBOSITY",
            # set by torch._inductor's import in the test process (test_docs' snippets) to the default it
            # computes when unset: no rank compiles
            "TORCHINDUCTOR_CACHE_DIR"}


class RankZygote:
    """The fork server of one test process (a session fixture's: tests/conftest.py ``rank_zygote``)."""

    def __init__(self, env: Dict[str, str], folder: str):
        self.env = dict(env)
        self.socket_path = os.path.join(folder, "zygote.sock")
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "rank_zygote.py"), self.socket_path],
                                     cwd=REPO, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     start_new_session=True)
        line = self.proc.stdout.readline()
        if line.strip() != b"READY":
            self.stop()
            raise RuntimeError(f"the ranks' fork server did not start (exit code {self.proc.poll()})")

    def serves(self, env: Dict[str, str]) -> bool:
        """Whether a launch with ``env`` can be forked from this server (else: torchrun)."""
        keys = (set(env) | set(self.env)) - _IGNORED
        differ = [k for k in keys if env.get(k) != self.env.get(k) and not k.startswith(_CALL_TIME_PREFIXES)]
        if self._path_prefix(env) is None:
            differ.append("PYTHONPATH")
        if differ and os.environ.get("DIST_EVAL_TEST_FORK_LOG"):  # for whoever measures the suite: why not forked
            with open(os.environ["DIST_EVAL_TEST_FORK_LOG"], "a") as f:
                f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST"),
                                    "differ": {k: [env.get(k), self.env.get(k)] for k in sorted(differ)}}) + "\n")
        return not differ

    def _path_prefix(self, env) -> Optional[List[str]]:
        mine = [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        theirs = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if theirs[len(theirs) - len(mine):] != mine:
            return None
        return theirs[:len(theirs) - len(mine)]

    def request(self, argv: List[str], nproc: int, env: Dict[str, str], master_port: int, preload=()) -> dict:
        request = {"argv": list(argv), "nproc": nproc, "env": dict(env), "cwd": REPO, "master_port": master_port,
                   "path_prefix": self._path_prefix(env), "preload": list(preload), "run_id": uuid.uuid4().hex}
        return request

    def start(self, request: dict, stdout: int, stderr: int) -> ForkedLaunch:
        """The launch of ``request`` (:meth:`request`), its ranks writing to the descriptors given."""
        return ForkedLaunch(self.socket_path, request, stdout, stderr)

    def launch(self, argv: List[str], nproc: int, env: Dict[str, str], master_port: int,
               timeout: float, preload=()) -> subprocess.CompletedProcess:
        """``argv`` (``["-m", "dist_eval", ...]`` or a script and its arguments) on ``nproc`` forked
        ranks, to its end; a CompletedProcess whose stdout/stderr are every rank's (as torchrun's are),
        whose returncode is 0 when every rank's is (else 1, torchrun's), with ``rank_codes``."""
        request = self.request(argv, nproc, env, master_port, preload)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            launch = self.start(request, out.fileno(), err.fileno())
            try:
                launch.wait(timeout)
            except subprocess.TimeoutExpired:
                raise subprocess.TimeoutExpired(launch.args, timeout, output=_read(out), stderr=_read(err)) from None
            finally:
                launch.stop()  # nothing of the run may outlive it (a rank's helpers, its swarm)
            result = subprocess.CompletedProcess(launch.args, launch.returncode, _read(out), _read(err))
        result.rank_codes = launch.rank_codes
        return result

    def stop(self) -> None:
        from conftest import stop_group

        stop_group(self.proc.pid, grace=5.0)
        self.proc.wait(timeout=30)
        if self.proc.stdout:
            self.proc.stdout.close()


class ForkedLaunch:
    """One launch of forked ranks, as a ``subprocess.Popen`` of torchrun is used: ``pid`` (the
    launcher's, which leads the process group of the ranks and their helpers, as torchrun started
    in a session of its own), ``poll()``, ``wait(timeout)``, ``returncode`` (0 when every rank's is 0,
    else 1, as torchrun's; a plain process's own, nproc 0); and ``pids`` (the ranks', in rank order),
    ``rank_codes``."""

    def __init__(self, socket_path: str, request: dict, stdout: int, stderr: int):
        self.args = ["forked ranks:", *request["argv"]]
        self._plain = request["nproc"] == 0  # one process without torchrun's environment: its own exit code
        self.rank_codes: Optional[List[int]] = None
        self.returncode: Optional[int] = None
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(socket_path)
            socket.send_fds(self._conn, [(json.dumps(request) + "\n").encode()], [stdout, stderr])
            self._reader = self._conn.makefile("rb")
            self._conn.settimeout(60)
            started = json.loads(self._reader.readline())
        except BaseException:
            self._conn.close()
            raise
        self.pids: List[int] = started["pids"]
        self.pid: int = started["group"]

    def poll(self) -> Optional[int]:
        """The returncode once the launcher answered (-1: it was stopped first), else None."""
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_codes(None)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self._read_codes(timeout)
        return self.returncode

    def _read_codes(self, timeout: Optional[float]) -> None:
        self._conn.settimeout(timeout)
        try:
            line = self._reader.readline()
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout) from None
        if not line:  # the launcher was stopped (its group signalled) before it could answer
            self.returncode = -1
        else:
            self.rank_codes = json.loads(line)["codes"]
            if self._plain:
                self.returncode = self.rank_codes[0]
            else:
                self.returncode = 0 if all(code == 0 for code in self.rank_codes) else 1
        self._conn.close()

    def stop(self) -> None:
        """The launch's process group (the ranks and their helpers), as conftest's run_in_own_group
        stops a torchrun's; the ranks gone (and reaped by the launcher)."""
        from conftest import stop_group

        stop_group(self.pid, grace=5.0)
        end = time.monotonic() + 5.0
        while any(alive(pid) for pid in self.pids) and time.monotonic() < end:
            time.sleep(0.05)
        if self.returncode is None:
            try:
                self.wait(timeout=35.0)  # the launcher's answer once its ranks are gone (SIGKILL 30 s on)
            except (subprocess.TimeoutExpired, OSError):
                pass
        self._conn.close()


def _read(f) -> str:
    f.seek(0)
    return f.read().decode("utf-8", "replace")

