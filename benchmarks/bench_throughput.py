"""Throughput of dist_eval against the plain tutorial loop, side by side, in one run.

    .venv/bin/python benchmarks/bench_throughput.py [--rows 1000] [--servers 3] [--repeats 1] [--out FILE]

One local Petals swarm (``--servers`` processes on 127.0.0.1) serves the built-in demo
model (a 4-layer Llama, hidden 64) for every configuration; the data is a benchmark set
of ``--rows`` sentences with a long-tailed spread of lengths (8 to 128 tokens, median
about 24). Every configuration is a fresh process (torchrun for dist_eval), so start-up
is part of the end-to-end figure; the eval-loop figure is rows / the slowest rank's loop
time (tokenisation included, model loading not). Each configuration must give the plain
loop's predictions, or the benchmark fails. The plain loop (the baseline, ``x plain``) runs
petals' own client, as the tutorial's users have it; a second row runs the same loop
through the client dist_eval drives (``benchmarks/plain_loop.py --client dist_eval``).

Where the time goes: for each configuration, the client ranks' CPU seconds inside the
evaluation loop (``time.process_time`` of each rank, summed) and the server processes'
CPU seconds (from the kernel's accounting), and the cores they keep busy during the
loop. On a 2-core machine a value near 2 means the box is saturated: more overlap
cannot help there, only less work per sample; well below 2 means time spent waiting.

Prints a table with ratios to the plain loop and writes JSON (``--out``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import resource
import shlex
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# Every row evaluated by every run: the row store (on by default) would serve a repeated run's
# rows without a forward. An explicit --row-store (bench_row_store's) still wins.
os.environ.setdefault("DIST_EVAL_ROW_STORE", "off")

# (name, ranks, extra flags). ranks None: the plain tutorial loop.
OFF = ["--batch-size", "16", "--no-length-buckets", "--max-batch-tokens", "0", "--in-flight", "1"]
CONFIGS = [
    ("plain loop (tutorial), 1 process", None, []),  # petals' own client: the baseline
    ("plain loop, dist_eval's client", None, ["--client", "dist_eval"]),
    ("dist_eval N=1, defaults", 1, []),
    ("dist_eval N=2, defaults", 2, []),
    ("dist_eval N=4, defaults", 4, []),
    ("N=2, defaults + progress log", 2, ["--progress", "log"]),
    ("N=1, all optimisations off", 1, OFF),
    ("N=2, all optimisations off", 2, OFF),
    ("N=2, length buckets off", 2, ["--no-length-buckets"]),
    ("N=2, token cap off", 2, ["--max-batch-tokens", "0"]),
    ("N=2, in-flight 1", 2, ["--in-flight", "1"]),
    ("N=2, in-flight 4", 2, ["--in-flight", "4"]),
    ("N=2, batch size 16", 2, ["--batch-size", "16"]),
    ("N=2, batch size 128", 2, ["--batch-size", "128"]),
    ("N=2, batch 256, cap 4096", 2, ["--batch-size", "256", "--max-batch-tokens", "4096"]),
    ("N=2, batch 256, cap 8192", 2, ["--batch-size", "256", "--max-batch-tokens", "8192"]),
    ("local backend N=1 (no RPC ceiling)", 1, ["--backend", "local"]),
    ("local backend N=2", 2, ["--backend", "local"]),
]


def make_benchmark_data(folder: str, num_rows: int, seed: int = 7) -> str:
    """Demo-task sentences re-cut to long-tailed lengths (log-normal words, 8..128)."""
    import datasets

    from dist_eval.demo import LABEL_NAMES, make_examples

    texts, labels = make_examples(num_rows * 4, seed)
    rng = random.Random(seed)
    out_texts, out_labels = [], []
    for i in range(num_rows):
        target = min(128, max(8, int(round(rng.lognormvariate(math.log(24), 0.6)))))
        words = texts[i].split()
        j = num_rows + i
        while len(words) < target:  # pad with words of further sentences
            words += texts[j % len(texts)].split()
            j += num_rows
        out_texts.append(" ".join(words[:target]))
        out_labels.append(labels[i])
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=list(LABEL_NAMES))}
    )
    datasets.Dataset.from_dict({"text": out_texts, "label": out_labels}, features=features).save_to_disk(folder)
    return folder


def padding_ratios(model_dir: str, data_dir: str, prefix_tokens: int) -> dict:
    """Padded tokens / real tokens of the batch plans (what the servers compute per real token)."""
    import datasets
    import numpy as np
    from transformers import AutoTokenizer

    from dist_eval.config import DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCH_TOKENS
    from dist_eval.data import plan_batches

    texts = list(datasets.load_from_disk(data_dir)["text"])
    lengths = np.array([len(ids) for ids in AutoTokenizer.from_pretrained(model_dir)(texts)["input_ids"]])
    n, real = len(lengths), int(lengths.sum())

    def ratio(batches):
        return sum(len(b) * int(lengths[b].max()) for b in batches) / real

    return {
        "dataset order, batch 16 (the plain loop)": ratio(plan_batches(n, 16)),
        "length buckets, batch 16": ratio(plan_batches(n, 16, lengths)),
        "dist_eval defaults": ratio(
            plan_batches(n, DEFAULT_BATCH_SIZE, lengths, DEFAULT_MAX_BATCH_TOKENS, prefix_tokens=prefix_tokens)
        ),
        "token lengths (min, median, max)": [int(lengths.min()), float(np.median(lengths)), int(lengths.max())],
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_cpu_seconds(pgids) -> float:
    """utime + stime of every live process in these process groups."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                rest = f.read().decode("utf-8", "replace").rpartition(")")[2].split()
        except OSError:
            continue
        if int(rest[2]) in pgids:
            total += int(rest[11]) + int(rest[12]) + int(rest[13]) + int(rest[14])  # self + reaped children
    return total / ticks


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_config(name, ranks, extra, assets, data_dir, swarm, workdir, env):
    out_dir = os.path.join(workdir, f"out-{abs(hash(name))}")
    if ranks is None:
        out_json = os.path.join(workdir, f"plain-{abs(hash(name))}.json")
        cmd = [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "plain_loop.py"),
            assets.model_dir,
            data_dir,
            assets.checkpoint,
            out_json,
            "--initial-peers",
            *swarm.initial_peers,
            "--dht-prefix",
            swarm.dht_prefix,
            *extra,
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(ranks),
            "--master_port",
            str(_free_port()),
            "-m",
            "dist_eval",
            "--model",
            assets.model_dir,
            "--data-files",
            data_dir,
            "--checkpoint",
            assets.checkpoint,
            "--output-dir",
            out_dir,
            "--quiet",
            "--bootstrap-resamples",
            "0",
            *extra,
        ]
        if "--backend" not in extra:
            cmd += ["--initial-peers", *swarm.initial_peers, "--dht-prefix", swarm.dht_prefix]
    client_cpu, server_cpu = _children_cpu_seconds(), _group_cpu_seconds(set(swarm.pgids))
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - started
    client_cpu, server_cpu = _children_cpu_seconds() - client_cpu, _group_cpu_seconds(set(swarm.pgids)) - server_cpu
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exited {proc.returncode}\n{proc.stderr[-3000:]}")
    if ranks is None:
        with open(out_json) as f:
            facts = json.load(f)
        n, loop_seconds, preds = facts["num_samples"], facts["eval_loop_seconds"], facts["preds"]
        loop_cpu = facts["loop_cpu_seconds"]
    else:
        with open(os.path.join(out_dir, "metrics.json")) as f:
            metrics = json.load(f)
        n, loop_seconds = metrics["num_samples"], metrics["run"]["eval_loop_seconds"]
        loop_cpu = metrics["run"]["loop_cpu_seconds_sum"]
        with open(os.path.join(out_dir, "predictions.jsonl")) as f:
            preds = [json.loads(line)["pred"] for line in f]
    return {
        "name": name,
        "ranks": ranks,
        "flags": extra,
        "num_samples": n,
        "eval_samples_per_second": n / loop_seconds,
        "end_to_end_samples_per_second": n / wall,
        "eval_loop_seconds": loop_seconds,
        "wall_seconds": wall,
        "client_cpu_seconds": client_cpu,
        "server_cpu_seconds": server_cpu,
        "loop_client_cpu_seconds": loop_cpu,
        "preds": preds,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per configuration, round-robin over the configurations; the median is reported")
    p.add_argument(
        "--only", nargs="*", default=None, help="substrings of configuration names to run (the plain loops always run)"
    )
    p.add_argument("--server-args", default="", help='petals server flags for the swarm, e.g. '
                   '--server-args="--max_batch_size 8192" (caps over 2048 are split for servers without it)')
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "throughput.json"))
    args = p.parse_args()

    from dist_eval.demo import demo_assets
    from dist_eval.swarm import LocalSwarm

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    assets = demo_assets(log=lambda line: print(line, file=sys.stderr))
    configs = [c for c in CONFIGS if c[1] is None or args.only is None or any(s in c[0] for s in args.only)]
    results = []
    with tempfile.TemporaryDirectory(prefix="dist_eval-bench-") as workdir:
        data_dir = make_benchmark_data(os.path.join(workdir, "data"), args.rows)
        padding = padding_ratios(assets.model_dir, data_dir, assets.pre_seq_len)
        print(f"padded / real tokens: {json.dumps(padding)}", flush=True)
        print(f"starting a local swarm of {args.servers} servers ...", file=sys.stderr, flush=True)
        server_args = shlex.split(args.server_args)
        with LocalSwarm(assets.model_dir, num_servers=args.servers, extra_server_args=server_args) as swarm:
            # round-robin: every configuration meets the swarm and the machine in each state
            runs = {name: [] for name, _, _ in configs}
            for repeat in range(args.repeats):
                for name, ranks, extra in configs:
                    run = run_config(name, ranks, extra, assets, data_dir, swarm, workdir, env)
                    runs[name].append(run)
                    print(f"  [{repeat + 1}/{args.repeats}] {name}: {run['eval_samples_per_second']:.0f} samples/s",
                          file=sys.stderr, flush=True)
            for name, _, _ in configs:
                ordered = sorted(runs[name], key=lambda r: r["eval_samples_per_second"])
                result = dict(ordered[len(ordered) // 2])  # the median
                result["all_eval_samples_per_second"] = [r["eval_samples_per_second"] for r in runs[name]]
                results.append(result)
    baseline = results[0]
    for r in results:
        if r["preds"] != baseline["preds"]:
            raise SystemExit(f"{r['name']}: predictions differ from the plain loop's")
        r["ratio_to_plain_eval"] = r["eval_samples_per_second"] / baseline["eval_samples_per_second"]
        r["ratio_to_plain_end_to_end"] = r["end_to_end_samples_per_second"] / baseline["end_to_end_samples_per_second"]
    print(format_table(results))
    local = next((r for r in results if r["name"].startswith("local backend N=1")), None)
    default2 = next((r for r in results if r["name"] == "dist_eval N=2, defaults"), None)
    if local and default2:
        print(
            f"\ndist_eval N=2 defaults: {default2['ratio_to_plain_eval']:.2f}x the plain loop, "
            f"{default2['eval_samples_per_second'] / local['eval_samples_per_second']:.0%} of the local ceiling"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    import torch

    with open(args.out, "w") as f:
        json.dump(
            {
                "machine": {
                    "cpus": os.cpu_count(),
                    "platform": platform.platform(),
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                },
                "rows": args.rows,
                "servers": args.servers,
                "server_args": args.server_args,
                "repeats": args.repeats,
                "padding": padding,
                "results": [{k: v for k, v in r.items() if k != "preds"} for r in results],
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")
    return 0


def format_table(results) -> str:
    """eval/s and e2e/s with ratios to the plain loop, then where the loop's time goes:
    the loop's wall seconds, the client ranks' CPU seconds in it (their own processes),
    the servers' CPU seconds (whole run: they are idle outside the loops), and the cores
    those keep busy on average during the loop (this machine has os.cpu_count())."""
    head = (
        f"{'configuration':<36} {'eval/s':>7} {'x plain':>7} {'e2e/s':>6} {'x plain':>7} "
        f"{'loop s':>6} {'client cpu':>10} {'server cpu':>10} {'cores busy':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        busy = (r["loop_client_cpu_seconds"] + r["server_cpu_seconds"]) / r["eval_loop_seconds"]
        lines.append(
            f"{r['name']:<36} {r['eval_samples_per_second']:7.1f} {r['ratio_to_plain_eval']:7.2f} "
            f"{r['end_to_end_samples_per_second']:6.1f} {r['ratio_to_plain_end_to_end']:7.2f} "
            f"{r['eval_loop_seconds']:6.1f} "
            f"{r['loop_client_cpu_seconds']:10.1f} {r['server_cpu_seconds']:10.1f} {busy:10.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
