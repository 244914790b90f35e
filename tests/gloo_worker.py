"""Worker for test_evaluation.py, run under torchrun (or, for one process, called in the test
process: :func:`main`).

It plays a training loop that owns its process group: it initialises gloo itself, then
calls dist_eval.evaluate() repeatedly (several dataset sizes and batch sizes), through
both the Dataset path and the DataLoader + DistributedSampler path. Rank 0 saves what
it got; every rank checks it received the same metrics. Given a second data file and
folder, the same launch then runs the seeds' loader cases (gloo_loader_worker.py) with the
same model: one launch per world size for both."""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist


def main(model_dir, checkpoint, csv_path, out_dir, loader_csv=None, loader_out=None):
    import datasets
    from transformers import AutoTokenizer

    from dist_eval import evaluate, load_model
    from dist_eval.data import right_pad

    if "RANK" in os.environ:
        dist.init_process_group("gloo")  # the caller's group, not dist_eval's
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = load_model("local", model_dir, checkpoint=checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    full = datasets.load_dataset("csv", data_files=csv_path, split="train")
    user_metrics = {"num_predicted_0": lambda labels, preds, logits: int((preds == 0).sum()),
                    "mean_max_logit": lambda labels, preds, logits: float(logits.max(axis=1).mean())}
    sample_metrics = {
        "correct_margin": lambda logits, labels: logits[np.arange(len(labels)), labels] - logits.max(axis=1)
    }
    for size in (1, 2, 3, 5, 7, 100):
        for batch_size in (1, 4, 16):
            data = full.select(range(size))
            result = evaluate(
                model,
                data,
                tokenizer=tokenizer,
                batch_size=batch_size,
                return_logits=True,
                metrics=user_metrics,
                sample_metrics=sample_metrics,
            )
            _save(out_dir, f"dataset_{size}_{batch_size}", result, rank)
        # the throughput options must not change any result: the plain path (dataset order,
        # one batch at a time), and a token budget with several batches in flight
        data = full.select(range(size))
        for name, options in (
            ("plain", dict(batch_size=4, length_buckets=False, in_flight=1)),
            ("budget", dict(max_batch_tokens=40, in_flight=3)),
        ):
            result = evaluate(model, data, tokenizer=tokenizer, return_logits=True, **options)
            _save(out_dir, f"{name}_{size}", result, rank)
        # DataLoader path: a DistributedSampler that pads its last round with repeats
        encoded = tokenizer(list(full.select(range(size))["text"]))["input_ids"]
        labels = np.asarray(full.select(range(size))["label"])
        items = [{"index": i, "ids": encoded[i], "label": int(labels[i])} for i in range(size)]
        sampler = torch.utils.data.DistributedSampler(items, shuffle=False) if dist.is_initialized() else None
        loader = torch.utils.data.DataLoader(
            items,
            batch_size=3,
            sampler=sampler,
            collate_fn=lambda b: {
                "index": torch.tensor([x["index"] for x in b]),
                "input_ids": right_pad([x["ids"] for x in b], 0),
                "labels": torch.tensor([x["label"] for x in b]),
            },
        )
        result = evaluate(model, loader, return_logits=True)
        _save(out_dir, f"loader_{size}", result, rank)
    # a user's metric that fails in a run that stops early: every rank fails at once, naming it (before,
    # rank 0 alone raised, and the other ranks waited in a broadcast until the group's timeout)
    _save_outcomes(out_dir, "stopping_metric_fails", rank, lambda: evaluate(
        model, full.select(range(40)), tokenizer=tokenizer, metrics={"broken": _broken_metric}, stop_at_width=0.5,
        stop_round_rows=16, bootstrap_resamples=0))
    # the same for a sample metric to stop on whose values leave [0, 1], found by rank 0 after the first round
    _save_outcomes(out_dir, "stop_metric_out_of_range", rank, lambda: evaluate(
        model, full.select(range(40)), tokenizer=tokenizer, stop_metric="twice", stop_at_width=0.5,
        stop_round_rows=16, bootstrap_resamples=0, sample_metrics={"twice": lambda logits, labels: labels * 0 + 2.0}))
    if loader_csv is not None:
        import gloo_loader_worker

        gloo_loader_worker.run_cases(model, model_dir, loader_csv, loader_out)
    if dist.is_initialized():
        dist.destroy_process_group()


def _broken_metric(labels, preds, logits):
    raise ValueError("the user's metric broke")


def _save_outcomes(out_dir, name, rank, call):
    """How ``call`` ended on each rank ("returned", or the exception's type and message), saved by rank 0."""
    try:
        call()
        outcome = "returned"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    everyone = [outcome]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, outcome)
    if rank == 0:
        with open(os.path.join(out_dir, name + ".json"), "w") as f:
            json.dump(everyone, f)


def _save(out_dir, name, result, rank):
    metrics = {k: v for k, v in result.metrics.items() if k != "run"}
    everyone = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(everyone, metrics)
    else:
        everyone = [metrics]
    if rank == 0:
        p = result.predictions
        np.savez(
            os.path.join(out_dir, name + ".npz"), indices=p.indices, labels=p.labels, preds=p.preds, logits=p.logits
        )
        with open(os.path.join(out_dir, name + ".json"), "w") as f:
            json.dump(
                {
                    "metrics": metrics,
                    "same_on_all_ranks": all(m == metrics for m in everyone),
                    "run": result.metrics["run"],
                },
                f,
            )
    else:
        assert result.predictions is None, "per-sample arrays must live on rank 0 only"


if __name__ == "__main__":
    main(*sys.argv[1:])
