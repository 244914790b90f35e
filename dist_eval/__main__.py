"""python -m dist_eval (under torchrun): see dist_eval.cli. ``python -m dist_eval merge SHARD_DIR...
--output-dir OUT``: the shards' merge (:mod:`dist_eval.shard_merge`), in this process.
"""
import sys

from dist_eval.cli import main


def exit_without_teardown(code: int) -> None:
    """End this process with ``code``, doing what Python's own exit does for the program
    (wait for its non-daemon threads, run the ``atexit`` handlers, flush stdout and
    stderr) but skipping the interpreter's teardown.

    Why: when ``main()`` returns, the run has already stopped everything it started (the
    local swarm, the petals client's DHT and p2pd, the process group) and written its
    report; what would remain is CPython freeing the modules of torch, transformers and
    petals and running their native destructors, a noticeable part of every rank's exit
    (benchmarks/RESULTS.md), for nothing. The ``atexit`` handlers still run: multiprocessing's (its
    children, its temp folders), logging's flush, the local swarm's last-resort stop.
    """
    import atexit
    import os
    import threading

    # What Py_FinalizeEx does first, in its order: the threading module's exit hooks (which
    # wake idle concurrent.futures workers, so that an executor never shut down cannot
    # hang here), then a join of every non-daemon thread, then the atexit handlers.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


if __name__ == "__main__":
    if sys.argv[1:2] == ["merge"]:  # the documented form of the shards' merge (docs/cluster.md); no rank, no group
        from dist_eval.shard_merge import main as merge_main

        sys.exit(merge_main(sys.argv[2:]))
    if sys.argv[1:2] == ["verify"]:  # python -m dist_eval verify OUT: a report checked (dist_eval.verify)
        from dist_eval.verify import main as verify_main

        sys.exit(verify_main(sys.argv[2:]))
    exit_without_teardown(main())  # a SystemExit (--help, a flag argparse refuses) exits as usual
