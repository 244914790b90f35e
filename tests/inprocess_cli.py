"""Run ``python -m dist_eval`` in the test process itself (one rank, no torchrun): the
same code path as the CLI, seconds faster than a subprocess that imports torch again."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import List

import torch


@contextlib.contextmanager
def one_thread():
    """Compute in this process as a torchrun rank does (torchrun sets OMP_NUM_THREADS=1).

    With two threads a CPU's matmul kernels may split a reduction and round the last bits
    differently, so an in-process result equals a torchrun rank's bitwise only with one
    thread (whether the kernels split depends on the CPU: it passed on one machine and
    failed on another).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_cli_in_process(args: List[str], hide_modules=()) -> int:
    """``dist_eval.cli.main(args)`` with one thread (:func:`one_thread`); the process's
    SIGTERM handler and thread count are restored afterwards.

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
        with one_thread():
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


def without_modules(folder, *names) -> str:
    """:func:`run_cli_in_process`'s ``hide_modules`` for a child process: a folder to put first on
    its PYTHONPATH, where importing any of ``names`` fails, as if not installed (e.g. matplotlib: a
    run's figures are the same function of the same metrics, and the most of a small run's time)."""
    for name in names:
        os.makedirs(os.path.join(folder, name), exist_ok=True)
        with open(os.path.join(folder, name, "__init__.py"), "w") as f:
            f.write("raise ImportError('hidden by the test')\n")
    return str(folder)
