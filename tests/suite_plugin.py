"""A pytest plugin (loaded by conftest.py): the suite's marks and order.

- ``gpu``, ``slurm`` and ``root``: tests that need what a machine may not offer: CUDA, a SLURM cluster on this
  host (``tests/slurm_cluster.py``: its daemons installed, or root to install them), root (a file given to
  another user); the rest of what such a test checks is in a test of its own. Where it is not offered they
  are deselected (not skipped: a skip is not a pass, nor an error), and the run's summary says so in one
  line a mark, with the reason.
- ``multiproc``, ``swarm`` and ``slurm`` say what a test starts; they are checked, not trusted: a test
  (or a fixture it set up) that launches ``torch.distributed.run`` (or ``dist_eval.launcher``, or ranks
  forked by ``tests/forked_ranks.py``) must be marked ``multiproc``, one that starts dist_eval's swarm
  servers ``swarm``, one that starts
  ``slurmctld`` ``slurm``, or the test fails naming the mark.
- ``--reverse-order``: the collected tests in reverse order (modules and tests within them),
  to show that no test depends on another having run first; ``pytest-random-order``
  (``--random-order``) gives a random order.

Under pytest-xdist each worker collects, deselects and checks marks on its own; the
deselections reach the controller, which prints the summary, through ``workeroutput``.
"""
from __future__ import annotations

import os
import subprocess
from typing import Dict, List, Optional, Tuple

import pytest

# what a command line holds -> the mark a test that starts it needs
_STARTS = {"torch.distributed.run": "multiproc", "torchrun ": "multiproc", "-m dist_eval.launcher": "multiproc",
           "forked ranks:": "multiproc",
           "-m dist_eval.swarm.server": "swarm", "-m stock_petals_server": "swarm", "/slurmctld": "slurm"}
_launched: List[str] = []  # command lines started since the current test began
_deselected: Dict[str, Tuple[str, List[str]]] = {}  # mark -> (why, the node ids deselected)
_real_popen_init = subprocess.Popen.__init__


def _recording_popen_init(self, args, *rest, **kwargs):
    _launched.append(args if isinstance(args, str) else " ".join(str(a) for a in args))
    _real_popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _recording_popen_init


def note_launch(cmd: str) -> None:
    """A launch that starts no Popen of its own (tests/forked_ranks.py: ranks forked from a fork
    server), checked as one: ``forked ranks: ...`` needs the ``multiproc`` mark."""
    _launched.append(cmd)


def add_options(parser) -> None:
    """The plugin's flags (called from conftest's pytest_addoption: options come before plugins)."""
    parser.addoption("--reverse-order", action="store_true", default=False,
                     help="run the collected tests in reverse order (dist_eval's suite plugin)")


def _no_cuda() -> Optional[str]:
    import torch

    return None if torch.cuda.is_available() else "torch sees no CUDA device here (they run where one is)"


def _no_slurm() -> Optional[str]:
    import slurm_cluster

    return slurm_cluster.why_not_here()


def _not_root() -> Optional[str]:
    return None if os.geteuid() == 0 else f"this user (uid {os.geteuid()}) is not root (they run as root)"


# a mark -> why this machine cannot run its tests (None: it can); asked only when such a test was collected
_NEEDS = {"gpu": _no_cuda, "slurm": _no_slurm, "root": _not_root}


def _deselect(config, items) -> None:
    for mark, why_not in _NEEDS.items():
        marked = [item for item in items if item.get_closest_marker(mark)]
        why = why_not() if marked else None
        if why:
            _deselected.setdefault(mark, (why, []))[1].extend(item.nodeid for item in marked)
            config.hook.pytest_deselected(items=marked)
            items[:] = [item for item in items if not item.get_closest_marker(mark)]


# test files that alone (or nearly) share a session-scoped fixture of tests/conftest.py: under xdist's
# --dist loadfile they go to one worker together, which sets the fixture up once (two workers each
# started split_swarm's two servers in a run; a file that came last started it again at the run's end)
SHARED_BY = {
    "tests/test_backends_wire.py": "split_swarm", "tests/test_swarm_merged_forward.py": "split_swarm",
    "tests/test_families_swarm.py": "bloom_swarm", "tests/test_backends_zeroshot_swarm.py": "bloom_swarm",
}


# the slowest files (benchmarks/RESULTS.md: the suite's time per file), dealt out first, so that the run
# ends on short files with every worker busy to the end; xdist deals files out by their number of tests
# otherwise, and these few-test files came last. Order only: a file missing or renamed just comes later.
# test_current_stack.py second: its worker makes .venv-pinned (the stack petals pins) while the first makes
# .venv-reference (the suite installs every reference environment its own is not), not after it.
FIRST = ("tests/test_families_reference.py", "tests/test_current_stack.py", "tests/test_swarm_failover.py",
         "tests/test_slurm.py", "tests/test_families_swarm.py", "tests/test_launch.py",
         "tests/test_swarm_supervisor.py",
         "tests/test_audit.py", "tests/test_swarm.py", "tests/test_backends_wire.py", "tests/test_demo.py",
         "tests/test_client_shards.py", "tests/test_backends_patches.py", "tests/test_backends_objects.py",
         "tests/test_backends_petals.py", "tests/test_evaluation.py", "tests/test_rowstore.py",
         "tests/test_benchmarks.py", "tests/test_resume.py", "tests/test_jobs.py", "tests/test_cli.py",
         "tests/test_peft_adapters.py", "tests/test_cli_default_run.py", "tests/test_memory_bounded.py")


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile (pyproject.toml's), with the files of :data:`SHARED_BY` one work unit each and
    those of :data:`FIRST` dealt out first (then by number of tests, as xdist does)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFixtureScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_BY.get(path, path)

        def _assign_work_unit(self, node) -> None:
            # before the first unit is handed out: FIRST's to the front of the queue (the collection's
            # order stays: a worker runs the tests it is sent by their index in it)
            if not getattr(self, "_first_dealt", False):
                self._first_dealt = True
                for path in reversed(FIRST):
                    if SHARED_BY.get(path, path) in self.workqueue:
                        self.workqueue.move_to_end(SHARED_BY.get(path, path), last=False)
            super()._assign_work_unit(node)

    return SharedFixtureScheduling(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    _deselect(config, items)
    if config.getoption("--reverse-order"):
        items.reverse()


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller prints the summary
        workeroutput["dist_eval_deselected"] = {mark: [why, ids] for mark, (why, ids) in _deselected.items()}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: a worker's deselections (every worker deselects the same tests)."""
    for mark, (why, ids) in getattr(node, "workeroutput", {}).get("dist_eval_deselected", {}).items():
        kept = _deselected.setdefault(mark, (why, []))[1]
        kept.extend(nodeid for nodeid in ids if nodeid not in kept)


def pytest_terminal_summary(terminalreporter):
    for mark, (why, ids) in sorted(_deselected.items()):
        terminalreporter.write_line(f"dist_eval: {len(ids)} {mark} test(s) deselected: {why}; "
                                    "none is counted as passed")


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
