"""What an evaluation's loop measured, over every rank: typed, added up over the rounds of a run
that stops early, and written into the report (``num_truncated`` and ``metrics["run"]``'s
loop and row-store keys) in one place, :meth:`LoopFacts.report`.

The merge (:mod:`dist_eval.merge`) measures the loop, the known logits
(:mod:`dist_eval.known`) the row store, one exact evaluation (:mod:`dist_eval.exact`) joins them,
and the rounds (:mod:`dist_eval.stopping`) add them up with ``+``; nobody else lists these keys.
The rows evaluated (``run.sample``, :class:`SampleFacts`) are written by the run's Rows, and the
rest of ``run`` (:class:`RunFacts`: what was run, where, its times) by the CLI's report writer
(:mod:`dist_eval.output.report`); the report's readers read all three back with their ``of``,
which a report of an older version, missing keys, passes (what it lacks is absent).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Dict, List, Optional


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
        return rows / seconds if rows and seconds and rows > 0 and seconds > 0 else None

    def report(self) -> dict:
        """The report's keys: ``num_truncated`` and ``run``'s loop and row-store facts."""
        run = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("num_truncated", "row_store")}
        run.update(row_store=asdict(self.row_store), samples_per_second=self.samples_per_second)
        return {"num_truncated": self.num_truncated, "run": run}

    @classmethod
    def of(cls, metrics: dict) -> LoopFacts:
        """What ``metrics`` (a report, metrics.json, perhaps of an older version) records of the loop:
        a key it lacks is None (its row store's too).
        """
        run = metrics.get("run") or {}
        loop = {f.name: run.get(f.name) for f in fields(cls) if f.name not in ("num_truncated", "row_store")}
        store = run.get("row_store") or {}
        return cls(**loop, num_truncated=metrics.get("num_truncated") or 0,
                   row_store=StoreFacts(**{f.name: store.get(f.name) for f in fields(StoreFacts)}))

    @classmethod
    def from_report(cls, report: dict) -> LoopFacts:
        """The facts :meth:`report` wrote into ``report`` (a merge's, broadcast to every rank)."""
        run = report["run"]
        loop = {f.name: run[f.name] for f in fields(cls)
                if f.name not in ("num_truncated", "row_store", "exact_score_intervals")}
        loop["exact_score_intervals"] = run.get("exact_score_intervals")
        return cls(**loop, num_truncated=report["num_truncated"], row_store=StoreFacts(**run["row_store"]))


# What a run key is made of, as RunFacts names them (a shard's manifest names them: a merge says which differs)
RUN_KEY_FACTS = ("model", "checkpoint", "head", "data_files", "split", "backend")
# RunFacts' keys a report holds only when they apply (several pairs, a swarm, the shutdown, a merge of shards)
_WHEN_GIVEN = ("pair", "swarm", "total_seconds", "shards")


@dataclass
class RunFacts:
    """What a report says of the run beside its loop (``run.*``): what was evaluated, by what, where,
    and its times. Built by :func:`dist_eval.output.report.run_facts` (the shutdown's times added by
    ``record_shutdown``; a merge of shards by :mod:`dist_eval.shard_merge`), read back by :meth:`of`.
    """

    backend: Optional[str] = None
    model: Optional[str] = None
    data_files: List[str] = field(default_factory=list)
    split: Optional[str] = None
    checkpoint: Optional[str] = None
    head: Optional[str] = None
    demo: bool = False
    label_words: Optional[List[str]] = None
    template: Optional[str] = None
    batch_size: Optional[int] = None
    max_length: Optional[int] = None
    max_batch_tokens: int = 0
    length_buckets: Optional[int] = None
    in_flight: Optional[int] = None
    initial_peers: List[str] = field(default_factory=list)
    dht_prefix: Optional[str] = None
    started_at: Optional[str] = None  # ISO 8601 UTC
    wall_seconds: Optional[float] = None  # the run's (several pairs: the pair's; shards: the slowest shard's)
    startup_seconds: Optional[float] = None  # the process's start-up and imports, before the first phase
    phase_seconds: Dict[str, float] = field(default_factory=dict)  # {phase: seconds}, in order
    versions: Dict[str, Optional[str]] = field(default_factory=dict)
    pair: Optional[dict] = None  # several pairs: the pair's checkpoint, set, folder and the phases they shared
    swarm: Optional[dict] = None  # a swarm's run: its servers as announced in the DHT, and the audit
    run_key: Optional[str] = None
    sample: SampleFacts = field(default_factory=SampleFacts)
    total_seconds: Optional[float] = None  # from the launch to the end of the shutdown
    shards: Optional[list] = None  # a merge of shards (dist_eval.shard_merge): each shard's

    def report(self) -> dict:
        """``run``'s keys in the report, in order; those of :data:`_WHEN_GIVEN` only when set."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if not (f.name in _WHEN_GIVEN and getattr(self, f.name) is None)}
        out["sample"] = asdict(self.sample)
        return out

    def key_facts(self) -> dict:
        """What the run key is made of (:data:`RUN_KEY_FACTS`), by name."""
        return {name: getattr(self, name) for name in RUN_KEY_FACTS}

    @classmethod
    def of_shards(cls, runs: List[RunFacts], world_sizes: List[int], shards: List[dict]) -> RunFacts:
        """The run of a merge of shards: the first shard's facts (model, data, settings, versions), its
        times not: the slowest shard's wall time, and each of ``shards`` (its name, folder, rows) with
        its ranks and wall time.
        """
        return replace(runs[0], phase_seconds={}, startup_seconds=None, total_seconds=None,
                       wall_seconds=max(run.wall_seconds or 0.0 for run in runs),
                       shards=[{**shard, "world_size": n, "wall_seconds": run.wall_seconds}
                               for shard, n, run in zip(shards, world_sizes, runs)])

    @classmethod
    def of(cls, metrics: dict) -> RunFacts:
        """What ``metrics`` (a report, metrics.json, perhaps of an older version) records of the run;
        a key it lacks takes the default (absent from what the readers show).
        """
        run = metrics.get("run") or {}
        given = {f.name: run[f.name] for f in fields(cls) if f.name in run and run[f.name] is not None}
        return cls(**{**given, "sample": SampleFacts.of(metrics)})
