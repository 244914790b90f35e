"""Worker for test_audit.py's blame across ranks: rank 1 of 2, a process of its own (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT in its environment), rank 0 :func:`main` called in the test's process in
the same gloo group. Each rank a petals client of the module's swarm, allowed the servers given; rank
0 audits half its rows, rank 1 checks nothing (its ledger's share 0: the checks a rank makes may miss
a server another rank catches), so the answers rank 1 took from a faulty server stand unless rank 0's
blame reaches it. Rank 0 writes the logits, the rows and the ranks' audit combined (as the CLI's
report does) to OUT."""
import json
import sys

import numpy as np
import torch.distributed as dist


def main(model_dir, checkpoint, initial_peer, dht_prefix, allowed, out, rows):
    import datasets

    from dist_eval import evaluate, load_model
    from dist_eval.backends.petals import audit
    from dist_eval.backends.tokenizer import load_tokenizer

    launched = not dist.is_initialized()
    if launched:  # rank 1 (rank 0's group is the test's)
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = load_model("petals", model_dir, checkpoint=checkpoint, initial_peers=[initial_peer], dht_prefix=dht_prefix,
                       audit=0.5, petals_client_options={"allowed_servers": allowed.split(","),
                                                          "ping_timeout": 30.0})  # test_audit.PING_TIMEOUT: why
    try:
        if rank == 1:
            audit.attach(model.module.sequence_manager, 0.0)
        n = int(rows)
        data = datasets.Dataset.from_dict({"text": [" ".join(f"w{(7 * i + j) % 60}" for j in range(3 + i % 5))
                                                    for i in range(n)], "label": [i % 3 for i in range(n)]})
        result = evaluate(model, data, tokenizer=load_tokenizer(model_dir), batch_size=1, return_logits=True,
                          bootstrap_resamples=0)
        facts = [None] * dist.get_world_size()
        dist.all_gather_object(facts, model.provenance().get("audit"))
    finally:
        model.close()
    if rank == 0:
        np.savez(out + ".npz", logits=result.predictions.logits, indices=result.predictions.indices)
        with open(out + ".json", "w") as f:
            json.dump(audit.combine(facts), f)
    if launched:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
