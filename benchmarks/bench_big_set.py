"""Where a big set's run goes, phase by phase: the local backend, N ranks, the default
intervals on, this checkout beside a baseline (a git ref, run from an exported copy).

    .venv/bin/python benchmarks/bench_big_set.py --rows 200000 [--nproc 2] [--limit N] [--baseline main] [--out FILE]
    .venv/bin/python benchmarks/bench_big_set.py --table FILE      (the table of a saved run again)

The data: the demo task's sentences cut to long-tailed lengths (benchmarks/bench_gpu.py's
``make_data``: median 19 words, 90th percentile 49, at most 178), a random tiny Llama (4
layers, hidden 64) with random prompts and head, all made once in a temporary folder.
Each of the two codes then runs the CLI once under torchrun (``--nproc``) on it; the
figures are the command's wall time, samples/s (rows / wall time) and each phase's
seconds from ``metrics.json`` (``run.phase_seconds``; "launch and imports" is the wall
time the phases do not cover). The share that matters (issue 29): everything other than
the forward passes, as a share of the wall time. Beside them, the tokenizer's own ``encode_batch``
over a rank's block of the same rows (issue 74): what "measuring the token lengths" cannot go under.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
# Every row evaluated by every run: the row store (on by default) would serve a repeated run's
# rows without a forward. An explicit --row-store (bench_row_store's) still wins.
os.environ.setdefault("DIST_EVAL_ROW_STORE", "off")

FORWARD = "the forward passes"
MEASURING, TOKENIZING = "measuring the token lengths", "tokenizing the data"
# phases that run inside "tokenizing the data" (its figure includes them); "keying the rows" since issue 74
NESTED = (MEASURING, "keying the rows")
TOKENIZER_ALONE = "the tokenizer alone (encode_batch, a rank's block)"


def make_assets(workdir: str, rows: int, seed: int) -> list:
    """The CLI's arguments for the set, the model and its checkpoint made in ``workdir``."""
    import bench_gpu

    from dist_eval.demo import LABEL_NAMES

    data = bench_gpu.make_data(os.path.join(workdir, "data"), rows, seed)
    model_dir = os.path.join(workdir, "model")
    vocab = bench_gpu.save_tokenizer(model_dir, data.pop("vocab"))
    model = bench_gpu.save_model(model_dir, "tiny", vocab, "cpu", "float32", seed)
    checkpoint = bench_gpu.save_checkpoint(os.path.join(workdir, "ptune.pt"), model["hidden_size"],
                                           len(LABEL_NAMES), seed)
    return ["--model", model_dir, "--data-files", os.path.join(workdir, "data"), "--backend", "local",
            "--checkpoint", checkpoint, "--progress", "log"]


def export(ref: str, folder: str) -> str:
    """The code of git ref ``ref``, exported (``git archive``) into ``folder``."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return folder


def run_once(code: str, args: list, out: str, nproc: int) -> dict:
    """One CLI run of the code in ``code``: wall seconds and the phases of its report."""
    env = {**os.environ, "PYTHONPATH": code, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(_free_port()), "-m", "dist_eval", *args, "--output-dir", out]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=code, env=env)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"run of {code} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)
    return {"wall_seconds": wall, "rows": metrics["num_samples"], "phases": dict(metrics["run"]["phase_seconds"]),
            "eta_lines": [line for line in proc.stderr.splitlines() if "progress" in line][:3]}


def same_outputs(a: str, b: str) -> dict:
    """{file: "same" or "differs"} of every file of two runs' folders, byte for byte (metrics.json without
    its run facts, which hold timings; report.html without its times and start)."""
    def read(folder, name):
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        if name == "metrics.json":
            metrics = json.loads(data)
            metrics.pop("run", None)
            return json.dumps(metrics, sort_keys=True)
        if name == "report.html":  # its times (wall time, eval loop: "12.3 s", the loop's samples/s), its start
            return re.sub(rb"\d{4}-\d\d-\d\dT[\d:.+-]+|\d+\.\d s|samples/s \(eval loop\)</td><td class=\"val\">[\d.]+",
                          b"", data)
        return data

    names = sorted(set(os.listdir(a)) | set(os.listdir(b)))
    return {name: "same" if os.path.exists(os.path.join(a, name)) and os.path.exists(os.path.join(b, name))
            and read(a, name) == read(b, name) else "differs" for name in names if not name.startswith(".")}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def top_level(phases: dict, wall: float) -> dict:
    """The phases without nesting ("measuring the token lengths" runs inside "tokenizing the
    data", whose figure includes it), and "launch and imports": the wall time they leave.
    """
    phases = dict(phases)
    if TOKENIZING in phases and any(name in phases for name in NESTED):
        phases[TOKENIZING + " (besides the nested)"] = phases.pop(TOKENIZING) - sum(phases.get(n, 0.0)
                                                                                     for n in NESTED)
    return {"launch and imports": max(0.0, wall - sum(phases.values())), **phases}


def tokenizer_alone(workdir: str, nproc: int) -> float:
    """Seconds the tokenizer's own ``encode_batch`` takes over the largest rank's block of rows (what each
    rank's length pass tokenizes), 4,096 rows a call as that pass takes them, in one process with one thread:
    the floor of "measuring the token lengths" (issue 74)."""
    code = (
        "import sys, time, datasets\n"
        "from transformers import AutoTokenizer\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1])._tokenizer\n"
        "texts = datasets.load_from_disk(sys.argv[2])['text']\n"
        "texts = texts[:-(-len(texts) // int(sys.argv[3]))]\n"
        "start = time.perf_counter()\n"
        "for first in range(0, len(texts), 4096):\n"
        "    [e.ids for e in tok.encode_batch(texts[first:first + 4096], add_special_tokens=True)]\n"
        "print(time.perf_counter() - start)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code, os.path.join(workdir, "model"), os.path.join(workdir, "data"),
                          str(nproc)], capture_output=True, text=True, env=env, check=True).stdout
    return float(out.split()[-1])


def report(results: dict, alone: float = None) -> None:
    if alone is not None:
        print(f"{TOKENIZER_ALONE:<38}{alone:7.1f} s (beside each run's {MEASURING!r})")
    results = {label: {**r, "phases": top_level(r["phases"], r["wall_seconds"])} for label, r in results.items()}
    names = list(dict.fromkeys(name for r in results.values() for name in r["phases"]))
    labels = list(results)
    print(f"{'phase':<38}" + "".join(f"{label:>22}" for label in labels))
    for name in names:
        cells = []
        for label in labels:
            r = results[label]
            seconds = r["phases"].get(name)
            cells.append("-" if seconds is None else f"{seconds:7.1f} s {100 * seconds / r['wall_seconds']:5.1f}%")
        print(f"{name:<38}" + "".join(f"{c:>22}" for c in cells))
    for title, fn in (("wall", lambda r: f"{r['wall_seconds']:7.1f} s"),
                      ("everything but the forwards", lambda r: f"{100 * _not_forward(r):6.1f}%"),
                      ("samples/s (rows / wall)", lambda r: f"{r['rows'] / r['wall_seconds']:8.1f}")):
        print(f"{title:<38}" + "".join(f"{fn(results[label]):>22}" for label in labels))


def _not_forward(r: dict) -> float:
    return 1.0 - r["phases"].get(FORWARD, 0.0) / r["wall_seconds"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=0, help="passed to the CLI: a --limit sample of the set (0: every row)")
    p.add_argument("--baseline", default="main", help="git ref run beside this checkout ('' for none)")
    p.add_argument("--out", default=None, help="a JSON file for the figures")
    p.add_argument("--table", default=None, help="only print the table of a JSON file written by --out")
    args = p.parse_args()
    if args.table:
        with open(args.table) as f:
            saved = json.load(f)
        sample = f" (--limit {saved['limit']})" if saved.get("limit") else ""
        print(f"{saved['rows']} rows{sample}, local backend, N={saved['nproc']}, default intervals:")
        report(saved["results"], saved.get("tokenizer_alone_seconds"))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_big_set_") as workdir:
        cli_args = make_assets(workdir, args.rows, args.seed) + (["--limit", str(args.limit)] if args.limit else [])
        codes = {"this checkout": ROOT}
        if args.baseline:
            codes[f"baseline {args.baseline}"] = export(args.baseline, tempfile.mkdtemp(dir=workdir))
        alone = tokenizer_alone(workdir, args.nproc)
        results = {}
        for label, code in codes.items():
            results[label] = run_once(code, cli_args, os.path.join(workdir, f"out{len(results)}"), args.nproc)
            print(f"{label}: {results[label]['wall_seconds']:.1f} s", flush=True)
        if len(codes) == 2:
            same = same_outputs(os.path.join(workdir, "out0"), os.path.join(workdir, "out1"))
            print("outputs, this checkout against the baseline: " + ", ".join(f"{k} {v}" for k, v in same.items()))
    sample = f" (--limit {args.limit})" if args.limit else ""
    print(f"\n{args.rows} rows{sample}, local backend, N={args.nproc}, default intervals:")
    report(results, alone)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": args.rows, "limit": args.limit, "nproc": args.nproc, "tokenizer_alone_seconds": alone,
                       "outputs": same if len(codes) == 2 else None, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
