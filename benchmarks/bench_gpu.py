"""Throughput on a GPU machine: the seeds' loop, dist_eval's defaults at several N and the same
model in-process, side by side, in one run (issue 13).

    python benchmarks/bench_gpu.py [--model-size tinyllama|llama7b|tiny] [--device auto|cuda|cpu] [--rows 2000]
        [--servers K] [--ranks 1,2,4,8,16] [--repeats 3] [--server-args="--max_batch_size 16384"] [--out FILE]
        [--time-budget SECONDS]

What runs, all against ONE local swarm (``LocalSwarm`` with dist_eval's own plan for the
device, :mod:`dist_eval.swarm.devices`: on a GPU, fp16 full replicas, as many per GPU as
fit, at most 8, ``--max_batch_size 16384``; ``--servers`` and ``--server-args`` override),
every configuration a fresh process:

1. the seeds' loop (``benchmarks/plain_loop.py``: one process, batch 16, dataset order,
   attention mask dropped), the reference of "x seeds";
2. ``torchrun --nproc_per_node N -m dist_eval`` for each N of ``--ranks``, with
   ``--initial-peers``/``--dht-prefix`` of that swarm and no other flag (``--dist-eval-args``
   adds some, for an operator's experiments);
3. the same model in-process on ``--device`` (``benchmarks/inprocess_loop.py``: dist_eval's
   local backend in the model's dtype) at dist_eval's batch plan (its length-bucketed
   batches with the token cap, planned by dist_eval.data's own functions), the reference
   of "% in-proc";
4. with ``--own-swarm-ranks N``: ``torchrun -m dist_eval`` without ``--initial-peers`` (the
   local swarm dist_eval starts itself, with its own defaults) at N ranks.

The model: a Llama built from a config with random weights, ``tinyllama`` (hidden 2048,
intermediate 5632, 22 layers, 32 heads, 4 KV heads, vocab 32000: 1.03B parameters),
``llama7b`` (the Llama-2-7B shape: hidden 4096, 32 layers, 6.7B parameters) or ``tiny``
(hidden 64, 4 layers: a CPU smoke test), saved in float16 on a GPU (float32 on the
CPU), with a word-level tokenizer built from the data and a random prompt-tuning checkpoint
(8 prompt vectors, 4 classes). Nothing is downloaded. The data: ``--rows`` rows of the demo
task's words cut to long-tailed lengths (log-normal, median 19 words, p90 about 49: 47 with
the default seed and 2000 rows; at most 178), a pure function of ``--seed`` and ``--rows``.

samples/s is rows / the evaluation loop's seconds (the slowest rank's, tokenisation
included, model loading and start-up not); "wall s" is the whole command. Every
configuration's predictions are compared with the in-process model's (at dist_eval's plan):
in float32 they must be equal (the benchmark fails otherwise); in float16 near-ties of the
random head may differ, the agreement is reported. ``--repeats R`` runs everything R times
(round-robin): the table shows the median and the min-max. JSON with every run and the
machine goes to ``--out``. ``--time-budget S`` (a lease's time on a GPU machine) starts no run that
its configuration's last run says would end past S seconds from the start (the table then has fewer
repeats of some configurations, and the JSON says which were cut); a SIGTERM or Ctrl-C (e.g. an outer
``timeout``) still writes the JSON of the runs done.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# Every row evaluated by every run: the row store (on by default) would serve a repeated run's
# rows without a forward. An explicit --row-store (bench_row_store's) still wins.
os.environ.setdefault("DIST_EVAL_ROW_STORE", "off")

MODEL_SIZES: Dict[str, dict] = {
    "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),
    "llama7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=0, max_position_embeddings=512),
}  # fmt: skip
PRE_SEQ_LEN = 8
SEEDS_LOOP = "seeds' loop"
IN_PROCESS = "in-process"


@dataclass
class Config:
    name: str
    kind: str  # seeds | dist_eval | inprocess | own_swarm
    ranks: int = 1
    batch_size: int = 16
    max_batch_tokens: int = 0
    threads: int = 0  # in-process: torch CPU threads (0: torch's default)
    flags: List[str] = field(default_factory=list)
    runs: List[dict] = field(default_factory=list)
    failures: List[str] = field(default_factory=list)  # a failed run is reported; the others go on


@dataclass
class Assets:
    model_dir: str
    data_dir: str
    checkpoint: str
    dtype: str
    model: dict
    data: dict


# ------------------------------------------------------------------------------ arguments


def _int_list(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _plans(text: str) -> List[tuple]:
    """'64:1536,256:16384' -> [(64, 1536), (256, 16384)] (batch size : token cap, 0 = no cap)."""
    out = []
    for part in text.split(","):
        size, _, cap = part.partition(":")
        out.append((int(size), int(cap or 0)))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    from dist_eval.config import DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCH_TOKENS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tinyllama")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="where the servers and the in-process model compute (auto: cuda if available)")
    p.add_argument("--dtype", choices=["auto", "float16", "bfloat16", "float32"], default="auto",
                   help="the model's dtype (auto: float16 on cuda, float32 on cpu)")
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--seed", type=int, default=13, help="seed of the data, the weights and the checkpoint")
    p.add_argument("--servers", type=int, default=None,
                   help="server processes of the swarm (default: LocalSwarm's for the device, as dist_eval starts "
                   "it: 2 on the CPU; on GPUs full replicas, as many per GPU as fit in half its memory, at most 8)")
    p.add_argument("--server-args", default="", help='more petals server flags, e.g. --server-args="--max_batch_size '
                   '16384" (later flags override LocalSwarm\'s and this benchmark\'s)')
    p.add_argument("--ranks", type=_int_list, default=[1, 2, 4, 8, 16], help="dist_eval's N, e.g. 1,2,4,8,16")
    p.add_argument("--dist-eval-args", default="", help="flags added to every dist_eval configuration (default none)")
    p.add_argument("--seeds-batches", type=_int_list, default=[16],
                   help="batch sizes of the seeds' loop (the first is the reference), e.g. 16,64")
    p.add_argument("--inprocess-plans", type=_plans, default=[(DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCH_TOKENS)],
                   help="BATCH:TOKEN_CAP of the in-process runs (the first is the reference; default dist_eval's "
                   f"{DEFAULT_BATCH_SIZE}:{DEFAULT_MAX_BATCH_TOKENS}), e.g. 64:1536,256:16384")
    p.add_argument("--inprocess-threads", type=int, default=0,
                   help="torch CPU threads of the in-process runs (0: torch's default; 1 steadies a shared CPU)")
    p.add_argument("--own-swarm-ranks", type=int, default=0,
                   help="also run dist_eval with no --initial-peers (its own local swarm) at this N (0: not run)")
    p.add_argument("--repeats", type=int, default=1, help="runs of every configuration (round-robin)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for the swarm to serve every block")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds for one configuration's command")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds from the start: no run is started that its configuration's last run's wall time "
                   "says would end later (0: no budget); the runs cut are listed in the JSON")
    p.add_argument("--keep", default=None, help="keep the model, data and logs in this folder (default: temp)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu.json"))
    args = p.parse_args(argv)
    if not args.seeds_batches or not args.inprocess_plans or args.repeats < 1:
        p.error("--seeds-batches and --inprocess-plans need at least one entry (the references), --repeats >= 1")
    return args


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU here (torch.cuda.is_available() is False)")
    return requested


# ------------------------------------------------------------------------------ data and model


def long_tailed_lengths(rows: int, seed: int, median: float = 19.0, p90: float = 49.0, longest: int = 178,
                        shortest: int = 3) -> List[int]:
    """Words per row: log-normal with that median and 90th percentile, clipped to [shortest, longest]."""
    sigma = math.log(p90 / median) / 1.2815515655446004  # z of the 90th percentile
    rng = random.Random(seed)
    return [min(longest, max(shortest, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(rows)]


def long_tailed_texts(rows: int, seed: int):
    """(texts, labels): the demo task's sentences, each extended with the words of further
    sentences (or cut) to its long-tailed length. A pure function of (rows, seed).
    """
    from dist_eval.demo import make_examples

    sentences, labels = make_examples(rows * 4, seed)
    texts = []
    for i, target in enumerate(long_tailed_lengths(rows, seed)):
        words, j = sentences[i].split(), i + rows
        while len(words) < target:
            words += sentences[j % len(sentences)].split()
            j += rows
        texts.append(" ".join(words[:target]))
    return texts, labels[:rows]


def make_data(folder: str, rows: int, seed: int) -> dict:
    import datasets

    from dist_eval.demo import LABEL_NAMES

    texts, labels = long_tailed_texts(rows, seed)
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=list(LABEL_NAMES))}
    )
    datasets.Dataset.from_dict({"text": texts, "label": labels}, features=features).save_to_disk(folder)
    words = sorted(len(t.split()) for t in texts)
    return {"rows": rows, "seed": seed, "words_median": statistics.median(words),
            "words_p90": words[int(0.9 * (len(words) - 1))], "words_max": words[-1], "words_min": words[0],
            "vocab": sorted({w for t in texts for w in t.split()})}  # fmt: skip


def save_tokenizer(folder: str, words: List[str]) -> int:
    """A word-level tokenizer of ``words`` (pad id 0, nothing added around the text); its vocab size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", padding_side="right",
                                   model_max_length=4096)
    fast.save_pretrained(folder)
    return len(vocab)


def save_model(folder: str, size: str, vocab_size: int, device: str, dtype: str, seed: int) -> dict:
    """A random Llama of ``size`` (built on ``device``, saved in ``dtype``); its facts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(MODEL_SIZES[size])
    shape["vocab_size"] = max(shape["vocab_size"], vocab_size)
    config = LlamaConfig(**shape, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=getattr(torch, dtype)).cpu()
    model.save_pretrained(folder, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the servers and the in-process runs get the GPU's memory
    return {"size": size, "parameters": params, "dtype": dtype, **shape}


def save_checkpoint(path: str, hidden: int, num_labels: int, seed: int) -> str:
    """Random prompts (``PRE_SEQ_LEN`` vectors) and a random head, in dist_eval's checkpoint format."""
    import torch

    from dist_eval.backends.checkpoint import save_checkpoint as save

    g = torch.Generator().manual_seed(seed + 1)
    tensors = {"score.weight": torch.randn(num_labels, hidden, generator=g),
               "prompt_embeddings.weight": 0.02 * torch.randn(PRE_SEQ_LEN, hidden, generator=g)}  # fmt: skip
    save(path, "ptune", tensors)
    return path


def prepare_assets(workdir: str, args, device: str) -> Assets:
    from dist_eval.demo import LABEL_NAMES

    dtype = args.dtype if args.dtype != "auto" else ("float16" if device == "cuda" else "float32")
    data = make_data(os.path.join(workdir, "data"), args.rows, args.seed)
    model_dir = os.path.join(workdir, f"llama-{args.model_size}")
    vocab_size = save_tokenizer(model_dir, data.pop("vocab"))
    model = save_model(model_dir, args.model_size, vocab_size, device, dtype, args.seed)
    checkpoint = save_checkpoint(os.path.join(workdir, "ptune.pt"), model["hidden_size"], len(LABEL_NAMES), args.seed)
    return Assets(model_dir, os.path.join(workdir, "data"), checkpoint, dtype, model, data)


# ------------------------------------------------------------------------------ processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    """This environment, offline, with the project importable (kept after what PYTHONPATH holds,
    e.g. a GPU machine's stubs and wheel folder)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if ROOT not in paths:
        paths.append(ROOT)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(paths)}


def run_command(cmd: List[str], log_path: str, timeout: float) -> float:
    """Run ``cmd`` in its own session, output to ``log_path``; its wall seconds. Whatever ends
    the wait (timeout, Ctrl-C, SIGTERM, an error), its whole process group is stopped: SIGTERM
    (torchrun passes it to its ranks), then SIGKILL after 10 s.
    """
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except BaseException:
            _stop_group(proc)
            raise
    wall = time.perf_counter() - started
    if code != 0:
        with open(log_path, errors="replace") as f:
            lines = [line for line in f.read().splitlines() if line.strip() and not line.startswith("=" * 20)]
        errors = [line for line in lines if "error" in line.lower() and "error_file" not in line
                  and "errors.html" not in line]  # fmt: skip
        tail = "\n".join((errors or lines)[-8:])[-1500:]
        raise RuntimeError(f"{shlex.join(cmd[:6])} ... exited {code} (log {log_path}; --keep keeps it):\n{tail}")
    return wall


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # the leader is gone; ranks it left behind in its group are not
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _raise_on_signal(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)  # unwinds: commands, swarm and temp folder go


# ------------------------------------------------------------------------------ configurations


def build_configs(args) -> List[Config]:
    extra = shlex.split(args.dist_eval_args)
    suffix = f", {args.dist_eval_args}" if extra else ", defaults"
    configs = [Config(f"{SEEDS_LOOP}, batch {b}", "seeds", batch_size=b) for b in args.seeds_batches]
    configs += [Config(f"dist_eval N={n}{suffix}", "dist_eval", ranks=n, flags=extra) for n in args.ranks]
    configs += [
        Config(f"{IN_PROCESS}, batch {b}, cap {c or 'none'}", "inprocess", batch_size=b, max_batch_tokens=c,
               threads=args.inprocess_threads)
        for b, c in args.inprocess_plans
    ]
    if args.own_swarm_ranks:
        n = args.own_swarm_ranks
        configs.append(Config(f"dist_eval N={n}, own swarm (no --initial-peers)", "own_swarm", ranks=n))
    return configs


def config_command(config: Config, assets: Assets, swarm, out_dir: str, device: str) -> List[str]:
    py = sys.executable
    if config.kind == "seeds":
        return [py, os.path.join(ROOT, "benchmarks", "plain_loop.py"), assets.model_dir, assets.data_dir,
                assets.checkpoint, os.path.join(out_dir, "result.json"), "--initial-peers", *swarm.initial_peers,
                "--dht-prefix", swarm.dht_prefix, "--batch-size", str(config.batch_size)]  # fmt: skip
    if config.kind == "inprocess":
        return [py, os.path.join(ROOT, "benchmarks", "inprocess_loop.py"), assets.model_dir, assets.data_dir,
                assets.checkpoint, os.path.join(out_dir, "result.json"), "--device", device, "--dtype", assets.dtype,
                "--batch-size", str(config.batch_size), "--max-batch-tokens", str(config.max_batch_tokens),
                "--threads", str(config.threads)]  # fmt: skip
    cmd = [py, "-m", "torch.distributed.run", "--nproc_per_node", str(config.ranks), "--master_port",
           str(_free_port()), "-m", "dist_eval", "--model", assets.model_dir, "--data-files", assets.data_dir,
           "--checkpoint", assets.checkpoint, "--output-dir", out_dir, *config.flags]  # fmt: skip
    if config.kind == "dist_eval":
        cmd += ["--initial-peers", *swarm.initial_peers, "--dht-prefix", swarm.dht_prefix]
    return cmd


def read_result(config: Config, out_dir: str) -> dict:
    """(rows, loop seconds, predictions in row order) of a finished configuration."""
    if config.kind in ("seeds", "inprocess"):
        with open(os.path.join(out_dir, "result.json")) as f:
            facts = json.load(f)
        kept = ("num_samples", "eval_loop_seconds", "preds", "num_batches", "padded_over_real_tokens", "device_name")
        return {k: facts[k] for k in kept if k in facts}
    with open(os.path.join(out_dir, "metrics.json")) as f:
        metrics = json.load(f)
    rows = {}
    with open(os.path.join(out_dir, "predictions.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            rows[record["index"]] = record["pred"]
    run = metrics["run"]
    return {"num_samples": metrics["num_samples"], "eval_loop_seconds": run["eval_loop_seconds"],
            "preds": [rows[i] for i in range(len(rows))], "phase_seconds": run.get("phase_seconds")}  # fmt: skip


def run_config(config: Config, assets: Assets, swarm, workdir: str, device: str, timeout: float) -> dict:
    out_dir = os.path.join(workdir, "runs", f"{len(os.listdir(os.path.join(workdir, 'runs'))):03d}")
    os.makedirs(out_dir)
    cmd = config_command(config, assets, swarm, out_dir, device)
    wall = run_command(cmd, os.path.join(out_dir, "log.txt"), timeout)
    result = read_result(config, out_dir)
    result.update(wall_seconds=wall, samples_per_second=result["num_samples"] / result["eval_loop_seconds"])
    return result


# ------------------------------------------------------------------------------ summary


def summarize(configs: List[Config]) -> List[dict]:
    """One row per configuration: median/min/max samples/s, x the seeds' loop, % of in-process,
    agreement with the in-process predictions (of its first run at the reference plan).
    """
    def median_rate(config: Config) -> float:
        return statistics.median(r["samples_per_second"] for r in config.runs) if config.runs else math.nan

    seeds = next(c for c in configs if c.kind == "seeds")
    inproc = next(c for c in configs if c.kind == "inprocess")
    seeds_rate, inproc_rate = median_rate(seeds), median_rate(inproc)
    reference = inproc.runs[0]["preds"] if inproc.runs else None
    rows = []
    for c in configs:
        if not c.runs:
            rows.append({"name": c.name, "kind": c.kind, "failed": c.failures})
            continue
        rates = [r["samples_per_second"] for r in c.runs]
        agree = [_agreement(r["preds"], reference) for r in c.runs]
        rate = statistics.median(rates)
        rows.append({
            "name": c.name, "kind": c.kind, "ranks": c.ranks, "flags": c.flags, "samples_per_second": rate,
            "min": min(rates), "max": max(rates), "x_seeds": rate / seeds_rate, "of_in_process": rate / inproc_rate,
            "agreement": min(agree), "wall_seconds": statistics.median(r["wall_seconds"] for r in c.runs),
            "runs": [{k: v for k, v in r.items() if k != "preds"} for r in c.runs], "failed": c.failures,
        })  # fmt: skip
    return rows


def _agreement(preds: List[int], reference) -> float:
    """Share of rows predicted as the in-process model does (NaN without a reference)."""
    if reference is None:
        return math.nan
    if len(preds) != len(reference):
        raise RuntimeError(f"{len(preds)} predictions, the in-process run has {len(reference)}")
    return sum(a == b for a, b in zip(preds, reference)) / len(reference)


def format_table(rows: List[dict]) -> str:
    head = (f"{'configuration':<46} {'samples/s':>9} {'min-max':>13} {'x seeds':>7} {'% in-proc':>9} "
            f"{'agree %':>8} {'wall s':>7}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        if "samples_per_second" not in r:
            lines.append(f"{r['name']:<46} {'failed (see the log above and the JSON)':>58}")
            continue
        spread = f"{r['min']:.0f}-{r['max']:.0f}"
        lines.append(
            f"{r['name']:<46} {r['samples_per_second']:9.1f} {spread:>13} {r['x_seeds']:7.2f} "
            f"{100 * r['of_in_process']:8.0f}% {100 * r['agreement']:8.2f} {r['wall_seconds']:7.1f}"
        )
    return "\n".join(lines)


def best_line(rows: List[dict]) -> str:
    ours = [r for r in rows if r["kind"] == "dist_eval" and "samples_per_second" in r]
    if not ours:
        return ""
    best = max(ours, key=lambda r: r["samples_per_second"])
    return (f"best dist_eval against this swarm: {best['name']}, {best['x_seeds']:.2f}x the seeds' loop, "
            f"{100 * best['of_in_process']:.0f}% of the in-process rate at dist_eval's batch plan")


def machine_info(device: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    info = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "device": device, "gpu": None, "gpu_count": 0, "cuda": torch.version.cuda}  # fmt: skip
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count())
    for package in ("torch", "transformers", "petals", "hivemind", "tokenizers", "datasets"):
        try:
            info[package] = version(package)
        except PackageNotFoundError:
            info[package] = None
    return info


# ------------------------------------------------------------------------------ main


def run_all(args, device: str, workdir: str, done: dict, started: float) -> dict:
    """Everything, against one swarm; ``done`` filled as it goes (assets, configs, swarm facts, the runs cut by
    --time-budget), so that an interrupted run's report still holds the runs finished."""
    from dist_eval.swarm import LocalSwarm

    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    assets = done["assets"] = prepare_assets(workdir, args, device)
    say(f"model {assets.model['parameters'] / 1e6:.1f}M parameters ({assets.dtype}), data {assets.data}")
    configs = done["configs"] = build_configs(args)
    cut = done["cut_by_time_budget"] = []
    os.makedirs(os.path.join(workdir, "runs"), exist_ok=True)
    extra_server_args = shlex.split(args.server_args)
    # the swarm dist_eval starts itself (LocalSwarm's plan for the device), in the model's dtype
    swarm = LocalSwarm(assets.model_dir, num_servers=args.servers, device=device, torch_dtype=assets.dtype,
                       extra_server_args=extra_server_args, start_timeout=args.start_timeout)
    plan = swarm.server_plan
    say(f"starting a local swarm of {plan.num_servers} server(s), {plan.describe()} "
        f"{shlex.join(plan.server_args(0)[4:] + extra_server_args)} ...")
    with swarm:
        say(f"swarm ready in {swarm.start_seconds:.1f} s")
        done["swarm"] = {"servers": plan.num_servers, "devices": list(plan.devices), "torch_dtype": plan.torch_dtype,
                         "max_batch_size": plan.max_batch_size, "server_args": extra_server_args,
                         "start_seconds": swarm.start_seconds, "placement": swarm.placement}  # fmt: skip
        for repeat in range(args.repeats):
            for config in configs:
                if args.time_budget and config.runs:
                    ends = time.perf_counter() - started + config.runs[-1]["wall_seconds"] + 5.0
                    if ends > args.time_budget:
                        cut.append(f"{config.name} [{repeat + 1}/{args.repeats}]: would end at ~{ends:.0f} s")
                        say(f"  [{repeat + 1}/{args.repeats}] {config.name}: not started (--time-budget "
                            f"{args.time_budget:.0f} s: would end at ~{ends:.0f} s)")
                        continue
                swarm.check()
                try:
                    result = run_config(config, assets, swarm, workdir, device, args.run_timeout)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    config.failures.append(str(e))
                    say(f"  [{repeat + 1}/{args.repeats}] {config.name}: FAILED: {e}")
                    continue
                config.runs.append(result)
                say(f"  [{repeat + 1}/{args.repeats}] {config.name}: {result['samples_per_second']:.1f} samples/s "
                    f"(loop {result['eval_loop_seconds']:.2f} s, wall {result['wall_seconds']:.1f} s)")
    return done


def write_report(args, device: str, done: dict, interrupted: str = "") -> List[dict]:
    """The table to stdout and the JSON to --out, of the runs in ``done``; the summary rows."""
    rows = summarize(done["configs"])
    print(format_table(rows), flush=True)
    print(best_line(rows))
    report = {"machine": machine_info(device), "args": vars(args), "model": done["assets"].model,
              "data": done["assets"].data, "swarm": done.get("swarm"), "results": rows,
              "cut_by_time_budget": done.get("cut_by_time_budget", [])}  # fmt: skip
    if interrupted:
        report["interrupted"] = interrupted
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"wrote {args.out}")
    return rows


def main(argv=None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also where SIGINT was inherited ignored
    signal.signal(signal.SIGTERM, _raise_on_signal)
    device = resolve_device(args.device)
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        workdir_cm = _kept(args.keep)
    else:
        workdir_cm = tempfile.TemporaryDirectory(prefix="dist_eval-bench-gpu-")
    done: dict = {}
    try:
        with workdir_cm as workdir:
            run_all(args, device, workdir, done, started)
    except KeyboardInterrupt as e:
        print(f"bench_gpu: interrupted ({str(e) or 'SIGINT'}); the commands and the swarm it started are stopped",
              file=sys.stderr)
        if any(c.runs for c in done.get("configs", ())):  # the runs finished still reported
            write_report(args, device, done, interrupted=str(e) or "SIGINT")
        return 130
    rows = write_report(args, device, done)
    if any(r["failed"] for r in rows):
        print("FAILED: some runs failed (see above)", file=sys.stderr)
        return 1
    if done["assets"].dtype == "float32" and any(r["agreement"] != 1.0 for r in rows):
        print("FAILED: in float32 every configuration must give the in-process predictions", file=sys.stderr)
        return 1
    return 0


class _kept:
    """A work folder that stays (``--keep``)."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, *exc) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
