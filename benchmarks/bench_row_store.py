"""The row store (issue 38): what it saves, and what it costs.

    .venv/bin/python benchmarks/bench_row_store.py cost --rows 200000 [--nproc 2] [--out FILE]
    .venv/bin/python benchmarks/bench_row_store.py limits --rows 20000 [--backend petals] [--out FILE]

``cost``: one set (bench_big_set's: the demo's sentences cut to long-tailed lengths, a random
tiny Llama on the local backend, the worst case for the store's share: its forwards are as
cheap as forwards get) run three times under torchrun: ``--row-store off``; an empty store
(every row evaluated and written); the full store (every row read, none evaluated). Each run's
wall time, its forwards, and the store's own seconds (``run.row_store.read_seconds``: rank 0
hashing every row's text, reading the files and sending each rank its rows;
``write_seconds``: every rank's writes), with the disk per row.

``limits``: ``--limit 500``, then ``--limit 5000``, then every row, each a separate CLI run
(``--backend petals`` with no ``--initial-peers``: a local swarm started for each run, as a
user without a cluster runs it), once with ``--row-store off`` and once with a fresh store:
the rows each run evaluated and its wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
# Every row evaluated by every run but those given --row-store STORE (the store measured here).
os.environ.setdefault("DIST_EVAL_ROW_STORE", "off")


def run_cli(args: list, out: str, nproc: int) -> dict:
    """One CLI run under torchrun (bench_big_set's): wall seconds, rows, the forwards' phase and run.row_store."""
    from bench_big_set import run_once

    run = run_once(ROOT, args, out, nproc)
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)
    return {"wall_seconds": run["wall_seconds"], "rows": run["rows"],
            "forward_seconds": run["phases"].get("the forward passes"), "row_store": metrics["run"]["row_store"],
            "accuracy": metrics["accuracy"]}


def disk_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(folder) for n in names)


def cost(args, workdir: str) -> dict:
    from bench_big_set import make_assets

    cli = make_assets(workdir, args.rows, args.seed) + ["--bootstrap-resamples", "0", "--progress", "none"]
    store = os.path.join(workdir, "store")
    results = {}
    for label, flags in (("store off", ["--row-store", "off"]), ("empty store (writes every row)",
                                                                  ["--row-store", store]),
                         ("full store (reads every row)", ["--row-store", store])):
        results[label] = run_cli(cli + flags, os.path.join(workdir, f"out{len(results)}"), args.nproc)
        print(label, json.dumps(results[label]), flush=True)
    files = [n for _, _, names in os.walk(store) for n in names if n.endswith(".rows")]
    return {"rows": args.rows, "nproc": args.nproc, "results": results, "store_bytes": disk_bytes(store),
            "store_files": len(files)}


def limits(args, workdir: str) -> dict:
    from bench_big_set import make_assets

    cli = make_assets(workdir, args.rows, args.seed) + ["--progress", "none"]
    cli[cli.index("--backend") + 1] = args.backend
    results = {}
    for label, store in (("without the store", "off"), ("with the store", os.path.join(workdir, "store"))):
        for limit in (500, 5000, 0):
            key = f"{label}, --limit {limit or 'every row'}"
            results[key] = run_cli(cli + ["--row-store", store, "--limit", str(limit)],
                                   os.path.join(workdir, f"out{len(results)}"), args.nproc)
            print(key, json.dumps(results[key]), flush=True)
    return {"rows": args.rows, "nproc": args.nproc, "backend": args.backend, "results": results}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["cost", "limits"])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="petals", choices=["petals", "local"])
    p.add_argument("--out", default=None, help="a JSON file for the figures")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_row_store_") as workdir:
        figures = (cost if args.what == "cost" else limits)(args, workdir)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
