"""The baseline: the evaluation loop of Petals' prompt-tuning tutorial, as users write it.

One process, a fixed batch size, dataset order, tokenisation inside the loop, one
``model(input_ids)`` at a time under ``torch.no_grad()``. (The tutorial also passes the
attention mask; the petals client refuses a padded one, so the batch is right-padded and
the mask left out, which is what dist_eval does too.)

    python benchmarks/plain_loop.py MODEL_DIR DATA_DIR CHECKPOINT OUT_JSON --initial-peers ... --dht-prefix NAME
"""
import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("data_dir")
    p.add_argument("checkpoint")
    p.add_argument("out_json")
    p.add_argument("--initial-peers", nargs="+", required=True)
    p.add_argument("--dht-prefix", required=True)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()

    import datasets
    import torch
    from transformers import AutoTokenizer

    from dist_eval.backends import load_model

    started = time.perf_counter()
    model = load_model("petals", args.model_dir, checkpoint=args.checkpoint,
                       initial_peers=args.initial_peers, dht_prefix=args.dht_prefix)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer.padding_side = "right"
    data = datasets.load_from_disk(args.data_dir)
    texts, labels = list(data["text"]), list(data["label"])

    loop_start, loop_cpu_start = time.perf_counter(), time.process_time()
    preds = []
    with torch.no_grad():
        for start in range(0, len(texts), args.batch_size):
            batch = tokenizer(texts[start : start + args.batch_size], padding=True, return_tensors="pt")
            logits = model.module(batch["input_ids"])
            preds.extend(logits.argmax(-1).tolist())
    loop_seconds, loop_cpu_seconds = time.perf_counter() - loop_start, time.process_time() - loop_cpu_start
    model.close()
    accuracy = sum(int(p == y) for p, y in zip(preds, labels)) / len(labels)
    with open(args.out_json, "w") as f:
        json.dump({"num_samples": len(texts), "eval_loop_seconds": loop_seconds, "loop_cpu_seconds": loop_cpu_seconds,
                   "setup_seconds": loop_start - started, "accuracy": accuracy, "preds": preds}, f)


if __name__ == "__main__":
    main()
