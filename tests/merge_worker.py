"""Worker for test_merge_ranks.py, run under torchrun (or plain python for one process):
synthetic per-sample results with logits for this rank's rows (every N-th row: uneven
shards), merged by dist_eval.merge.merge_on_main with the default intervals. Rank 0 saves
the report and, beside it, the metrics ``python -m dist_eval.rescore`` would compute from
the merged rows (scoring.row_metrics)."""
import json
import os
import sys

import numpy as np
import torch.distributed as dist


def shard(num_rows: int, num_labels: int, rank: int, world: int):
    from dist_eval.results import ShardResults

    rows = np.arange(rank, num_rows, world, dtype=np.int64)  # every world-th row: shards of unequal sizes
    rng = np.random.default_rng(num_rows)  # each row's values depend on the row alone
    labels = rng.integers(0, num_labels, num_rows)
    logits = rng.normal(size=(num_rows, num_labels)).astype(np.float32)
    logits[np.arange(num_rows), labels] += 1.5
    shifted = logits - logits.max(axis=1, keepdims=True)
    losses = (np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(num_rows), labels]).astype(np.float64)
    return ShardResults(indices=rows, labels=labels[rows], preds=logits.argmax(axis=1)[rows].astype(np.int64),
                        losses=losses[rows], logits=logits[rows])


def main(out_path: str, sizes: list) -> int:
    from dist_eval import ranks
    from dist_eval.merge import merge_on_main
    from dist_eval.scoring import row_metrics

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank, world = ranks.get_rank(), ranks.get_world_size()
    saved = {}
    for num_rows in sizes:
        local = shard(num_rows, 4, rank, world)
        report, merged, _ = merge_on_main(local, num_rows, 4, bootstrap=(200, 7))
        if rank == 0:
            rescored = row_metrics(merged.labels, merged.preds, merged.losses, merged.logits, 4, bootstrap=(200, 7))
            report.pop("run")  # the ranks' own facts
            saved[str(num_rows)] = {"report": report, "rescored": rescored}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(saved, f)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], [int(n) for n in sys.argv[2:]]))
