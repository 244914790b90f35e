"""What an evaluation's loop measured, over every rank: typed, added up over the rounds of a run
that stops early, and written into the report (``num_truncated`` and ``metrics["run"]``'s
loop and row-store keys) in one place, :meth:`LoopFacts.report`.

The merge (:mod:`dist_eval.merge`) measures the loop, the known logits
(:mod:`dist_eval.known`) the row store, one exact evaluation (:mod:`dist_eval.exact`) joins them,
and the rounds (:mod:`dist_eval.stopping`) add them up with ``+``; nobody else lists these keys.
The rows evaluated (``run.sample``, :class:`SampleFacts`) are written by the run's Rows and read
back from metrics.json by the report writers here too.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import List, Optional


@dataclass
class SampleFacts:
    """The rows a run evaluated (``run.sample``): its --limit sample (``limit`` 0 or None: every row of
    the data), written by :meth:`dist_eval.data.sample.Rows.facts`, read back by :meth:`of`.
    """

    limit: Optional[int] = None
    limit_seed: Optional[int] = None
    rows_in_data: int = 0
    rows: int = 0

    @property
    def sampled(self) -> bool:
        """A random sample of the data's rows (--limit), not every row."""
        return bool(self.limit)

    @classmethod
    def of(cls, metrics: dict) -> SampleFacts:
        """What ``metrics`` (a report, metrics.json) records of the sample; a report without one: no sample."""
        recorded = (metrics.get("run") or {}).get("sample") or {}
        return cls(**{f.name: recorded[f.name] for f in fields(cls) if f.name in recorded})


@dataclass
class StoreFacts:
    """The row store in one evaluation (``run.row_store``): the rows it served over all ranks,
    those evaluated, the time saved; its own cost: rank 0's reading, all ranks' writing.
    """

    folder: Optional[str] = None
    fresh_rows: bool = False
    rows_from_store: int = 0
    rows_evaluated: int = 0
    seconds_saved: float = 0.0
    read_seconds: float = 0.0
    write_seconds: float = 0.0

    def __add__(self, other: StoreFacts) -> StoreFacts:
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)
                  if f.name not in ("folder", "fresh_rows")}
        return replace(self, **summed)


@dataclass
class LoopFacts:
    """One evaluation's loop over every rank (``run.*``); ``a + b``: two rounds as one run."""

    world_size: int
    per_rank_samples: List[int]
    eval_loop_seconds: float  # the slowest rank's
    forward_seconds_sum: float
    # where the loop's time goes: client CPU of all ranks (their own processes; not the p2pd
    # daemons), next to ranks x loop seconds of wall time
    loop_cpu_seconds_sum: float
    duplicates_dropped: int
    max_batch_seconds: float
    resumed_samples: int
    num_truncated: int = 0
    row_store: StoreFacts = field(default_factory=StoreFacts)
    # the exact score bootstrap of a set above EXACT_SCORE_ROWS rows, whose memory grows with the rows
    # on every rank: its rows, why, bytes a rank, row draws (intervals.exact_score_cost); None: none ran
    exact_score_intervals: Optional[dict] = None

    def __add__(self, other: LoopFacts) -> LoopFacts:
        return LoopFacts(
            world_size=self.world_size,
            per_rank_samples=[a + b for a, b in zip(self.per_rank_samples, other.per_rank_samples)],
            eval_loop_seconds=self.eval_loop_seconds + other.eval_loop_seconds,
            forward_seconds_sum=self.forward_seconds_sum + other.forward_seconds_sum,
            loop_cpu_seconds_sum=self.loop_cpu_seconds_sum + other.loop_cpu_seconds_sum,
            duplicates_dropped=self.duplicates_dropped + other.duplicates_dropped,
            max_batch_seconds=max(self.max_batch_seconds, other.max_batch_seconds),  # the worst batch
            resumed_samples=self.resumed_samples + other.resumed_samples,
            num_truncated=self.num_truncated + other.num_truncated,
            row_store=self.row_store + other.row_store,
            exact_score_intervals=other.exact_score_intervals or self.exact_score_intervals,
        )

    @property
    def samples_per_second(self) -> Optional[float]:
        """The rows the loop evaluated (not those the row store served or a resumed run had saved:
        they cost it no forward) per second of the slowest rank's loop; None when it evaluated none.
        """
        rows, seconds = self.row_store.rows_evaluated, self.eval_loop_seconds
        return rows / seconds if rows > 0 and seconds > 0 else None

    def report(self) -> dict:
        """The report's keys: ``num_truncated`` and ``run``'s loop and row-store facts."""
        run = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("num_truncated", "row_store")}
        run.update(row_store=asdict(self.row_store), samples_per_second=self.samples_per_second)
        return {"num_truncated": self.num_truncated, "run": run}

    @classmethod
    def from_report(cls, report: dict) -> LoopFacts:
        """The facts :meth:`report` wrote into ``report`` (a merge's, broadcast to every rank)."""
        run = report["run"]
        loop = {f.name: run[f.name] for f in fields(cls)
                if f.name not in ("num_truncated", "row_store", "exact_score_intervals")}
        loop["exact_score_intervals"] = run.get("exact_score_intervals")
        return cls(**loop, num_truncated=report["num_truncated"], row_store=StoreFacts(**run["row_store"]))
