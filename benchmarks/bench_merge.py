"""The gather + merge + metrics path alone (no model): time and peak memory on rank 0.

    .venv/bin/python -m torch.distributed.run --nproc_per_node 4 benchmarks/bench_merge.py \
        [--sizes 10000 100000 1000000]

Each rank makes synthetic per-sample results for its share of the rows (a padded
DistributedSampler-like split, so duplicates are dropped too), then runs exactly what
``dist_eval.evaluate`` runs after the forwards: the all_reduce of totals, the gather of
the per-sample arrays to rank 0, the merge (de-duplicate, order, coverage check) and the
metrics. Rank 0 prints the seconds and its peak resident memory above the level before
the step, next to the size of one copy of the gathered arrays.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> None:
    try:  # Linux >= 4.0: "5" resets the peak RSS (VmHWM) to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def local_results(num_rows: int, num_labels: int, rank: int, world: int):
    from dist_eval.results import ShardResults

    rows = np.arange(rank, num_rows + (-num_rows) % world, world, dtype=np.int64) % num_rows  # padded repeats
    rng = np.random.default_rng(rank)
    labels = rows % num_labels
    preds = np.where(rng.random(len(rows)) < 0.8, labels, rng.integers(0, num_labels, len(rows)))
    losses = -np.log(np.where(preds == labels, 0.8, 0.05))
    return ShardResults(indices=rows, labels=labels, preds=preds.astype(np.int64), losses=losses)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--num-labels", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch.distributed as dist

    from dist_eval import ranks
    from dist_eval.merge import merge_on_main

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank, world = ranks.get_rank(), ranks.get_world_size()
    rows_out = []
    for n in args.sizes:
        local = local_results(n, args.num_labels, rank, world)
        ranks.barrier()
        _reset_peak_rss()
        rss_before = _rss_bytes("VmRSS")
        start = time.perf_counter()
        report, merged, _ = merge_on_main(local, n, args.num_labels)
        seconds = time.perf_counter() - start
        peak_extra = _rss_bytes("VmHWM") - rss_before
        if rank == 0:
            one_copy = n * (8 + 8 + 8 + 8)  # indices, labels, preds, losses of the de-duplicated set
            assert merged.num_samples == n and report["num_samples"] == n
            rows_out.append(
                {
                    "samples": n,
                    "world_size": world,
                    "seconds": seconds,
                    "peak_extra_rss_mb": peak_extra / 2**20,
                    "one_copy_mb": one_copy / 2**20,
                }
            )
            print(
                f"{n:>9} samples, N={world}: {seconds:6.3f} s, peak extra RSS {peak_extra / 2**20:7.1f} MB "
                f"(one copy of the gathered arrays: {one_copy / 2**20:6.1f} MB)",
                flush=True,
            )
        del local, merged, report
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(rows_out, f, indent=2)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
