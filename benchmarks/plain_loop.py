"""The baseline: the evaluation loop of Petals' prompt-tuning tutorial, as users write it.

One process, a fixed batch size, dataset order, tokenisation inside the loop, one
``model(input_ids)`` at a time under ``torch.no_grad()``. (The tutorial also passes the
attention mask; the petals client refuses a padded one, so the batch is right-padded and
the mask left out, which is what dist_eval does too.)

``--client petals`` (the default): petals' own ``AutoDistributedModelForSequenceClassification``
with its default client settings, as a user of the tutorial has it; the trained prompts and
head are copied into it from the checkpoint. ``--client dist_eval``: the same loop through
``dist_eval.load_model`` (the client dist_eval drives: its request sizing and wire
protocol, failover settings), which is how this baseline ran until 2026-11-23 (benchmarks/RESULTS.md).

    python benchmarks/plain_loop.py MODEL_DIR DATA_DIR CHECKPOINT OUT_JSON --initial-peers ... --dht-prefix NAME
"""
import argparse
import json
import time


def petals_client(model_dir, checkpoint, initial_peers, dht_prefix):
    """(model, close): petals' own client of the swarm, with the checkpoint's prompts and head."""
    import torch

    from dist_eval.backends.checkpoint import load_checkpoint
    from dist_eval.backends.config_json import family_of_folder
    from dist_eval.backends.petals.backend import _load_trainable
    from dist_eval.backends.petals.helpers import shutdown_petals_client
    from dist_eval.backends.petals.shims import import_petals
    from dist_eval.backends.petals_folder import petals_model_folder

    import_petals()  # hivemind 1.1.12 compatibility: every petals process needs it
    import petals

    family = family_of_folder(model_dir)
    state = load_checkpoint(checkpoint, family)
    model = petals.AutoDistributedModelForSequenceClassification.from_pretrained(
        petals_model_folder(model_dir), initial_peers=initial_peers, dht_prefix=dht_prefix, num_labels=state.num_labels,
        tuning_mode=state.tuning_mode, pre_seq_len=state.pre_seq_len, torch_dtype=torch.float32,
    )  # fmt: skip
    _load_trainable(model, state, family)
    model.eval()
    manager = family.get(model, family.blocks).sequence_manager
    return (lambda input_ids: model(input_ids=input_ids).logits), (lambda: shutdown_petals_client(manager))


def dist_eval_client(model_dir, checkpoint, initial_peers, dht_prefix):
    from dist_eval.backends import load_model

    model = load_model("petals", model_dir, checkpoint=checkpoint, initial_peers=initial_peers, dht_prefix=dht_prefix)
    return model.module, model.close


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("data_dir")
    p.add_argument("checkpoint")
    p.add_argument("out_json")
    p.add_argument("--initial-peers", nargs="+", required=True)
    p.add_argument("--dht-prefix", required=True)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--client", choices=("petals", "dist_eval"), default="petals")
    args = p.parse_args()

    import datasets
    import torch
    from transformers import AutoTokenizer

    started = time.perf_counter()
    load = petals_client if args.client == "petals" else dist_eval_client
    forward, close = load(args.model_dir, args.checkpoint, args.initial_peers, args.dht_prefix)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer.padding_side = "right"
    data = datasets.load_from_disk(args.data_dir)
    texts, labels = list(data["text"]), list(data["label"])

    loop_start, loop_cpu_start = time.perf_counter(), time.process_time()
    preds = []
    with torch.no_grad():
        for start in range(0, len(texts), args.batch_size):
            batch = tokenizer(texts[start : start + args.batch_size], padding=True, return_tensors="pt")
            logits = forward(batch["input_ids"])
            preds.extend(logits.argmax(-1).tolist())
    loop_seconds, loop_cpu_seconds = time.perf_counter() - loop_start, time.process_time() - loop_cpu_start
    close()
    accuracy = sum(int(p == y) for p, y in zip(preds, labels)) / len(labels)
    with open(args.out_json, "w") as f:
        json.dump({"num_samples": len(texts), "eval_loop_seconds": loop_seconds, "loop_cpu_seconds": loop_cpu_seconds,
                   "setup_seconds": loop_start - started, "accuracy": accuracy, "client": args.client,
                   "preds": preds}, f)


if __name__ == "__main__":
    main()
