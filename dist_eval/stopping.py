"""The rounds: the one loop of every run. A schedule hands out rounds of rows, every model evaluates
each round exactly, and the schedule's rule says after each round whether to stop:

- a run that does not stop early is one round of every row (:class:`WholeRun`), its rule "done";
- stopping early (:class:`InRounds`) evaluates a set in rounds of rows, in the --limit order, until
  the time-uniform interval (:mod:`dist_eval.sequential`) says the answer is known:

    the set's rows in their content-hash order (data/sample.draw_rows)
      -> for each round of ``stop_round_rows`` rows: exact.evaluate_once on them (every rank, exact)
         -> rank 0: the per-row values seen so far -> the confidence sequence -> stop? (broadcast)
      -> rank 0: the metrics of the rows used (one merged set), ``stopping`` (broadcast); every rank:
         the score intervals, shared (as a whole run's merge makes its report), the run's facts

Rank 0's work is done in phases (:func:`dist_eval.ranks.phase`): a failure there fails every rank.

A round is a count of rows, not of batches, and the order is the rows' content hash, so the
rows of each round, the stopping round and every number are the same for any world size.
Each round of a run that stops early keeps its partial results in its own subfolder of the resume
folder (a whole run: the folder itself): a resumed run reads the finished rounds back, sees the same
values, and makes the same decisions.
"""
from __future__ import annotations

import functools
import operator
import os
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from dist_eval import ranks
from dist_eval.config import Settings
from dist_eval.data.sample import Rows
from dist_eval.errors import UsageError
from dist_eval.exact import EvalResult, Request, evaluate_once, without_logits
from dist_eval.loop_facts import LoopFacts
from dist_eval.merge import merge_parts
from dist_eval.metrics import default_top_k
from dist_eval.predict import redone_in_earlier_rounds
from dist_eval.results import SAMPLE_VALUE_PREFIX, MergedResults
from dist_eval.scoring import main_report, score_intervals_everywhere
from dist_eval.sequential import (
    STOP_METRICS,
    TIME_UNIFORM,
    RunningSequence,
    StopReport,
    bounds_of,
    describe,
    paired_bounds,
    row_values,
    stop_reason,
    where_stopped,
)

LEVEL = 0.95


def evaluate_rows(models: Sequence, data, request: Request, on_model: Optional[Callable[[int], None]] = None) -> list:
    """Each model's :class:`~dist_eval.exact.EvalResult` on ``data`` (the run's Rows, or a DataLoader), by the
    one loop of every run: a schedule hands out a round of rows, each model evaluates it exactly
    (:func:`~dist_eval.exact.evaluate_once`), and the schedule's rule says whether to stop after it. A run
    that does not stop early is one round of every row (:class:`WholeRun`); stopping early, rounds of rows
    until the interval says stop (:class:`InRounds`), for one model or two on the same rows alike.
    ``on_model(i)``: called before each evaluation of model ``i``.
    """
    if request.settings.stops_early or len(models) > 1:
        schedule = InRounds(models, data, request)
    else:
        schedule = WholeRun(data, request)
    done = False
    while not done:
        rows, each_round = schedule.next_round()
        for index, model in enumerate(models):
            if on_model is not None:
                on_model(index)  # before the model's evaluation, and before its earlier rounds are redone
            schedule.take(index, evaluate_once(model, rows, each_round, schedule.folder(index),
                                               loops=schedule.loops(index)))
        done = schedule.after_round()
    return schedule.results()


class WholeRun:
    """The schedule of a run that does not stop early: one round of every row, the data (the rows drawn, or
    a DataLoader), the request and the resume folder as given; its rule: done after that round, whose
    result (its merge's report, with the intervals) is the run's.
    """

    def __init__(self, data, request: Request):
        self.data, self.request = (data.dataset if isinstance(data, Rows) else data), request
        self.result: Optional[EvalResult] = None

    def next_round(self) -> tuple:
        return self.data, self.request

    def folder(self, index: int) -> Optional[str]:
        return (self.request.resume_folders or [None])[index]

    def loops(self, index: int) -> None:
        return None  # no earlier round to evaluate again

    def take(self, index: int, result: EvalResult) -> None:
        self.result = result

    def after_round(self) -> bool:
        return True

    def results(self) -> list:
        return [self.result]


class InRounds:
    """The schedule of ``evaluate()`` with ``stop_at_width`` (one model) or ``stop_when_decided`` (two, on the
    same rows: ``evaluate_pair``, the CLI's ``--stop-when-decided``): rounds of ``stop_round_rows`` rows in the
    --limit order (:class:`Rounds`), each an exact evaluation of its rows by every model, in its own resume
    subfolder; after each, rank 0's rule (:class:`_Stopper`) says stop or go on. Its results: an EvalResult
    per model, its report on every rank, its merged rows used on rank 0 (None elsewhere).
    """

    def __init__(self, models: Sequence, rows: Rows, request: Request):
        settings, options = request.settings, request.options
        _check_stopping(rows, settings, len(models), request.sample_metrics)
        self.request = request
        self.rounds = Rounds(rows, settings)
        self.stopper = _Stopper(self.rounds, settings)
        self.seen = [Seen(settings.stop_metric, options.top_k) for _ in models]
        self.folders = request.resume_folders or [None] * len(self.seen)
        # a round's text labels get the ids the whole set gives them (its class names), not those of its own texts
        self.each_round = replace(request, whole_set=rows if request.label_names is None else None, metrics=None,
                                  return_logits=True, settings=self.rounds.settings,
                                  options=replace(options, bootstrap_resamples=0),
                                  on_batch_done=_rows_only(request.on_batch_done))
        self.indices: Optional[np.ndarray] = None  # the set's rows of the round handed out last
        self.decision: Optional[_Decision] = None

    def next_round(self) -> tuple:
        self.indices = self.rounds.next_rows()
        return self.rounds.data.select(self.indices.tolist()), self.each_round

    def folder(self, index: int) -> Optional[str]:
        return self.rounds.folder(self.folders[index])

    def loops(self, index: int) -> list:
        return self.seen[index].loops  # a swarm server blamed later: its batches of every round are redone

    def take(self, index: int, result: EvalResult) -> None:
        mine = self.seen[index]
        # a swarm server blamed now: its earlier rounds' rows, evaluated again (a collective: every rank, first)
        redone = redone_in_earlier_rounds(mine.loops)
        # rank 0's work on the round's rows (a sample metric's values checked) in a phase, as the rest of the
        # run's: a failure there fails every rank at once, none waits in the next collective
        with ranks.phase("taking the round's rows"):
            mine.add(result, self.indices)
            mine.patch(redone)

    def after_round(self) -> bool:
        with ranks.phase("deciding whether to stop"):
            decision = self.stopper.after_round(self.seen) if ranks.is_main_process() else None
        self.decision = ranks.broadcast_object(decision)
        return self.decision is not None

    def results(self) -> list:
        return [_result_of(mine, self.decision, self.request, self.stopper) for mine in self.seen]


def _result_of(mine: Seen, decision: _Decision, request: Request, stopper: _Stopper) -> EvalResult:
    """A model's result of the rows used, as a whole run's merge makes it (:func:`dist_eval.scoring.main_report`,
    then the score intervals shared over the ranks): rank 0 merges its rounds and reports them, in a phase
    (a failure there, a user's metric, fails every rank), and sends the report.
    """
    options, sent, merged, probs = request.options, None, None, None
    bootstrap = (options.bootstrap_resamples, options.bootstrap_seed)
    with ranks.phase("reporting the rows used"):
        if ranks.is_main_process():
            stopping = stopper.report(decision, mine)  # the rounds' time: not the report's bootstrap
            merged = mine.merged()
            report, probs = main_report(merged, mine.num_labels, mine.label_names, request.metrics,
                                        (bootstrap, options.top_k))
            sent = report, stopping
    report, stopping = ranks.broadcast_object(sent)
    cost = score_intervals_everywhere(report, None if merged is None else merged.labels, probs, bootstrap)
    del probs
    report.update(replace(mine.total(), exact_score_intervals=cost).report())
    report["stopping"] = stopping
    return EvalResult(metrics=report, predictions=merged if request.return_logits else without_logits(merged))


def _check_stopping(data, settings: Settings, models: int, sample_metrics) -> None:
    param, value = ("stop_when_decided", True) if settings.stop_when_decided else ("stop_at_width",
                                                                                  settings.stop_at_width)
    if not isinstance(data, Rows) or data.order is None:
        raise UsageError(f"stopping early needs a datasets.Dataset (rows it can order and select), not "
                         f"{type(data).__name__}. Pass the Dataset, or drop {param}.", param=param, value=value)
    if settings.stop_when_decided and models != 2:
        raise UsageError("compares two models on the same rows: use dist_eval.evaluate_pair(first, second, ...) "
                         "(the CLI: two --checkpoint's).", param=param, value=value)
    if models == 2 and not settings.stop_when_decided and settings.stop_at_width is None:
        raise UsageError("evaluate_pair stops early: pass stop_when_decided=True and/or stop_at_width=W.",
                         param="stop_when_decided", value=False)
    _check_metric(settings.stop_metric, sample_metrics)


class Rounds:
    """The set's rows in the --limit order, handed out ``stop_round_rows`` at a time."""

    def __init__(self, rows: Rows, settings: Settings):
        self.data, self.order = rows.dataset, rows.order  # drawn once, in the key order (data.sample.draw_rows)
        self.population = len(self.data)
        self.round_rows = settings.stop_round_rows
        self.number = 0  # rounds handed out
        # each round: an exact evaluation of its rows, none sampled again, none stopping
        self.settings = replace(settings, limit=0, stop_at_width=None, stop_when_decided=False,
                                stop_rule=TIME_UNIFORM)
        if self.population == 0:
            raise UsageError("the evaluated split is empty: nothing to evaluate. Check --data-files and --split.",
                             param="data")

    @property
    def rows_used(self) -> int:
        return min(self.number * self.round_rows, self.population)

    def next_rows(self) -> np.ndarray:
        start = self.number * self.round_rows
        self.number += 1
        return self.order[start:start + self.round_rows]

    def folder(self, resume_folder: Optional[str]) -> Optional[str]:
        """This round's own folder of partial results (its rows are its own evaluation's rows 0..R-1)."""
        return None if resume_folder is None else os.path.join(resume_folder, f"round-{self.number:06d}")


class _Stopper:
    """Rank 0: the confidence sequence of the rounds seen, the decision after each round (stop, or
    None: go on), and each model's ``stopping`` report at the stop.
    """

    def __init__(self, rounds: Rounds, settings: Settings):
        self.rounds, self.settings = rounds, settings
        self.running: Optional[RunningSequence] = None

    def after_round(self, seen: List[Seen]) -> Optional[_Decision]:
        """The decision after the last round of ``seen`` (each model's rounds): the sequence takes its
        values (every round's again after an earlier round was redone: the numbers as they are now),
        then its interval says stop or go on (a paired interval: the second model's minus the first's).
        """
        settings, rounds, paired = self.settings, self.rounds, len(seen) == 2
        again = self.running is None or any(mine.patched for mine in seen)
        earlier = _earlier_values(seen) if again else []
        latest = _round_values(seen)
        for mine in seen:
            mine.patched = False
        if again:
            bounds = paired_bounds(seen[0].bounds) if paired else seen[0].bounds
            self.running = RunningSequence(rounds.population, LEVEL, bounds, width=settings.stop_at_width,
                                           rule=settings.stop_rule)
            for values in earlier:
                self.running.extend(values)
        low, high = self.running.extend(latest)
        reason = stop_reason(low, high, rounds.rows_used, rounds.population, settings.stop_at_width,
                             settings.stop_when_decided)
        if reason is None or not paired:
            return None if reason is None else _Decision(reason, bounds_of(low, high))
        of = (f"the mean difference in {settings.stop_metric} (second - first) over all {rounds.population} rows "
              "of the set")
        better = "second" if low > 0 else "first" if high < 0 else None
        return _Decision(reason, {**bounds_of(low, high), "of": of}, better, paired=True)

    def report(self, decision: _Decision, mine: Seen) -> dict:
        return _stopping_facts(decision, self.settings, mine, self.rounds.population)


class Seen:
    """Rank 0: the rounds' merged rows (indices into the set) and the per-row values of the
    stopping metric of the last round (the running sequence holds those before); every rank:
    the rounds' facts.
    """

    def __init__(self, metric: str, top_k: Optional[int]):
        self.metric, self.top_k = metric, top_k
        self.parts: List[MergedResults] = []
        self.last_values: Optional[np.ndarray] = None  # the last round's, in the order seen
        self.bounds = None
        self.reports: List[dict] = []
        self.round_facts: List[LoopFacts] = []
        self.started = time.perf_counter()
        self.loops: list = []  # this rank's forward loop of each round (exact.evaluate_once's; None: no audit)
        self.patched = False  # rank 0: an earlier round's rows evaluated again since the sequence took them
        self.redone_decisions: set = set()  # rank 0: the rounds after which a decision took numbers redone since

    def add(self, result, rows: np.ndarray) -> None:
        self.reports.append(result.metrics)
        self.round_facts.append(result.facts)
        if len(self.reports) == 1:  # the classes are known once a round is merged: every rank checks alike
            with ranks.phase("checking the stop metric"):
                _check_top_k(self.metric, result.metrics["num_labels"], self.top_k)
        if result.predictions is not None:  # rank 0
            part = result.predictions
            part.indices = rows[part.indices]  # the round's row i is the set's row rows[i]
            self.parts.append(part)
            self.last_values, self.bounds = _stop_values(self.metric, part, self.top_k)

    def patch(self, redone: Dict[int, list]) -> None:
        """Rank 0: the rows of earlier rounds evaluated again (a swarm server of theirs blamed since:
        :func:`dist_eval.predict.redone_in_earlier_rounds`) put in place of the merged ones.
        """
        for index, parts in redone.items():
            part = self.parts[index]
            for redone_rows in parts:
                at = redone_rows["rows"]  # the round's own row numbers: the merged part's positions
                part.preds[at], part.losses[at] = redone_rows["preds"], redone_rows["losses"]
                if part.logits is not None:
                    part.logits[at] = redone_rows["logits"]
                for name, values in part.sample_values.items():
                    values[at] = redone_rows[SAMPLE_VALUE_PREFIX + name]
            # the decisions after this round and until now took its numbers before they were redone
            self.redone_decisions.update(range(index + 1, len(self.parts)))
            self.patched = True

    @property
    def num_labels(self) -> int:
        return self.reports[-1]["num_labels"]

    @property
    def label_names(self):
        return self.reports[-1].get("label_names")

    def merged(self) -> MergedResults:
        """Every row seen, ordered by the set's row index: the merge's own fields (merge.merge_parts)."""
        return merge_parts(self.parts)

    def total(self) -> LoopFacts:
        """What the rounds' loops measured, added up (sums, or the worst batch)."""
        return functools.reduce(operator.add, self.round_facts)


def _check_metric(metric: str, sample_metrics: Optional[Dict]) -> None:
    if metric not in STOP_METRICS and metric not in (sample_metrics or {}):
        custom = f", or a sample_metrics name ({', '.join(sample_metrics)})" if sample_metrics else ""
        raise UsageError(f"expected one of {', '.join(sorted(STOP_METRICS))}{custom}.", param="stop_metric",
                         value=metric)


def _stop_values(metric: str, part: MergedResults, top_k: Optional[int]):
    """(the per-row values of the stopping metric of a round's rows, in their order, and their bounds)."""
    if metric in part.sample_values:
        values = part.sample_values[metric].astype(np.float64)
        if values.size and (values.min() < 0 or values.max() > 1):
            raise UsageError(f"the sample metric's values must lie in [0, 1] to stop on it; got values in "
                             f"[{values.min()}, {values.max()}]. Rescale it to [0, 1].", param="stop_metric",
                             value=metric)
        return values, (0.0, 1.0)
    k = default_top_k(part.logits.shape[1]) if top_k is None else top_k
    return row_values(metric, part.logits, part.labels, top_k=k or 2)


def _check_top_k(metric: str, num_labels: int, top_k: Optional[int]) -> None:
    """top_k_accuracy needs a k below the number of classes (every rank calls it: one line, not a hang)."""
    if metric == "top_k_accuracy" and top_k is None and default_top_k(num_labels) is None:
        raise UsageError(f"top_k_accuracy with {num_labels} classes means nothing (every row is a top-"
                         f"{num_labels} hit). Stop on accuracy or brier.", param="stop_metric", value=metric)


def _earlier_values(seen: List[Seen]) -> list:
    """The values of every round but the last, in order (the sequence taken again after a redo)."""
    values = [[_stop_values(mine.metric, part, mine.top_k)[0] for part in mine.parts[:-1]] for mine in seen]
    return values[0] if len(seen) == 1 else [second - first for first, second in zip(*values)]


def _round_values(seen: List[Seen]) -> np.ndarray:
    """The last round's values the sequence takes: the metric's, or the differences (second - first)."""
    return seen[0].last_values if len(seen) == 1 else seen[1].last_values - seen[0].last_values


@dataclass(frozen=True)
class _Decision:
    """Rank 0's decision after a round, sent to every rank: the interval it stopped on, why."""

    reason: str  # a key of sequential.STOP_REASONS
    interval: dict  # low, high, width; paired: what it is of
    better: Optional[str] = None  # paired: "first", "second" or None (neither)
    paired: bool = False


def _stopping_facts(decision: _Decision, settings: Settings, seen: Seen, population: int) -> dict:
    """``metrics.json``'s ``stopping`` (a :class:`StopReport`): the interval it stopped on, why, rows and time saved."""
    used = sum(r["num_samples"] for r in seen.reports)
    loop = seen.total().eval_loop_seconds
    interval = {"of": f"the mean {settings.stop_metric} over all {population} rows of the set",
                **decision.interval, "level": LEVEL, **describe(settings.stop_rule, settings.stop_at_width, LEVEL)}
    return StopReport(
        metric=settings.stop_metric, stop_at_width=settings.stop_at_width,
        stop_when_decided=settings.stop_when_decided, rule=settings.stop_rule, better=decision.better,
        paired=decision.paired, **where_stopped(interval, decision.reason, used, population, len(seen.reports),
                                                settings.stop_round_rows),
        seconds=round(time.perf_counter() - seen.started, 3),
        seconds_saved_estimate=round(loop / used * (population - used), 3) if used else 0.0,
        metrics_are_of="the rows used: a random sample of the set (the --limit order)" if used < population
                       else "every row of the set",
    ).to_json() | ({"decisions_on_numbers_redone_since": sorted(seen.redone_decisions)} if seen.redone_decisions
                   else {})


def _rows_only(on_batch_done):
    """The callback without its owner: a GlobalProgress counts rows then, not a round's batch plan
    (each round would replace the plan of the whole set).
    """
    if on_batch_done is None:
        return None
    return lambda num_rows: on_batch_done(num_rows)
