"""Run ``python -m dist_eval`` in the test process itself (one rank, no torchrun): the
same code path as the CLI, seconds faster than a subprocess that imports torch again."""
from __future__ import annotations

import os
import signal
import sys
from typing import List


def run_cli_in_process(args: List[str], hide_modules=()) -> int:
    """``dist_eval.cli.main(args)``; the process's SIGTERM handler is restored afterwards.

    ``hide_modules``: names made unimportable for the call (as if not installed).
    """
    from dist_eval.cli import main

    previous_handler = signal.getsignal(signal.SIGTERM)
    saved = {name: sys.modules.get(name, _ABSENT) for name in hide_modules}
    env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # nothing may be downloaded
    try:
        for name in hide_modules:
            sys.modules[name] = None  # import and find_spec then fail, as for a missing package
        return main(args)
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        for name, module in saved.items():
            if module is _ABSENT:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_ABSENT = object()
