"""python -m dist_eval (under torchrun): see dist_eval.cli."""
import sys

from dist_eval.cli import main

if __name__ == "__main__":
    sys.exit(main())
