"""The watchdog: a tiny process that stops what its owner started if the owner dies first.

Used for the local swarm's servers (process groups) and for the helpers of a rank's
petals client (single processes: its DHT process and p2pd). Its owner is killed outright
(SIGKILL, the OOM killer, torchrun's SIGKILL after SIGTERM) without running any cleanup;
without the watchdog what it started would live on as orphans, holding ports and memory.
"""
from __future__ import annotations

import subprocess
import sys
from typing import Optional

# It reads commands on stdin; EOF without "done" means the owner died. "pg N": a process
# group to stop (SIGINT, SIGKILL 3 s later); "pid N START": one process, SIGKILLed at once
# (START: its start time, so that a pid reused by then is left alone); "path P": a file
# or folder to remove. It runs as `python -S -c`: no site-packages, so it starts at once and
# does not depend on how dist_eval is installed; it imports nothing of dist_eval, which is why
# its lookup of the hivemind sockets that its processes hold repeats procs.unix_socket_paths. SIGTERM, SIGINT and
# SIGHUP are ignored: a sweep that kills its owner and it at once (pkill -f of the venv's python) left the servers
# it guards running; it ends when its owner does (EOF), on "done", or by SIGKILL.
_WATCHDOG = r"""
import os, shutil, signal, sys, time
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
groups, pids, paths = set(), {}, set()
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "pg":
        groups.add(int(arg))
    elif cmd == "pid":
        pid, _, start = arg.partition(" ")
        pids[int(pid)] = start
    elif cmd == "path":
        paths.add(arg)
    elif cmd == "done":
        sys.exit(0)
def stat(e):
    try:
        return open("/proc/%s/stat" % e, "rb").read().decode("utf-8", "replace").rpartition(")")[2].split()
    except OSError:
        return []
def ours(e, rest):
    if len(rest) < 20 or rest[0] == "Z":
        return False
    return int(rest[2]) in groups or pids.get(int(e)) == rest[19]
def alive():
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and ours(e, stat(e))]
inodes = set()
for e in alive():
    try:
        for fd in os.listdir("/proc/%s/fd" % e):
            t = os.readlink("/proc/%s/fd/%s" % (e, fd))
            if t.startswith("socket:["):
                inodes.add(t[8:-1])
    except OSError:
        continue
try:
    for line in open("/proc/net/unix").read().splitlines()[1:]:
        f = line.split()
        if len(f) >= 8 and f[6] in inodes and f[7].startswith("/tmp/hivemind-"):
            paths.add(f[7])
except OSError:
    pass
for p in alive():
    if p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
for sig, wait in ((signal.SIGINT, 3.0), (signal.SIGKILL, 5.0)):
    for g in groups:
        try:
            os.killpg(g, sig)
        except OSError:
            pass
    end = time.monotonic() + wait
    while alive() and time.monotonic() < end:
        time.sleep(0.1)
for p in paths:
    if os.path.isdir(p):
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            os.unlink(p)
        except OSError:
            pass
"""


class Watchdog:
    """A handle on one watchdog process: what it is told to stop (process groups, single
    processes) and remove (paths) if this process dies first. :meth:`release` ends it
    without stopping anything. Never raises: if it could not start, only this process's
    own cleanup remains.
    """

    def __init__(self) -> None:
        try:
            self._proc: Optional[subprocess.Popen] = subprocess.Popen(
                [sys.executable, "-S", "-c", _WATCHDOG], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, text=True,
            )  # fmt: skip
        except OSError:
            self._proc = None

    def watch_group(self, pgid: int) -> None:
        """Stop this process group (SIGINT, then SIGKILL) if the owner dies."""
        self._tell(f"pg {pgid}")

    def watch_pid(self, pid: int, start_time: str) -> None:
        """SIGKILL this process (if it is still the one started at ``start_time``) if the owner dies."""
        self._tell(f"pid {pid} {start_time}")

    def watch_path(self, path: str) -> None:
        """Remove this file or folder if the owner dies."""
        self._tell(f"path {path}")

    def _tell(self, line: str) -> None:
        proc = self._proc  # once: release() from another thread (a stop while a swarm starts) sets it to None
        if proc is None:
            return
        try:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def release(self) -> None:
        """End the watchdog without stopping anything (the owner has cleaned up itself)."""
        if self._proc is None:
            return
        self._tell("done")
        try:
            self._proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None
