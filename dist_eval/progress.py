"""Global progress of an evaluation, shown by rank 0, without a collective per batch.

Each rank adds the rows it finished to a counter in the process group's c10d store (one
small request per batch, never a collective); a background thread on rank 0 reads the
total at most every ``refresh_s`` and renders it on stderr (stdout keeps the summary):

    bar   a tqdm bar (``tqdm.auto``: a widget in a notebook) counting the plan's work, padded
          tokens (rows without a plan), the rows and samples/s in its postfix:
          dist_eval:  56%|#####     | 21.1k/37.7k [00:03<00:02, 6.2k tok/s, 450/800 rows, 123.4 samples/s]
    log   plain lines for job logs: a line every ``log_every_s`` and at each 10%, and a final one
          (no carriage return)
    none  nothing
    auto  bar when stderr is a terminal or in a notebook, log otherwise; none with ``quiet`` or
          where ``TQDM_DISABLE`` is set (as tqdm reads it: any non-empty value), which also turns
          ``bar`` off (an explicit ``log`` still writes its lines)

In one process the count is local. Progress can never fail an evaluation: a store error
stops the display with one warning line.

The ETA counts work, not rows: given the batch plan (:meth:`GlobalProgress.set_plan`,
each batch's rows and padded tokens), the rows done are turned into the plan's cost done,
taken in run order (the plan runs its longest batches first, so the first rows are the
costliest). No ETA is shown before ``ETA_AFTER_WORK`` of the work is done: the first
batches (the longest, a cold swarm) say little of the rate.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Optional, Sequence, TextIO

import numpy as np

from dist_eval import ranks
from dist_eval.errors import warn

MODES = ("auto", "bar", "log", "none")
ETA_AFTER_WORK = 0.02  # the share of the work done before an ETA is shown
# tqdm's own format (its r_bar) with the remaining time as "?": before ETA_AFTER_WORK of the work
_BAR_BEFORE_ETA = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<?, {rate_fmt}{postfix}]"


class WorkPlan:
    """Cumulative rows and cost of a batch plan, in run order: the work of the first rows."""

    def __init__(self, batch_rows: Sequence[int], batch_costs: Sequence[float]):
        self.rows = np.concatenate([[0], np.cumsum(np.asarray(batch_rows, dtype=np.float64))])
        self.costs = np.concatenate([[0], np.cumsum(np.asarray(batch_costs, dtype=np.float64))])

    def fraction(self, rows_done: int) -> float:
        """The share of the plan's cost in its first ``rows_done`` rows (linear within a batch)."""
        total = self.costs[-1]
        return float(np.interp(rows_done, self.rows, self.costs) / total) if total > 0 else 1.0


def eta_seconds(elapsed: float, done: int, total: int, plan: Optional[WorkPlan] = None) -> Optional[float]:
    """Seconds left, from the share of the work done in ``elapsed`` (the rows' share without
    a plan); None before ``ETA_AFTER_WORK`` of it.
    """
    fraction = plan.fraction(done) if plan is not None else (done / total if total else 1.0)
    if fraction < ETA_AFTER_WORK or fraction <= 0:
        return None
    return elapsed * (1.0 - min(fraction, 1.0)) / fraction


def tqdm_disabled() -> bool:
    """``TQDM_DISABLE`` set, as tqdm reads it (its ``disable`` from a non-empty string)."""
    return bool(os.environ.get("TQDM_DISABLE"))


def in_notebook() -> bool:
    """In a Jupyter kernel (tqdm.auto's test): the bar is a widget there."""
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    shell = get_ipython() if get_ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def resolve_mode(mode: str, quiet: bool, stream: TextIO) -> str:
    """The mode actually used: ``auto`` becomes bar / log / none; ``bar`` is none under
    ``TQDM_DISABLE``.
    """
    if mode not in MODES:
        raise ValueError(f"progress mode {mode!r}: expected one of {', '.join(MODES)}")
    if (mode == "auto" and quiet) or (mode in ("auto", "bar") and tqdm_disabled()):
        return "none"
    if mode != "auto":
        return mode
    isatty = getattr(stream, "isatty", None)
    return "bar" if (isatty is not None and isatty()) or in_notebook() else "log"


def format_duration(seconds: Optional[float]) -> str:
    """``1:02:03`` / ``2:03``; ``?`` when unknown."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class GlobalProgress:
    """Samples done / total over every rank, rendered on rank 0.

    Every rank creates it at the same point (with more than one rank, creating it is one
    broadcast), uses it as a context manager around :func:`dist_eval.evaluate`, and
    passes :meth:`update` as ``on_batch_done``::

        with GlobalProgress(len(dataset), "auto") as progress:
            result = evaluate(model, dataset, ..., on_batch_done=progress.update)

    Whether progress is on is decided by ``mode`` and ``quiet`` alone (the same on every
    rank); whether rank 0 draws a bar or writes lines also depends on its terminal.
    """

    def __init__(
        self,
        total: int,
        mode: str = "auto",
        *,
        quiet: bool = False,
        stream: Optional[TextIO] = None,
        refresh_s: float = 0.5,
        log_every_s: float = 10.0,
        label: str = "dist_eval",
    ):
        self.total = int(total)
        self.stream = stream if stream is not None else sys.stderr
        self.refresh_s = refresh_s
        self.log_every_s = log_every_s
        self.label = label
        self.is_main = ranks.is_main_process()
        resolved = resolve_mode(mode, quiet, self.stream)  # may differ by rank only between bar and log
        self.enabled = resolved != "none"
        self.mode = resolved if self.is_main else "none"
        self.shared = self.enabled and ranks.get_world_size() > 1
        self._key = ranks.new_shared_counter("progress") if self.shared else None
        self._local_done = 0  # rank 0: its own rows (other ranks push theirs to the store)
        self._pushed = 0  # rank 0: how many of its own rows the store has
        self._global_done = 0
        self._started = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._last_log_time = None
        self._last_log_decile = -1
        self._last_logged_done = -1
        self._bar = None  # rank 0's tqdm bar (mode bar), made by start()
        self._closed = False
        self._plan: Optional[WorkPlan] = None

    # -- every rank ---------------------------------------------------------------------

    def update(self, num_rows: int) -> None:
        """Called after each batch with its number of rows (``on_batch_done``)."""
        if not self.enabled:
            return
        if self.is_main or not self.shared:
            self._local_done += num_rows  # rank 0's thread pushes it: no store request here
            return
        try:
            ranks.shared_counter_add(self._key, num_rows)
        except Exception as e:  # progress must never fail the evaluation
            self._give_up(e)

    def set_plan(self, batch_rows: Sequence[int], batch_costs: Sequence[float]) -> None:
        """The global batch plan in run order (each batch's rows and cost, e.g. padded
        tokens): the ETA then counts work. :func:`dist_eval.evaluate` calls it, on every
        rank, for an ``on_batch_done`` that is a bound ``update`` of a GlobalProgress.
        """
        self._plan = WorkPlan(batch_rows, batch_costs) if len(batch_rows) else None

    def __enter__(self) -> GlobalProgress:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(completed=exc_type is None)

    def start(self) -> None:
        self._started = time.monotonic()
        self._last_log_time = self._started
        if self.mode == "bar":
            self._bar = self._open_bar()
        if self.mode in ("bar", "log"):
            self._thread = threading.Thread(target=self._refresh_loop, name="dist_eval-progress", daemon=True)
            self._thread.start()

    def close(self, completed: bool = True) -> None:
        """Stop the display; on rank 0 render the final state (the total, when every rank
        finished: their last additions reached the store before they left the forwards).
        Safe to call twice: the second call does nothing.
        """
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._stop.set()
            # bounded: a store request stuck on a dead peer must not hold up the exit
            self._thread.join(timeout=max(5.0, 4 * self.refresh_s))
            if self._thread.is_alive():
                self.mode = "none"
            self._thread = None
        if self.mode in ("bar", "log"):
            # after a failure the store may be gone: show the last count rank 0 read
            self._render(final=True, completed=completed, ask_store=completed)
        if self._bar is not None:
            try:
                self._bar.close()
            except (OSError, ValueError):
                pass
            self._bar = None

    # -- rank 0 -------------------------------------------------------------------------

    def done(self, ask_store: bool = True) -> int:
        """Rows finished over every rank, as far as rank 0 knows now (``ask_store=False``:
        the last total read from the store, without a request).
        """
        if not self.shared:
            return self._local_done
        if not ask_store:
            return self._global_done + self._local_done - self._pushed
        delta = self._local_done - self._pushed
        self._global_done = ranks.shared_counter_add(self._key, delta)
        self._pushed += delta
        return self._global_done

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self._render(final=False)

    def _render(self, final: bool, completed: bool = True, ask_store: bool = True) -> None:
        if self.mode == "none":
            return
        try:
            done = self.done(ask_store)
        except Exception as e:
            self._give_up(e)
            return
        now = time.monotonic()
        elapsed = max(now - (self._started or now), 1e-9)
        rate = done / elapsed if done else 0.0
        eta = eta_seconds(elapsed, done, self.total, self._plan)
        if self.mode == "bar":
            self._draw_bar(done, rate, eta, final)
        elif final:
            self._write_log_line(done, rate, elapsed, "done" if completed and done >= self.total else "stopped")
        elif self._log_due(done, now):
            self._write_log_line(done, rate, elapsed, f"ETA {format_duration(eta)}")

    def _open_bar(self):
        from tqdm.auto import tqdm

        # smoothing=0: the rate is the work done over the time elapsed, so tqdm's remaining time
        # is eta_seconds'; the total and unit become the plan's once it arrives (_draw_bar)
        return tqdm(total=self.total, desc=self.label, unit=" rows", smoothing=0, file=self.stream,
                    mininterval=0, leave=True, bar_format=_BAR_BEFORE_ETA)

    def _draw_bar(self, done: int, rate: float, eta, final: bool) -> None:
        bar = self._bar
        if self._plan is not None and bar.unit != " tok":
            bar.total, bar.unit, bar.unit_scale = float(self._plan.costs[-1]), " tok", True
        bar.n = float(self._plan.costs[-1] * self._plan.fraction(done)) if self._plan is not None else done
        bar.bar_format = _BAR_BEFORE_ETA if eta is None and not final else None
        bar.set_postfix_str(f"{done}/{self.total} rows, {rate:.1f} samples/s", refresh=False)
        try:
            bar.refresh()
        except (OSError, ValueError):  # a closed or broken stream: stop drawing, keep evaluating
            self.mode = "none"

    def _log_due(self, done: int, now: float) -> bool:
        decile = int(10 * done / self.total) if self.total else 10
        # the line for the total is the final one, written by close()
        return done != self._last_logged_done and done < self.total and (
            (done > 0 and decile > self._last_log_decile) or now - self._last_log_time >= self.log_every_s
        )

    def _write_log_line(self, done: int, rate: float, elapsed: float, tail: str) -> None:
        percent = 100 * done / self.total if self.total else 100.0
        self._write(
            f"{self.label}: progress {done}/{self.total} samples ({percent:.0f}%), {rate:.1f} samples/s, "
            f"elapsed {format_duration(elapsed)}, {tail}\n"
        )
        self._last_logged_done = done
        self._last_log_time = time.monotonic()
        self._last_log_decile = int(10 * done / self.total) if self.total else 10

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: stop drawing, keep evaluating
            self.mode = "none"

    def _give_up(self, error: BaseException) -> None:
        if not self.enabled:
            return
        self.enabled = False
        self.mode = "none"
        try:
            warn(f"progress display stopped ({type(error).__name__}: {error})", label=self.label, stream=self.stream)
        except (OSError, ValueError):
            pass
