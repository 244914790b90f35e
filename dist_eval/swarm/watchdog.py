"""The watchdog: a tiny process that stops the servers when their owner dies without stopping them."""
from __future__ import annotations

# A tiny process (its own session) that stops the servers if the Python process that
# started them dies without stopping them (SIGKILL, or SIGTERM from torchrun, which
# skips atexit). It reads commands on stdin; EOF without "done" means the owner died.
_WATCHDOG = r"""
import os, shutil, signal, sys, time
groups, paths = set(), set()
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "pg":
        groups.add(int(arg))
    elif cmd == "path":
        paths.add(arg)
    elif cmd == "done":
        sys.exit(0)
def alive():
    left = set()
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                rest = open("/proc/%s/stat" % e, "rb").read().decode("utf-8", "replace").rpartition(")")[2].split()
            except OSError:
                continue
            if len(rest) > 2 and rest[0] != "Z" and int(rest[2]) in groups:
                left.add(int(rest[2]))
    return left
inodes = set()
for e in os.listdir("/proc"):
    try:
        stat = open("/proc/%s/stat" % e, "rb").read().decode("utf-8", "replace") if e.isdigit() else ""
        if stat and int(stat.rpartition(")")[2].split()[2]) in groups:
            for fd in os.listdir("/proc/%s/fd" % e):
                t = os.readlink("/proc/%s/fd/%s" % (e, fd))
                if t.startswith("socket:["):
                    inodes.add(t[8:-1])
    except (OSError, IndexError, ValueError):
        continue
try:
    for line in open("/proc/net/unix").read().splitlines()[1:]:
        f = line.split()
        if len(f) >= 8 and f[6] in inodes and f[7].startswith("/tmp/hivemind-"):
            paths.add(f[7])
except OSError:
    pass
for sig, wait in ((signal.SIGINT, 3.0), (signal.SIGKILL, 5.0)):
    for g in alive():
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
