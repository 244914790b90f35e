"""Peak memory of the local backend with its blocks streamed from disk (issue 73,
``dist_eval.backends.streamed``) against the in-memory local backend, on the same model and rows.

    .venv/bin/python benchmarks/bench_streamed_memory.py [--layers 8] [--hidden 512] [--rows 16] [--tokens 64]

Saves a random Llama ``*ForCausalLM`` (float32 safetensors) of ``--layers`` blocks, then, each in a fresh
process, loads it (``load_model("local", ...)``, streamed or whole) and computes the logits of ``--rows`` rows
of ``--tokens`` tokens. Each process reports its peak resident memory (``ru_maxrss``) above its resident
memory after the imports, and the logits' SHA-256 (the two must be equal: the same bits). Printed as JSON.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _status_mib() -> dict:
    """This process's resident memory now: anonymous (its own allocations) and file-backed (mapped files'
    pages, the page cache's: a weight file mapped to read a tensor), in MiB.
    """
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out


class PeakSampler:
    """The peak of RssAnon and RssFile, sampled every millisecond in a thread."""

    def __init__(self):
        import threading

        self.peak = _status_mib()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.wait(0.001):
            now = _status_mib()
            self.peak = {k: max(v, now.get(k, 0.0)) for k, v in self.peak.items()}

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def build(folder: str, layers: int, hidden: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dist_eval.backends.checkpoint import save_checkpoint

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    save_checkpoint(os.path.join(folder, "..", "ck.pt"), "ptune",
                    {"score.weight": torch.randn(3, hidden, generator=g),
                     "prompt_embeddings.weight": torch.randn(4, hidden, generator=g)})


def measure(folder: str, streamed: bool, rows: int, tokens: int) -> dict:
    import torch

    from dist_eval.backends import load_model

    torch.set_num_threads(1)
    # what the load and the forward import, before the baseline (the memory of code, not of weights): the
    # offload's hooks import torch._dynamo at their first call (accelerate's lazy torch.compiler.disable), ~64 MiB
    import accelerate  # noqa: F401
    import torch._dynamo  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import dist_eval.backends.local  # noqa: F401
    import dist_eval.backends.petals_folder  # noqa: F401

    ids = torch.randint(1, 1000, (rows, tokens), generator=torch.Generator().manual_seed(2))
    base = _status_mib()
    with PeakSampler() as sampler:
        model = load_model("local", folder, checkpoint=os.path.join(folder, "..", "ck.pt"), stream_blocks=streamed)
        loaded = _status_mib()
        with torch.no_grad():
            logits = model.module(ids)
        after = _status_mib()
    return {"streamed": streamed, "anon_after_imports_mib": round(base["RssAnon"], 1),
            "anon_held_after_load_mib": round(loaded["RssAnon"] - base["RssAnon"], 1),
            "anon_held_after_forward_mib": round(after["RssAnon"] - base["RssAnon"], 1),
            "anon_peak_above_imports_mib": round(sampler.peak["RssAnon"] - base["RssAnon"], 1),
            "file_backed_peak_mib": round(sampler.peak["RssFile"], 1),
            "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "logits_sha256": hashlib.sha256(logits.numpy().tobytes()).hexdigest()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--measure", choices=["whole", "streamed"], default=None)
    parser.add_argument("--folder", default=None)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.folder, args.measure == "streamed", args.rows, args.tokens)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "model")
        build(folder, args.layers, args.hidden)
        weights = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
                      if n.endswith(".safetensors"))
        out = {"layers": args.layers, "hidden": args.hidden, "rows": args.rows, "tokens": args.tokens,
               "weights_mib": round(weights / 2**20, 1), "block_mib": None, "runs": []}
        hidden, inter = args.hidden, args.hidden * 8 // 3
        out["block_mib"] = round((4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * 4 / 2**20, 1)
        for kind in ("whole", "streamed"):
            proc = subprocess.run([sys.executable, __file__, "--measure", kind, "--folder", folder, "--rows",
                                   str(args.rows), "--tokens", str(args.tokens)], capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
            out["runs"].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        out["same_logits"] = len({run["logits_sha256"] for run in out["runs"]}) == 1
        # the streamed peak in blocks, beyond what it holds after its load and the rows' activations (the
        # in-memory forward's own growth: the same computation on the same rows)
        whole, streamed = out["runs"]
        activations = whole["anon_peak_above_imports_mib"] - whole["anon_held_after_load_mib"]
        out["rows_activations_mib"] = round(activations, 1)
        out["streamed_peak_beyond_held_and_activations_blocks"] = round(
            (streamed["anon_peak_above_imports_mib"] - streamed["anon_held_after_load_mib"] - activations)
            / out["block_mib"], 2)
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
