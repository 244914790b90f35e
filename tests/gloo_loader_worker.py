"""The seeds' evaluation loop, for test_evaluation.py's loader test: run by gloo_worker.py in
the same launch as its own cases (under torchrun, or in the test process for one process).

Texts tokenized with padding="max_length" (right padding, attention_mask kept), labels, no
'index', a DataLoader with a DistributedSampler (shuffle on or off, set_epoch called) or a
plain DataLoader that every rank iterates whole. Rank 0 saves the merged predictions and
metrics of each case."""
import json
import os

import numpy as np
import torch
import torch.distributed as dist

SIZES = (1, 5, 7, 50)


def loaders(rows, distributed):
    collate = torch.utils.data.default_collate
    if distributed:
        for shuffle in (False, True):
            sampler = torch.utils.data.DistributedSampler(rows, shuffle=shuffle, seed=7)
            sampler.set_epoch(3)
            yield f"dist_shuffle{int(shuffle)}", torch.utils.data.DataLoader(
                rows, batch_size=4, sampler=sampler, collate_fn=collate)
    for shuffle in (False, True):  # every rank iterates the whole loader; unseeded shuffle
        yield f"plain_shuffle{int(shuffle)}", torch.utils.data.DataLoader(
            rows, batch_size=3, shuffle=shuffle, collate_fn=collate)


def run_cases(model, model_dir, csv_path, out_dir):
    """Every case, in the caller's process group (if any), with ``model`` (dist_eval's local one)."""
    import datasets
    from transformers import AutoTokenizer

    from dist_eval import evaluate

    rank = dist.get_rank() if dist.is_initialized() else 0
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "right"
    full = datasets.load_dataset("csv", data_files=csv_path, split="train")
    for size in SIZES:
        part = full.select(range(size))
        enc = tokenizer(list(part["text"]), padding="max_length", max_length=40, truncation=True)
        rows = [{"input_ids": torch.tensor(enc["input_ids"][i]),
                 "attention_mask": torch.tensor(enc["attention_mask"][i]),
                 "labels": int(part["label"][i])} for i in range(size)]
        for name, loader in loaders(rows, dist.is_initialized()):
            result = evaluate(model, loader, return_logits=True)
            if rank == 0:
                p = result.predictions
                np.savez(os.path.join(out_dir, f"{name}_{size}.npz"), indices=p.indices, labels=p.labels,
                         preds=p.preds, logits=p.logits)
                with open(os.path.join(out_dir, f"{name}_{size}.json"), "w") as f:
                    json.dump({k: v for k, v in result.metrics.items()}, f, default=str)
        if rank == 0:  # the uncut reference: each row alone at its full padded width
            with torch.no_grad():
                logits = [model.module(r["input_ids"][None]).float().numpy()[0] for r in rows]
            np.save(os.path.join(out_dir, f"uncut_{size}.npy"), np.stack(logits))
