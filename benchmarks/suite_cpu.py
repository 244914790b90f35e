"""Where the test suite's CPU goes, by kind of process: the suite run once, every process of it watched.

Runs ``.venv/bin/python -m pytest`` (any arguments given are passed on) in this checkout and reads /proc every
half second: each process whose command line names the checkout, or whose working folder is in it (the suite's
workers, the CLI's ranks, swarm servers and their fork servers, p2pd daemons, reference scripts), with its
user + system CPU seconds as last seen. At the end, one line per kind of process: how many, their CPU seconds,
their share, beside the suite's own wall time and pytest's closing line. A process's last half second may be
missed, and a process forked from another (a forked rank, a server forked by its fork server) keeps its
parent's command line, so it is counted under its parent's kind. Linux only.

    python benchmarks/suite_cpu.py                # the whole suite as README runs it
    python benchmarks/suite_cpu.py tests/test_swarm.py -n 0
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TICK = os.sysconf("SC_CLK_TCK")
# the first of these found in a command line names its kind (order matters: a fork server is a swarm server)
KINDS = (("p2pd", "p2pd (hivemind's libp2p daemon)"), ("--dist_eval_fork_server", "swarm fork server + servers forked"),
         ("dist_eval.swarm.server", "swarm server"), ("stock_petals_server", "stock petals server"),
         ("rank_zygote", "rank zygote + ranks forked"), ("torch.distributed.run", "torchrun"),
         ("-m dist_eval", "dist_eval CLI rank"), ("exec(eval(sys.stdin", "pytest worker + its forks"),
         ("tests/reference/", "reference script"), ("-m pytest", "pytest"), ("uv pip", "installs"),
         ("slurm", "slurm daemons"), ("munge", "slurm daemons"), (" -c ", "python -c (a test's own script)"))


def kind_of(command: str) -> str:
    return next((kind for marker, kind in KINDS if marker in command), command.split(" ")[0].rsplit("/", 1)[-1])


def watch(seen: dict) -> None:
    """One look at /proc: each process of this checkout's CPU seconds, by (pid, start time)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:  # exited, not yet reaped (or not ours)
                cwd = ""
        except OSError:  # gone
            continue
        key = (pid, fields[19])
        if key not in seen and ROOT not in command and not cwd.startswith(ROOT):
            continue
        if not command and key in seen:  # exited, not yet reaped: its command line is gone, its CPU is not
            command = seen[key][1]
        seen[key] = ((int(fields[11]) + int(fields[12])) / TICK, command)


def main() -> int:
    began, seen = time.monotonic(), {}
    suite = subprocess.Popen([os.path.join(ROOT, ".venv", "bin", "python"), "-m", "pytest", *sys.argv[1:]], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(suite.stdout), daemon=True)
    reader.start()
    while suite.poll() is None:
        watch(seen)
        time.sleep(0.5)
    reader.join()
    wall = time.monotonic() - began
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    for cpu, command in seen.values():
        by_kind[kind_of(command)][0] += 1
        by_kind[kind_of(command)][1] += cpu
    total = sum(cpu for _, cpu in by_kind.values())
    ends = [line.strip(" =\n") for line in lines if re.search(r"\d+ (passed|failed|errors?)\b", line)]
    closing = ends[-1] if ends else "(no closing line)"
    print(f"suite: {wall:.0f} s wall, {total:.0f} CPU seconds in {len(seen)} processes | {closing}")
    print(f"{'CPU s':>8} {'share':>6} {'processes':>9}  kind")
    for kind, (count, cpu) in sorted(by_kind.items(), key=lambda item: -item[1][1]):
        print(f"{cpu:8.1f} {cpu / max(total, 1e-9):6.1%} {count:9d}  {kind}")
    return suite.returncode


if __name__ == "__main__":
    sys.exit(main())
