"""Worker for test_ranks_phases.py, run under torchrun with 2 ranks: rank 1 fails a
stop_early phase while rank 0 keeps checking its FailureFlag. Rank 0 writes how many
store reads its checks made and how it ended (JSON, argv[1])."""
import json
import sys
import time

import dist_eval.ranks.phases as phases
from dist_eval import ranks


def main(out_path: str) -> None:
    ranks.init_process_group_from_env(timeout_s=60)
    reads = []
    real_add = phases.shared_counter_add

    def counted_add(key, amount):
        if amount == 0:
            reads.append(time.monotonic())
        return real_add(key, amount)

    phases.shared_counter_add = counted_add
    ranks.barrier()
    facts, calls = {}, None
    try:
        with ranks.phase("the forward passes", stop_early=True) as flag:
            if ranks.get_rank() == 1:
                time.sleep(1.0)  # rank 0 checks for a second first
                raise ValueError("rank 1 broke")
            started = time.monotonic()
            calls = 0
            while True:  # a fast loop: one check per "batch", as the forward loop (predict.ShardLoop) does
                calls += 1
                try:
                    flag.check()
                except phases.StoppedForAnotherRank:
                    facts["stopped_after_s"] = time.monotonic() - started
                    raise
                if time.monotonic() - started > 30:
                    facts["never_stopped"] = True
                    break
                time.sleep(0.001)
    except ranks.RankFailure as e:
        facts["failure"] = str(e)
    facts.update(calls=calls if ranks.get_rank() == 0 else None, reads=len(reads),
                 elapsed_s=(reads[-1] - reads[0]) if reads else 0.0)
    if ranks.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(facts, f)
    ranks.barrier()


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    finally:
        # as the CLI ends: the gloo group torn down before the interpreter, not by its exit
        # (under load, gloo's threads met at interpreter exit aborted rank 0: "terminate called
        # without an active exception", SIGABRT)
        ranks.destroy_process_group()
