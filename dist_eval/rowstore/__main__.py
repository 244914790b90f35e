"""``python -m dist_eval.rowstore verify|compact DIR``: see :mod:`dist_eval.rowstore.upkeep`."""
from dist_eval.rowstore.upkeep import main

raise SystemExit(main())
