"""``python -m dist_eval.swarm``: see :mod:`dist_eval.swarm.cli`."""
import sys

from dist_eval.swarm.cli import main

if __name__ == "__main__":
    sys.exit(main())
