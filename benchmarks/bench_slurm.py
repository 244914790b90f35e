"""A 2-rank node job under a real SLURM against the same run by hand: samples/s.

    .venv/bin/python benchmarks/bench_slurm.py [--rows 20000] [--repeats 2] [--out FILE]

As root on a Debian host (Debian's slurm-wlm and munge are installed where missing): a
SLURM cluster on this host (tests/slurm_cluster.py: munged, slurmctld, two slurmd nodes of 2
CPUs, ``task/affinity``: each task bound to the CPUs it was given), the local backend on a
random tiny Llama and the demo task's long-tailed sentences (benchmarks/bench_big_set.py's
assets). Configurations, each ``--repeats`` times, one at a time:

- by hand: ``NNODES=1 NPROC_PER_NODE=2 launch/run_multinode.sh`` (no scheduler, every CPU);
- ``sbatch --cpus-per-task=2``: the script's default, a CPU per rank (OMP_NUM_THREADS=1 each);
- ``sbatch --cpus-per-task=1``: what the script asked for before (both ranks on one CPU).

samples/s is metrics.json's ``run.samples_per_second`` (rows / the slowest rank's loop).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT, os.path.join(ROOT, "tests")]
# Every row evaluated by every run: the row store (on by default) would serve a repeated run's
# rows without a forward. An explicit --row-store (bench_row_store's) still wins.
os.environ.setdefault("DIST_EVAL_ROW_STORE", "off")

CONFIGS = ["by hand (run_multinode.sh)", "sbatch --cpus-per-task=2", "sbatch --cpus-per-task=1"]


def _samples_per_second(out: str) -> float:
    with open(os.path.join(out, "metrics.json")) as f:
        return float(json.load(f)["run"]["samples_per_second"])


def by_hand(args: list, out: str) -> float:
    env = {**os.environ, "NNODES": "1", "NPROC_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1",
           "RDZV_ID": f"hand-{os.path.basename(out)}", "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"}
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "run_multinode.sh"), *args, "--output-dir", out],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"the run by hand failed:\n{proc.stderr[-3000:]}")
    return _samples_per_second(out)


def in_job(cluster, cpus: int, args: list, out: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update({"NPROC_PER_NODE": "2", "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "LOCAL_ADDR": "127.0.0.1"})
    job = cluster.sbatch(["--nodes=1", "--nodelist=n1", f"--cpus-per-task={cpus}",
                          os.path.join(ROOT, "launch", "slurm.sbatch"), *args, "--output-dir", out], cwd=ROOT, env=env)
    state, code = cluster.wait(job, timeout=1200)
    if (state, code) != ("COMPLETED", 0):
        raise SystemExit(f"job {job}: {state} {code}\n{cluster.output(job)[-3000:]}")
    return _samples_per_second(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    opts = parser.parse_args()
    from bench_big_set import make_assets
    from slurm_cluster import SlurmCluster

    results = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as work:
        args = make_assets(work, opts.rows, seed=0)
        with SlurmCluster(os.path.join(work, "slurm")) as cluster:
            for repeat in range(opts.repeats):
                for name in CONFIGS:
                    out = os.path.join(work, f"out-{repeat}-{CONFIGS.index(name)}")
                    started = time.perf_counter()
                    if name.startswith("by hand"):
                        rate = by_hand(args, out)
                    else:
                        rate = in_job(cluster, int(name[-1]), args, out)
                    results[name].append(rate)
                    load = os.getloadavg()[0]
                    print(f"{name:30s} {rate:8.1f} samples/s  ({time.perf_counter() - started:.0f} s, load average "
                          f"{load:.1f})", flush=True)
    print(f"\n{opts.rows} rows, 2 ranks on one node, the local backend:")
    for name, rates in results.items():
        print(f"  {name:30s} {min(rates):8.1f} - {max(rates):8.1f} samples/s")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"rows": opts.rows, "samples_per_second": results}, f, indent=1)


if __name__ == "__main__":
    main()
