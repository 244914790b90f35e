"""Worker for test_data_loader.py, run under torchrun (or plain python for one process).

It plays the seeds' evaluation loop: texts tokenized with padding="max_length" (right
padding, attention_mask kept), labels, no 'index', a DataLoader with a DistributedSampler
(shuffle on or off, set_epoch called) or a plain DataLoader that every rank iterates whole.
Rank 0 saves the merged predictions and metrics of each case."""
import json
import os
import sys

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


def main(model_dir, checkpoint, csv_path, out_dir):
    import datasets
    from transformers import AutoTokenizer

    from dist_eval import evaluate, load_model

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = load_model("local", model_dir, checkpoint=checkpoint)
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
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
