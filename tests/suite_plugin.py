"""A pytest plugin (loaded by conftest.py): the suite's marks and order.

- ``gpu``: tests that need CUDA. Where torch sees no CUDA device they are deselected (not
  skipped: a skip is not a pass), and the run's summary says so in one line.
- ``multiproc``, ``swarm`` and ``slurm`` say what a test starts; they are checked, not trusted: a test
  (or a fixture it set up) that launches ``torch.distributed.run`` (or ``dist_eval.launcher``) must be
  marked ``multiproc``, one that starts dist_eval's swarm servers ``swarm``, one that starts
  ``slurmctld`` ``slurm``, or the test fails naming the mark.
- ``--reverse-order``: the collected tests in reverse order (modules and tests within them),
  to show that no test depends on another having run first; ``pytest-random-order``
  (``--random-order``) gives a random order.

Under pytest-xdist each worker collects, deselects and checks marks on its own; the gpu
deselections reach the controller, which prints the summary, through ``workeroutput``.
"""
from __future__ import annotations

import subprocess
from typing import List

import pytest

# what a command line holds -> the mark a test that starts it needs
_STARTS = {"torch.distributed.run": "multiproc", "torchrun ": "multiproc", "-m dist_eval.launcher": "multiproc",
           "-m dist_eval.swarm.server": "swarm", "-m stock_petals_server": "swarm", "/slurmctld": "slurm"}
_launched: List[str] = []  # command lines started since the current test began
_gpu_deselected: List[str] = []
_real_popen_init = subprocess.Popen.__init__


def _recording_popen_init(self, args, *rest, **kwargs):
    _launched.append(args if isinstance(args, str) else " ".join(str(a) for a in args))
    _real_popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _recording_popen_init


def add_options(parser) -> None:
    """The plugin's flags (called from conftest's pytest_addoption: options come before plugins)."""
    parser.addoption("--reverse-order", action="store_true", default=False,
                     help="run the collected tests in reverse order (dist_eval's suite plugin)")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and not _cuda_available():
        _gpu_deselected.extend(item.nodeid for item in gpu)
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
    if config.getoption("--reverse-order"):
        items.reverse()


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller prints the summary
        workeroutput["dist_eval_gpu_deselected"] = list(_gpu_deselected)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: a worker's gpu deselections (every worker deselects the same tests)."""
    for nodeid in getattr(node, "workeroutput", {}).get("dist_eval_gpu_deselected", []):
        if nodeid not in _gpu_deselected:
            _gpu_deselected.append(nodeid)


def pytest_terminal_summary(terminalreporter):
    if _gpu_deselected:
        terminalreporter.write_line(f"dist_eval: {len(_gpu_deselected)} gpu test(s) deselected: torch sees no CUDA "
                                    "device here (they run where one is; none is counted as passed)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _launched.clear()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    started = list(_launched)  # in the test's setup (its fixtures) and body
    result = yield
    missing = sorted({mark for cmd in started for needle, mark in _STARTS.items()
                      if needle in cmd and not item.get_closest_marker(mark)})
    if missing:
        pytest.fail(f"this test (or a fixture it set up) starts what its marks do not say: mark it "
                    f"{' and '.join(f'@pytest.mark.{m}' for m in missing)}", pytrace=False)
    return result
