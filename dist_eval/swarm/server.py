"""Entry point of one swarm server process: ``python -m dist_eval.swarm.server <run_server args>``.

It exists so that server processes import petals through dist_eval.backends.compat (the
hivemind re-exports) exactly like the evaluator ranks do.
"""
import sys

from dist_eval.backends.compat import import_petals

if __name__ == "__main__":
    import_petals()
    from petals.cli import run_server

    sys.argv[0] = "petals.cli.run_server"
    run_server.main()
