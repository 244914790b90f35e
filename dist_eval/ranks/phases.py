"""Phases: one rank's failure is agreed on by every rank, so none is left waiting."""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, List, Optional

from dist_eval.errors import UsageError
from dist_eval.ranks.collectives import all_gather_object
from dist_eval.ranks.counters import new_shared_counter, shared_counter_add
from dist_eval.ranks.group import get_rank, get_world_size

# Wall seconds of each phase this process ran, by name, in the order they first ran (since
# the last clear()): the CLI reports them in metrics.json (run.phase_seconds) and the summary.
phase_seconds: Dict[str, float] = {}


class StoppedForAnotherRank(RuntimeError):
    """This rank stopped a phase early because another rank had already failed it."""


class FailureFlag:
    """Lets the ranks of a long phase stop as soon as one of them fails it, instead of
    finishing their own work before the agreement at its end (see :func:`phase`).

    A rank that fails raises the flag before it enters the agreement; the others see it
    in :meth:`check`, which asks the c10d store (see
    :func:`~dist_eval.ranks.counters.shared_counter_add`) at most every
    ``CHECK_INTERVAL`` seconds, and stop.
    """

    # Asking on every call (every batch) cost a store round trip per batch, made by the
    # thread that feeds the forwards, and woke torchrun's store thread each time: on a busy
    # 2-core machine, a few percent of the loop. A failure is still seen within this time.
    CHECK_INTERVAL = 0.25

    def __init__(self, name: str):
        self._key = new_shared_counter(name)  # a collective: every rank at the same point
        self._next_check = 0.0

    def raise_(self) -> None:
        shared_counter_add(self._key, 1)

    def check(self) -> None:
        """Raise :class:`StoppedForAnotherRank` when another rank has failed the phase
        (as seen at the last look at the store, at most ``CHECK_INTERVAL`` seconds ago).
        """
        if get_world_size() == 1 or time.monotonic() < self._next_check:
            return
        self._next_check = time.monotonic() + self.CHECK_INTERVAL
        if shared_counter_add(self._key, 0):
            raise StoppedForAnotherRank("stopped: another rank failed")


class RankFailure(RuntimeError):
    """Raised on every rank when one or more ranks failed a phase.

    ``usage`` is True when every failure was a :class:`dist_eval.errors.UsageError`
    (the user can fix it), so the CLI prints one line instead of a traceback. ``shared``
    is True when every rank failed with the same message: rank 0 alone prints it.
    """

    def __init__(self, phase: str, failures: List[tuple], world_size: int):
        self.phase = phase
        # ranks that only stopped because another failed are not failures of their own
        failures = [f for f in failures if f[1] != "stopped"] or failures
        self.failures = failures  # [(rank, kind, message)]
        self.usage = all(kind == "usage" for _, kind, _ in failures)
        # every rank met the same error (a broken model folder): one line, from rank 0, is enough
        self.shared = len(failures) == world_size and len({m for _, _, m in failures}) == 1
        rank, _, message = failures[0]
        where = f"rank {rank}: " if world_size > 1 and len(failures) < world_size else ""
        others = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 and where else ""
        super().__init__(f"{where}{message}{others}")


def agree_on_failure(phase: str, local_error: Optional[BaseException]) -> None:
    """Every rank calls this after a phase; if any rank failed, every rank raises.

    This is what keeps one rank's failure (a missing column, a swarm error) from
    leaving the others waiting in the next collective until the timeout.
    """
    if isinstance(local_error, RankFailure):
        # agreed on already, by every rank, in a nested phase: pass it on as it is (wrapping
        # it would turn a usage error into an internal one, and print it twice)
        raise local_error
    if local_error is None:
        report = None
    elif isinstance(local_error, StoppedForAnotherRank):
        report = ("stopped", str(local_error))
    elif isinstance(local_error, UsageError):
        report = ("usage", str(local_error))
    else:
        report = ("internal", f"{phase} failed: {type(local_error).__name__}: {local_error}")
    reports = all_gather_object(report)
    failures = [(rank, r[0], r[1]) for rank, r in enumerate(reports) if r is not None]
    if failures:
        failure = RankFailure(phase, failures, get_world_size())
        if local_error is not None:
            raise failure from local_error
        raise failure


@contextlib.contextmanager
def phase(name: str, *, main_first: bool = False, stop_early: bool = False) -> Iterator[Optional[FailureFlag]]:
    """A step that every rank runs; if it fails on any rank, it fails on every rank.

    ::

        with phase("loading the model"):
            model = load_model(...)      # bound after the block, as in any ``with``

    An exception in the body is not raised alone: every rank learns of it when the body
    ends (:func:`agree_on_failure`), and every rank raises :class:`RankFailure`, so no rank
    is left waiting in the next collective. ``main_first``: rank 0 runs the body before
    the others (e.g. to fill a cache they then read); if it fails there, the others do
    not run it. Phase names are unique: an internal error is reported as "<name> failed".

    ``stop_early``: the ``with`` gives a :class:`FailureFlag`; the body calls its
    ``check()`` now and then (e.g. after each batch) and stops as soon as another rank
    has failed, instead of finishing its own work first. None otherwise.
    """
    began = time.perf_counter()
    try:
        yield from _agreed(name, main_first, stop_early)
    finally:
        phase_seconds[name] = phase_seconds.get(name, 0.0) + time.perf_counter() - began


def _agreed(name: str, main_first: bool, stop_early: bool) -> Iterator[Optional[FailureFlag]]:
    main = get_rank() == 0
    if main_first and not main:
        agree_on_failure(name, None)  # rank 0's outcome: raises here if it failed
    flag = FailureFlag(name) if stop_early else None
    error = None
    try:
        yield flag
    except Exception as e:  # every failure must reach the other ranks
        error = e
        if flag is not None and not isinstance(e, StoppedForAnotherRank):
            flag.raise_()
    if main_first and main:
        agree_on_failure(name, error)  # the others wait for this one before they start
        error = None
    agree_on_failure(name, error)
