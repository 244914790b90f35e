"""The same model in-process (dist_eval's local backend, on a GPU or the CPU) at dist_eval's batch plan.

One process, no swarm: every row is tokenized and batched exactly as dist_eval plans its
batches (``dist_eval.data``'s ``tokenize_rows`` + ``plan_batches``: length buckets, at most
``--batch-size`` rows and ``--max-batch-tokens`` padded tokens counting the prompt vectors;
dist_eval's defaults unless told), right-padded, no mask, one batch at a time. The timed loop
includes tokenizing and planning, as dist_eval's ``eval_loop_seconds`` does; one untimed
warm-up pass over the two biggest batches comes first (CUDA start-up, kernel selection).

    python benchmarks/inprocess_loop.py MODEL_DIR DATA_DIR CHECKPOINT OUT_JSON [--device cuda] [--dtype float16]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from dist_eval.config import DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_LENGTH, Settings
from dist_eval.data import TaskColumns, plan_batches, right_pad, tokenize_rows


def plan_like_dist_eval(
    tokenizer, dataset, prefix_tokens: int, pad_token_id: int, batch_size: int = DEFAULT_BATCH_SIZE,
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, max_length: int = DEFAULT_MAX_LENGTH,
):
    """(token ids of every row, the global batch plan): dist_eval's, for these settings
    (``max_batch_tokens`` 0: no cap). The same functions dist_eval runs, on the whole set.
    """
    settings = Settings(batch_size=batch_size, max_length=max_length, max_batch_tokens=max_batch_tokens or None)
    rows = np.arange(len(dataset), dtype=np.int64)
    ids, _ = tokenize_rows(tokenizer, dataset, rows, TaskColumns.of(settings), max_length, pad_token_id)
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    plan = plan_batches(
        len(ids), settings.batch_size, lengths, settings.max_batch_tokens,
        length_buckets=settings.length_buckets, prefix_tokens=prefix_tokens,
    )
    return ids, plan


def run_plan(module, ids, plan, pad_token_id: int, preds: np.ndarray) -> None:
    import torch

    with torch.no_grad():
        for rows in plan:
            logits = module(right_pad([ids[r] for r in rows.tolist()], pad_token_id))
            preds[rows] = logits.argmax(-1).cpu().numpy()  # .cpu() waits for the GPU


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("data_dir")
    p.add_argument("checkpoint")
    p.add_argument("out_json")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS, help="0: no cap")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args()

    import datasets
    import torch
    from transformers import AutoTokenizer

    from dist_eval.backends import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = load_model("local", args.model_dir, checkpoint=args.checkpoint, device=args.device)
    module = model.module.to(getattr(torch, args.dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    dataset = datasets.load_from_disk(args.data_dir)
    plan_args = (tokenizer, dataset, model.prompt_tokens, model.pad_token_id, args.batch_size, args.max_batch_tokens)
    preds = np.full(len(dataset), -1, dtype=np.int64)
    ids, plan = plan_like_dist_eval(*plan_args)
    run_plan(module, ids, plan[:2], model.pad_token_id, preds)  # warm-up, untimed

    loop_start = time.perf_counter()
    ids, plan = plan_like_dist_eval(*plan_args)
    run_plan(module, ids, plan, model.pad_token_id, preds)
    loop_seconds = time.perf_counter() - loop_start
    real = sum(len(x) for x in ids)
    padded = sum(len(rows) * max(len(ids[r]) for r in rows.tolist()) for rows in plan)
    device = str(next(module.parameters()).device)
    with open(args.out_json, "w") as f:
        json.dump({
            "num_samples": len(dataset), "eval_loop_seconds": loop_seconds, "setup_seconds": loop_start - started,
            "num_batches": len(plan), "padded_over_real_tokens": padded / real, "device": device,
            "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
            "dtype": args.dtype, "preds": preds.tolist(),
        }, f)  # fmt: skip


if __name__ == "__main__":
    main()
