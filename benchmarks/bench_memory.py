"""Each rank's peak memory on big sets (issue 51): N ranks under torchrun, the local backend, the
tiny random Llama and long-tailed rows of benchmarks/bench_big_set.py, at several set sizes; this
checkout beside a baseline git ref (run from an exported copy) in the same run.

    .venv/bin/python benchmarks/bench_memory.py [--rows 50000 200000] [--nproc 2] [--baseline REF] [--out FILE]
    .venv/bin/python benchmarks/bench_memory.py --table FILE      (the table of a saved run again)

Each run is the CLI with ``--save-logits --slice-by label`` (so the token-length quartiles too),
the row store on (a fresh folder: every row evaluated and stored) and ``--bootstrap-resamples``
as given (0 by default: the intervals' arrays are O(rows) either way and cost minutes). The modes
(``--modes``), each a run per size and code: ``full``; ``limit``, a ``--limit`` sample
(``--limit-rows``, 1% of the set by default) with the same flags; ``stop``, early stopping
(``--stop-at-width 0.0001``, never reached: every row, in 16 rounds); ``resamples``, the default
1000 bootstrap resamples; ``resume``, a run killed at 60% of the ``full`` run's wall time (the
row store off, ``--save-interval 2``) and the measured run that resumes it in the same folder;
``stored``, a run that fills the row store, then the measured run, served every row from it.
The figure is each rank's **peak RssAnon** (the anonymous resident memory: the heap, not the
mapped dataset files or the shared libraries), sampled from ``/proc/PID/status`` every 10 ms by this
process (a rank is told by the ``RANK`` of its environment); ``VmHWM`` (the peak of all resident
memory, kernel-kept) is recorded beside it. The slope is (peak at the largest set - peak at the
smallest) / (the difference in rows), in bytes per row of the set.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from bench_big_set import _free_port, export, make_assets  # noqa: E402

MIB = 2**20
# Put first on a rank's PYTHONPATH (with --phases): each phase's start and end, by the wall clock,
# appended to $BENCH_MEMORY_PHASES-r<RANK>.jsonl (ranks.phases._agreed is looked up at each phase)
SITECUSTOMIZE = """
import json, os, sys, threading, time

def _patch():
    while "dist_eval.ranks.phases" not in sys.modules or not hasattr(sys.modules["dist_eval.ranks.phases"], "_agreed"):
        time.sleep(0.005)
    module = sys.modules["dist_eval.ranks.phases"]
    agreed, path = module._agreed, os.environ["BENCH_MEMORY_PHASES"] + "-r" + os.environ.get("RANK", "0") + ".jsonl"

    def timed(name, *args):
        began = time.time()
        try:
            yield from agreed(name, *args)
        finally:
            with open(path, "a") as f:
                f.write(json.dumps([name, began, time.time()]) + "\\n")
    module._agreed = timed

if os.environ.get("BENCH_MEMORY_PHASES"):
    threading.Thread(target=_patch, daemon=True).start()
"""


def _status(pid: int) -> dict:
    """{field: kB} of /proc/PID/status's memory lines (empty once the process is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "VmHWM:")):
                    name, value = line.split(":", 1)
                    out[name] = int(value.split()[0])
    except OSError:
        pass
    return out


def _descendants(pid: int) -> list:
    """Every process below ``pid`` (its children's children too)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(child) for child in f.read().split()]
            except OSError:
                continue
            found.extend(children)
            todo.extend(children)
    return found


def _rank_of(pid: int):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return None
    if b"RANK" not in env or b"dist_eval" not in cmdline or b"torch.distributed.run" in cmdline:
        return None
    return int(env[b"RANK"])


class Sampler(threading.Thread):
    """Each rank's peak RssAnon and last VmHWM (kB), sampled every ``interval`` seconds."""

    def __init__(self, root_pid: int, interval: float = 0.01):
        super().__init__(daemon=True)
        self.root_pid, self.interval = root_pid, interval
        self.peaks: dict = {}
        self.series: dict = {}  # rank -> [(time, RssAnon kB)]
        self.ranks: dict = {}  # pid -> rank
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for pid in _descendants(self.root_pid):
                if pid not in self.ranks:
                    rank = _rank_of(pid)
                    if rank is None:
                        continue
                    self.ranks[pid] = rank
                memory = _status(pid)
                if memory:
                    self.series.setdefault(self.ranks[pid], []).append((time.time(), memory.get("RssAnon", 0)))
                    peak = self.peaks.setdefault(self.ranks[pid], {"RssAnon": 0, "VmHWM": 0})
                    peak["RssAnon"] = max(peak["RssAnon"], memory.get("RssAnon", 0))
                    peak["VmHWM"] = max(peak["VmHWM"], memory.get("VmHWM", 0))
            time.sleep(self.interval)


def killed_after(code: str, args: list, out: str, nproc: int, seconds: float) -> None:
    """A CLI run of the code in ``code`` killed (SIGKILL, every process of it) after ``seconds``."""
    import signal

    env = {**os.environ, "PYTHONPATH": code, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(_free_port()), "-m", "dist_eval", *args, "--output-dir", out]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=code, env=env,
                            start_new_session=True)
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for _ in range(300):  # until the ranks are gone too (their lock of the output folder with them)
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def run_once(code: str, args: list, out: str, nproc: int, phases: bool = False) -> dict:
    """One CLI run of the code in ``code``: wall seconds and each rank's peaks (MiB); ``phases``:
    each rank's peak RssAnon in each phase too (MiB), by the phases' times and the samples'.
    """
    env = {**os.environ, "PYTHONPATH": code, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    if phases:
        hooks = os.path.join(out + "-hooks")
        os.makedirs(hooks)
        with open(os.path.join(hooks, "sitecustomize.py"), "w") as f:
            f.write(SITECUSTOMIZE)
        env.update(PYTHONPATH=os.pathsep.join([hooks, code]), BENCH_MEMORY_PHASES=os.path.join(hooks, "phases"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(_free_port()), "-m", "dist_eval", *args, "--output-dir", out]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=code, env=env)
    sampler = Sampler(proc.pid)
    sampler.start()
    stdout, stderr = proc.communicate()
    sampler.done.set()
    sampler.join()
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"run of {code} failed:\n{stderr[-3000:]}")
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)
    peaks = {rank: {name: kb / 1024 for name, kb in values.items()} for rank, values in sorted(sampler.peaks.items())}
    result = {"wall_seconds": wall, "rows": metrics["num_samples"], "peaks_mib": peaks,
              "phases": metrics["run"]["phase_seconds"], "resumed": metrics["run"].get("resumed_samples")}
    if phases:
        result["phase_peaks_mib"] = _phase_peaks(sampler.series, env["BENCH_MEMORY_PHASES"])
    return result


def _phase_peaks(series: dict, prefix: str) -> dict:
    """{rank: {phase: the peak RssAnon sampled during it, MiB}} (phases that nest share samples)."""
    out = {}
    for rank, samples in sorted(series.items()):
        try:
            with open(f"{prefix}-r{rank}.jsonl") as f:
                spans = [json.loads(line) for line in f]
        except OSError:
            continue
        peaks = {}
        for name, began, ended in spans:
            inside = [kb for t, kb in samples if began <= t <= ended]
            if inside:
                peaks[name] = max(peaks.get(name, 0), max(inside) / 1024)
        out[rank] = peaks
    return out


def report(saved: dict) -> None:
    sizes = saved["sizes"]
    for mode in saved["modes"]:
        print(f"\n{mode}: peak RssAnon per rank, MiB (VmHWM in brackets), N={saved['nproc']}")
        labels = list(saved["results"])
        print(f"{'rows':>10}" + "".join(f"{label:>36}" for label in labels))
        for rows in sizes:
            cells = []
            for label in labels:
                r = saved["results"][label].get(f"{mode}/{rows}")
                cells.append("-" if r is None else " / ".join(
                    f"{p['RssAnon']:.0f} [{p['VmHWM']:.0f}]" for p in r["peaks_mib"].values()))
            print(f"{rows:>10}" + "".join(f"{c:>36}" for c in cells))
            for label in labels:
                r = saved["results"][label].get(f"{mode}/{rows}") or {}
                for rank, peaks in (r.get("phase_peaks_mib") or {}).items():
                    print(f"{'':>10}   {label}, rank {rank}, peak in each phase: "
                          + ", ".join(f"{name} {mib:.0f}" for name, mib in peaks.items()))
        if len(sizes) > 1:
            low, high = sizes[0], sizes[-1]
            cells = []
            for label in labels:
                a, b = (saved["results"][label].get(f"{mode}/{n}") for n in (low, high))
                cells.append("-" if a is None or b is None else " / ".join(
                    f"{(pb['RssAnon'] - pa['RssAnon']) * MIB / (high - low):.0f}"
                    for pa, pb in zip(a["peaks_mib"].values(), b["peaks_mib"].values())))
            print(f"{'B/row':>10}" + "".join(f"{c:>36}" for c in cells))
        cells = []
        for label in labels:
            r = saved["results"][label].get(f"{mode}/{sizes[-1]}")
            cells.append("-" if r is None else f"{r['wall_seconds']:.1f} s")
        print(f"{'wall':>10}" + "".join(f"{c:>36}" for c in cells) + f"   (at {sizes[-1]} rows)")


# Each mode's flags beyond the common ones, for a set of ``rows`` rows (see the module's docstring)
MODES = {
    "full": lambda rows, args: [],
    "limit": lambda rows, args: ["--limit", str(max(1, int(rows * args.limit_rows)))],
    "stop": lambda rows, args: ["--stop-at-width", "0.0001", "--stop-round-rows", str(max(256, -(-rows // 16)))],
    "resamples": lambda rows, args: ["--bootstrap-resamples", "1000"],
    "resume": lambda rows, args: ["--row-store", "off", "--save-interval", "2"],
    "stored": lambda rows, args: [],
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[50_000, 200_000])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resamples", type=int, default=0, help="--bootstrap-resamples of every run")
    p.add_argument("--limit-rows", type=float, default=0.01, help="the --limit run's sample: a share of the set")
    p.add_argument("--modes", nargs="+", default=["full", "limit"], choices=list(MODES))
    p.add_argument("--phases", action="store_true", help="each rank's peak in each phase too")
    p.add_argument("--resume-kill", type=float, default=60.0,
                   help="resume mode without a full run in this invocation: seconds before the first run is killed")
    p.add_argument("--baseline", default="main",
                   help="git ref (or a folder of code) run beside this checkout ('' for none)")
    p.add_argument("--out", default=None, help="a JSON file for the figures")
    p.add_argument("--table", default=None, help="only print the table of a JSON file written by --out")
    args = p.parse_args()
    if args.table:
        with open(args.table) as f:
            report(json.load(f))
        return 0
    saved = {"sizes": sorted(args.rows), "nproc": args.nproc, "modes": args.modes, "resamples": args.resamples,
             "results": {}}
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as workdir:
        codes = {"this checkout": ROOT}
        if args.baseline:  # a folder of code as it is (e.g. a copy of a commit under test), else a git ref
            codes[f"baseline {args.baseline}"] = args.baseline if os.path.isdir(args.baseline) else \
                export(args.baseline, tempfile.mkdtemp(dir=workdir))
        for rows in saved["sizes"]:
            data = os.path.join(workdir, f"set{rows}")
            os.makedirs(data)
            common = make_assets(data, rows, args.seed) + [
                "--save-logits", "--slice-by", "label", "--bootstrap-resamples", str(args.resamples),
                "--progress", "none", "--quiet"]
            for mode in args.modes:
                extra = MODES[mode](rows, args)
                for label, code in codes.items():
                    out = tempfile.mkdtemp(dir=workdir)
                    flags = [*common, *extra, "--row-store", os.path.join(out, "store")]
                    if mode == "resume":  # killed at 60% of the full run's time, then resumed (measured)
                        full = saved["results"].get(label, {}).get(f"full/{rows}", {}).get("wall_seconds")
                        flags = [*common, *extra]
                        killed_after(code, flags, os.path.join(out, "report"), args.nproc,
                                     0.6 * full if full else args.resume_kill)
                    if mode == "stored":  # a first run fills the store; the measured one reads every row from it
                        killed_after(code, flags, os.path.join(out, "first"), args.nproc, 24 * 3600)
                    r = run_once(code, flags, os.path.join(out, "report"), args.nproc, args.phases)
                    saved["results"].setdefault(label, {})[f"{mode}/{rows}"] = r
                    print(f"{mode} {rows} rows, {label}: {r['wall_seconds']:.1f} s, peak RssAnon "
                          + " / ".join(f"{v['RssAnon']:.0f}" for v in r["peaks_mib"].values()) + " MiB", flush=True)
                    if args.out:
                        with open(args.out, "w") as f:
                            json.dump(saved, f, indent=2)
    report(saved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
