"""Issue 72's families on dist_eval's own swarm, end to end: torchrun N=2 against local N=1 and transformers 5.x.

    .venv/bin/python benchmarks/families_swarm.py [REFERENCE_FOLDER] [--only NAME[,NAME...]] [--one-block-each]

REFERENCE_FOLDER: a folder tests/reference/make_reference.py filled on transformers 5.x (a test run's ``reference5*``
folder); without it one is made (about a minute), in .venv-reference5 where ``./launch/install_reference.sh 5`` made
it, else in this Python (launch/install.sh's stack is 5.x). Each family is the suite's tiny model of it (hidden 64,
2-4 blocks, saved by transformers 5.x), read from its folder as released: Qwen3.5 dense and MoE in the vision-language
layout (the text model under ``model.language_model.``), Qwen3-Next, MiniMax-M2 in bf16 and in FP8 tiles, GLM-5
(``glm_moe_dsa``), DeepSeek-V3.2 in FP8 tiles, gpt-oss with MXFP4 experts, Kimi K2.5 with INT4 pack-quantized experts,
DeepSeek-V4 in FP8 tiles + FP4 experts (each quantized folder dequantized as each process loads). Each on the
reference corpus's 16 rows, batch size 4, with the reference's trained prompts and head (ptune; ``--checkpoint`` of
the prompts beside ``--head`` where transformers has no ``*ForSequenceClassification``), DeepSeek-V4 with its head
alone (``--head``: its hash-routed blocks refuse prompts) and again with the reference's label words (zero-shot, its
LM head ``head.weight``). ``--only``: those rows of the table alone (their names).

Runs per family, each process one thread, the row store off:

1. local N=1: ``--backend local``, one process: the baseline;
2. own swarm: ``--backend petals`` on torchrun N=2, the run's own swarm (``--local-servers 2``: 2 servers, each of
   every block), ``--audit 1``: every request replayed on the other server;
3. with ``--one-block-each``: torchrun N=2 against a swarm started here of one server a block (``--initial-peers``):
   the hidden states (DeepSeek-V4's streams, flat; its token ids to the hash-routed blocks' spans) cross every
   server.

Prints one line per run as it ends, then one table side by side: per family, the wall seconds, whether the swarm's
predictions.jsonl (every row's logits) and metrics.json without its "run" part equal local N=1's bit for bit, max
|logits - transformers 5.x's own| (the reference logits recorded with the tiny models), and the audit. Exits 1 where
a swarm run differs from local N=1 at all, or a run is 1e-4 or more from transformers. The suite checks every
family's server blocks in-process against the local blocks and runs a swarm case for some
(tests/test_families_reference.py's SWARM_CASES); these whole runs are left out of it for its time budget.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # this tree's dist_eval (its checkpoint writer, LocalSwarm), as its runs' PYTHONPATH
os.environ["DIST_EVAL_ROW_STORE"] = "off"  # every row computed afresh, in each run
os.environ["OMP_NUM_THREADS"] = "1"  # the servers' threads too (LocalSwarm's processes inherit it)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
TOLERANCE = 1e-4  # issue 72's bound against transformers' own logits
# (row name, reference case, folder as released, what is scored): issue 72's families, most served first
RUNS = (
    ("qwen3_5_moe", "qwen3_5_moe", "qwen3_5_moe", "ptune"),
    ("qwen3_5", "qwen3_5", "qwen3_5", "ptune"),
    ("qwen3_next", "qwen3_next", "qwen3_next", "ptune"),
    ("minimax_m2", "minimax_m2", "minimax_m2", "ptune"),
    ("minimax_m2_fp8", "minimax_m2", "minimax_m2_fp8", "ptune"),
    ("glm_moe_dsa", "glm_moe_dsa", "glm_moe_dsa", "ptune"),
    ("deepseek_v32_fp8", "deepseek_v32", "deepseek_v32_fp8", "ptune"),
    ("gpt_oss_mxfp4", "gpt_oss", "gpt_oss_mxfp4", "ptune"),
    ("kimi_k25_int4", "kimi_k25", "kimi_k25_int4", "ptune"),
    ("deepseek_v4_fp8", "deepseek_v4", "deepseek_v4_fp8", "head"),
    ("deepseek_v4_fp8_label_words", "deepseek_v4", "deepseek_v4_fp8", "label_words"),
)
# no *ForSequenceClassification in transformers: the head given apart (--head), as tests/test_families_reference.py's
HEAD_ONLY = ("minimax_m2", "glm_moe_dsa", "deepseek_v32", "kimi_k25", "deepseek_v4")
REFERENCE_LOGITS = {"ptune": "logits_ptune", "head": "logits_head", "label_words": "logits_label_words"}
PREFIX = "bench-families"


def reference(out: str) -> dict:
    """reference.json of ``out``, made there by tests/reference/make_reference.py unless it is: in .venv-reference5
    (launch/install_reference.sh 5; DIST_EVAL_REFERENCE5_VENV moves it) where that is made, else in this Python,
    whose transformers is 5.x where launch/install.sh made it (the suite makes its generation-5 reference there
    too), refused unless that Python's transformers is 5.x. main() refuses a folder made by another major."""
    if not os.path.exists(os.path.join(out, "reference.json")):
        made = os.path.join(os.environ.get("DIST_EVAL_REFERENCE5_VENV", os.path.join(REPO, ".venv-reference5")),
                            "bin", "python")
        python = made if os.path.exists(made) else sys.executable
        found = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('transformers'))"],
                               capture_output=True, text=True).stdout.strip()
        if not found.startswith("5."):  # said now, not after the minute making it takes
            sys.exit(f"families_swarm.py: the reference is made by transformers 5.x; {python} has {found or 'none'}: "
                     "run ./launch/install.sh (or ./launch/install_reference.sh 5) first")
        subprocess.run([python, os.path.join(REPO, "tests", "reference", "make_reference.py"), out], check=True,
                       capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    with open(os.path.join(out, "reference.json"), encoding="utf-8") as f:
        return json.load(f)


def inputs(out: str, ref: dict, work: str, kind: str, folder: str, scored: str) -> list:
    """The flags every run of a family shares: its folder, the corpus's rows (labels i % 3), what is scored: the
    trained prompts and head (a dist_eval checkpoint of both; for a family without a sequence classifier the prompts
    alone beside ``--head``), the head alone, or the reference's label words."""
    from safetensors.torch import load_file, save_file

    from dist_eval.backends.checkpoint import save_checkpoint

    rows = os.path.join(work, "rows.jsonl")
    with open(rows, "w", encoding="utf-8") as f:
        for i, text in enumerate(ref["corpus"]):
            f.write(json.dumps({"text": text, "label": i % 3}, ensure_ascii=False) + "\n")
    trainable = load_file(os.path.join(out, f"{kind}.trainable.safetensors"))
    head, prompts = os.path.join(work, "head.safetensors"), os.path.join(work, "prompts.safetensors")
    if scored == "label_words":
        flags = ["--label-words", *ref["cases"][kind]["label_words"]]
    elif kind not in HEAD_ONLY:
        path = os.path.join(work, "ptune.pt")
        save_checkpoint(path, "ptune", trainable)
        flags = ["--checkpoint", path]
    else:
        save_file({"score.weight": trainable["score.weight"]}, head)
        flags = ["--head", head]
        if scored == "ptune":
            save_file({"prompt_embeddings.weight": trainable["prompt_embeddings.weight"]}, prompts)
            flags += ["--checkpoint", prompts]
    return ["--model", os.path.join(out, folder), "--data-files", rows, *flags, "--batch-size", "4", "--save-logits",
            "--quiet"]


def run(args: list, nproc: int) -> float:
    """The CLI on ``nproc`` torchrun ranks (0: one plain process); its wall seconds. Fails loudly."""
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *(launcher if nproc else []), "-m", "dist_eval", *args], cwd=REPO,
                          env=ENV, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"dist_eval {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return time.perf_counter() - start


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def outputs(folder: str) -> tuple:
    """(predictions.jsonl's rows, metrics.json without its "run" part, that "run" part)."""
    with open(os.path.join(folder, "predictions.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(folder, "metrics.json"), encoding="utf-8") as f:
        metrics = json.load(f)
    return rows, {k: v for k, v in metrics.items() if k != "run"}, metrics.get("run", {})


def figures(seconds: float, folder: str, local: tuple, expected: np.ndarray) -> dict:
    """One swarm run's figures against local N=1's and transformers'."""
    rows, metrics, run_part = outputs(folder)
    logits = np.array([row["logits"] for row in rows])
    swarm = run_part.get("swarm", {})
    return {"seconds": seconds, "predictions": rows == local[0], "metrics": metrics == local[1],
            "max_local": float(np.abs(logits - np.array([r["logits"] for r in local[0]])).max()),
            "max_reference": float(np.abs(logits - expected).max()), "audit": audited(swarm.get("audit") or {}),
            "servers": [(s.get("petals_version"), s.get("blocks")) for s in swarm.get("servers", [])]}


def audited(audit: dict) -> str:
    """The audit's requests replayed on another server and what they found, in a few words."""
    if not audit:
        return "-"
    mismatches = sum(server.get("mismatches", 0) for server in audit.get("servers", {}).values())
    gaps = sorted(audit.get("coverage_gaps", {}))
    return (f"{audit.get('replayed')} of {audit.get('requests')} replayed, {audit.get('replays_failed')} failed, "
            f"{mismatches} mismatches, max diff {audit.get('max_difference')}"
            + (f", blocks held once {gaps}" if gaps else ""))


def one_family(out: str, ref: dict, name: str, kind: str, folder: str, scored: str, one_block_each: bool) -> dict:
    """Local N=1, the run's own swarm and (``one_block_each``) a swarm of one server a block, for one row."""
    from dist_eval.swarm import LocalSwarm

    expected = np.array(ref["cases"][kind][REFERENCE_LOGITS[scored]])
    work = tempfile.mkdtemp(prefix=f"families-swarm-{name}-")
    common = inputs(out, ref, work, kind, folder, scored)
    seconds = run([*common, "--output-dir", os.path.join(work, "local"), "--backend", "local"], 0)
    local = outputs(os.path.join(work, "local"))
    result = {"local": {"seconds": seconds, "max_reference": float(np.abs(
        np.array([r["logits"] for r in local[0]]) - expected).max())}, "work": work}
    own = [*common, "--output-dir", os.path.join(work, "own"), "--local-servers", "2", "--audit", "1"]
    result["own"] = figures(run(own, 2), os.path.join(work, "own"), local, expected)
    if one_block_each:
        blocks = LocalSwarm(os.path.join(out, folder), num_servers=1).num_blocks  # nothing started
        with LocalSwarm(os.path.join(out, folder), num_servers=blocks, blocks_per_server=1,
                        dht_prefix=PREFIX) as swarm:
            peers = ["--initial-peers", *swarm.initial_peers, "--dht-prefix", PREFIX]
            split = [*common, "--output-dir", os.path.join(work, "split"), *peers]
            result["split"] = figures(run(split, 2), os.path.join(work, "split"), local, expected)
    return result


def table(results: dict) -> str:
    """The runs side by side, one row a family, in markdown."""
    split = any("split" in r for r in results.values())
    head = ["family (folder as released)", "local N=1 s", "own swarm N=2 s", "predictions.jsonl == local N=1",
            "metrics.json (no `run`) == local N=1", "max \\|logits - 5.x\\| local / swarm", "audit (own swarm)"]
    head += ["one server a block N=2 s", "== local N=1 (predictions, metrics)"] if split else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        own = r["own"]
        cells = [name, f"{r['local']['seconds']:.1f}", f"{own['seconds']:.1f}", yes(own["predictions"]),
                 yes(own["metrics"]), f"{r['local']['max_reference']:.1e} / {own['max_reference']:.1e}", own["audit"]]
        if split:
            s = r.get("split")
            cells += [f"{s['seconds']:.1f}", f"{yes(s['predictions'])}, {yes(s['metrics'])}"] if s else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def yes(flag: bool) -> str:
    return "yes, bit for bit" if flag else "**no**"


def main(out: str, only: list, one_block_each: bool) -> None:
    ref = reference(out)
    if not ref["versions"]["transformers"].startswith("5."):
        made_by = ref["versions"]["transformers"]
        sys.exit(f"families_swarm.py: the reference in {out} was made by transformers {made_by}; these families "
                 "need 5.x: run ./launch/install.sh (or ./launch/install_reference.sh 5) and give another "
                 "REFERENCE_FOLDER, or none")
    print(f"transformers {ref['versions']['transformers']}, torch {ref['versions']['torch']}, reference folder {out}",
          flush=True)
    results, good = {}, True
    for name, kind, folder, scored in RUNS:
        if only and name not in only:
            continue
        r = results[name] = one_family(out, ref, name, kind, folder, scored, one_block_each)
        swarms = [r[key] for key in ("own", "split") if key in r]
        good &= all(s["predictions"] and s["metrics"] and s["max_reference"] < TOLERANCE for s in swarms)
        good &= r["local"]["max_reference"] < TOLERANCE
        print(f"{name}: local {r['local']['seconds']:.1f} s; " + "; ".join(
            f"{key} {s['seconds']:.1f} s, predictions == local {s['predictions']}, metrics == local {s['metrics']}, "
            f"max |logits - local| {s['max_local']:.1e}, servers {s['servers']}"
            for key, s in (("own swarm", r["own"]), ("one server a block", r.get("split"))) if s)
            + f"; outputs in {r['work']}", flush=True)
    print(table(results))
    if not good:
        sys.exit(f"a swarm run differs from local N=1, or a run is {TOLERANCE} or more from transformers")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reference_folder", nargs="?", help="a folder make_reference.py filled (default: one made)")
    parser.add_argument("--only", default="", help="comma-separated names of the table's rows to run (default: all)")
    parser.add_argument("--one-block-each", action="store_true", help="also a swarm of one server a block")
    given = parser.parse_args()
    named = [name for name in given.only.split(",") if name]
    unknown = sorted(set(named) - {row[0] for row in RUNS})
    if unknown:
        parser.error(f"--only: expected names of {[row[0] for row in RUNS]}, got {unknown}")
    main(given.reference_folder or tempfile.mkdtemp(prefix="families-reference-"), named, given.one_block_each)
