"""The cost of global progress, measured directly: the one store request per batch that a
rank other than 0 makes (rank 0 counts locally; a thread reads the store twice a second).

    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_progress.py [--calls 5000]

Rank 1 times ``shared_counter_add`` (what ``GlobalProgress.update`` does per batch) while
rank 0 waits; the printed per-call latency, times the batches per second of a run, is the
share of a rank's time that progress costs (the swarm benchmark is too noisy to show a
difference of this size).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=5000)
    args = p.parse_args()
    import torch.distributed as dist

    from dist_eval import ranks

    dist.init_process_group("gloo")
    key = ranks.new_shared_counter("bench")
    seconds = None
    if ranks.get_rank() == 1:
        start = time.perf_counter()
        for _ in range(args.calls):
            ranks.shared_counter_add(key, 64)
        seconds = time.perf_counter() - start
    seconds = ranks.broadcast_object(seconds, src=1)
    if ranks.get_rank() == 0:
        per_call = seconds / args.calls
        total = ranks.shared_counter_add(key, 0)
        assert total == 64 * args.calls, total
        print(f"store add: {per_call * 1e6:.0f} us per batch; at 10 batches/s per rank that is "
              f"{per_call * 10:.3%} of the rank's time, at 100 batches/s {per_call * 100:.2%}")
    ranks.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
