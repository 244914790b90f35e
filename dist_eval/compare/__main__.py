"""python -m dist_eval.compare OUT_A OUT_B [OUT ...]: see :mod:`dist_eval.compare.cli`."""
import sys

from dist_eval.compare.cli import main

if __name__ == "__main__":
    sys.exit(main())
