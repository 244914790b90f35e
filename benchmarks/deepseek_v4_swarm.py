"""DeepSeek-V4 on dist_eval's own swarm, end to end (issue 72): torchrun N=2 against local N=1 and transformers 5.x.

    ./launch/install_reference.sh 5
    .venv/bin/python benchmarks/deepseek_v4_swarm.py [REFERENCE_FOLDER] [--label-words]

REFERENCE_FOLDER: a folder tests/reference/make_reference.py filled in .venv-reference5 (a test run's
``reference5*`` folder); without it one is made (about a minute). The model is the suite's tiny DeepSeek-V4
(4 blocks: sliding, compressed sparse, heavily compressed, compressed sparse; the first two hash-routed), read as
released (``deepseek_v4_fp8``: FP8 tiles + FP4 experts, dequantized as each process loads), with its trained head
(``--head``) on the reference corpus's 16 rows, batch size 4; with ``--label-words``, zero-shot instead: the
reference's label words scored by its LM head (``head.weight``, the client's on a swarm), against transformers 5.x's
causal LM. Runs, each process one thread, the row store off:

1. ``local``: ``--backend local``, one process (N=1): the baseline;
2. ``own_swarm``: ``--backend petals`` on torchrun N=2, the run's own swarm (2 servers, each every block: a
   request's streams cross no server), ``--audit 1``: every request replayed on the other server, token ids too;
3. ``one_block_each``: torchrun N=2 against a swarm of 4 servers holding one block each (started here,
   ``--initial-peers``): the hc_mult streams cross three servers flat, the rows' token ids go to the spans of
   blocks 0 and 1 (hash-routed) alone.

Prints, per swarm run: its wall time, whether predictions.jsonl (every row's logits) and metrics.json without its
"run" part equal local N=1's bit for bit, max |logits - transformers 5.x's|, and the servers' announced versions
and blocks. Exits 1 where a swarm run differs from local at all. The suite checks the same blocks in-process
(tests/test_families_reference.py's server blocks test); this whole run is left out of it for the time budget.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = "deepseek_v4_fp8"  # the release's on-disk format; deepseek_v4 is the same model saved dequantized
PREFIX = "bench-deepseek-v4"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DIST_EVAL_ROW_STORE": "off",
       "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}


def reference(out: str) -> dict:
    """reference.json of ``out``, made there by tests/reference/make_reference.py in .venv-reference5 unless it is."""
    if not os.path.exists(os.path.join(out, "reference.json")):
        python = os.path.join(REPO, ".venv-reference5", "bin", "python")
        subprocess.run([python, os.path.join(REPO, "tests", "reference", "make_reference.py"), out], check=True,
                       capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    with open(os.path.join(out, "reference.json"), encoding="utf-8") as f:
        return json.load(f)


def inputs(out: str, ref: dict, work: str, label_words: bool) -> list:
    """The flags every run shares: the FP8 + FP4 folder, the corpus's rows (labels i % 3), the trained head (or the
    reference's label words)."""
    from safetensors.torch import load_file, save_file

    rows, head = os.path.join(work, "rows.jsonl"), os.path.join(work, "deepseek_v4.head.safetensors")
    with open(rows, "w", encoding="utf-8") as f:
        for i, text in enumerate(ref["corpus"]):
            f.write(json.dumps({"text": text, "label": i % 3}, ensure_ascii=False) + "\n")
    trainable = load_file(os.path.join(out, "deepseek_v4.trainable.safetensors"))
    save_file({"score.weight": trainable["score.weight"]}, head)
    scored = ["--label-words", *ref["cases"]["deepseek_v4"]["label_words"]] if label_words else ["--head", head]
    return ["--model", os.path.join(out, FOLDER), "--data-files", rows, *scored, "--batch-size", "4",
            "--save-logits", "--quiet"]


def run(args: list, nproc: int) -> float:
    """The CLI on ``nproc`` torchrun ranks (0: one plain process); its wall seconds. Fails loudly."""
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *(launcher if nproc else []), "-m", "dist_eval", *args], cwd=REPO,
                          env=ENV, capture_output=True, text=True, timeout=600)
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


def compare(name: str, seconds: float, folder: str, local: tuple, expected: np.ndarray) -> bool:
    """Print one swarm run's figures against local N=1's; whether it equals it bit for bit."""
    rows, metrics, run_part = outputs(folder)
    logits = np.array([row["logits"] for row in rows])
    swarm = run_part.get("swarm", {})
    servers = [(s.get("petals_version"), s.get("blocks")) for s in swarm.get("servers", [])]
    print(f"{name}: {seconds:.1f} s; predictions.jsonl == local N=1's: {rows == local[0]}; metrics.json (but "
          f"\"run\") == local N=1's: {metrics == local[1]}; max |logits - local| "
          f"{np.abs(logits - np.array([r['logits'] for r in local[0]])).max():.1e}; max |logits - transformers "
          f"5.x| {np.abs(logits - expected).max():.1e}; audit {audited(swarm.get('audit') or {})}; servers {servers}",
          flush=True)
    return rows == local[0] and metrics == local[1]


def audited(audit: dict) -> str:
    """The audit's requests replayed on another server and what they found, in one line."""
    mismatches = sum(server.get("mismatches", 0) for server in audit.get("servers", {}).values())
    return (f"share {audit.get('share')}, {audit.get('replayed')} of {audit.get('requests')} requests replayed, "
            f"{audit.get('join_probes')} join probes, {audit.get('replays_failed')} replays failed, {mismatches} "
            f"mismatches, max difference {audit.get('max_difference')}, blocks held once "
            f"{sorted(audit.get('coverage_gaps', {}))}")


def main(out: str, label_words: bool = False) -> None:
    from dist_eval.swarm import LocalSwarm

    ref = reference(out)
    expected = np.array(ref["cases"]["deepseek_v4"]["logits_label_words" if label_words else "logits_head"])
    print(f"transformers {ref['versions']['transformers']}, reference folder {out}, "
          f"{'label words' if label_words else '--head'}", flush=True)
    work = tempfile.mkdtemp(prefix="deepseek-v4-swarm-")
    common = inputs(out, ref, work, label_words)
    seconds = run([*common, "--output-dir", os.path.join(work, "local"), "--backend", "local"], 0)
    local = outputs(os.path.join(work, "local"))
    print(f"local N=1: {seconds:.1f} s; max |logits - transformers 5.x| "
          f"{np.abs(np.array([r['logits'] for r in local[0]]) - expected).max():.1e}", flush=True)
    own = [*common, "--output-dir", os.path.join(work, "own"), "--local-servers", "2", "--audit", "1"]
    same = [compare("own_swarm (N=2, 2 servers of every block, --audit 1)", run(own, 2), os.path.join(work, "own"),
                    local, expected)]
    os.environ["OMP_NUM_THREADS"] = "1"  # the servers' threads (the client's summation order, bit for bit)
    with LocalSwarm(os.path.join(out, FOLDER), num_servers=4, blocks_per_server=1, dht_prefix=PREFIX) as swarm:
        peers = ["--initial-peers", *swarm.initial_peers, "--dht-prefix", PREFIX]
        same.append(compare("one_block_each (N=2, 4 servers of one block)",
                            run([*common, "--output-dir", os.path.join(work, "split"), *peers], 2),
                            os.path.join(work, "split"), local, expected))
    print(f"outputs in {work}")
    if not all(same):
        sys.exit("a swarm run differs from local N=1")


if __name__ == "__main__":
    given = [arg for arg in sys.argv[1:] if arg != "--label-words"]
    main(given[0] if given else tempfile.mkdtemp(prefix="deepseek-v4-reference-"), "--label-words" in sys.argv[1:])
