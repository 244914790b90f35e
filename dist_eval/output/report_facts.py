"""A report (metrics.json) as its readers show it, read once: the run's, the loop's and the sample's
facts typed (:mod:`dist_eval.loop_facts`, lenient to a report of an older version: what it lacks is
absent), the headline metrics it has, and the stop of a run that stopped early. The summary, the
quiet line, the HTML page and the tracker read a report through it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union

from dist_eval.loop_facts import LoopFacts, RunFacts
from dist_eval.metrics import INTERVAL_METRICS, headline_names
from dist_eval.sequential import StopReport


@dataclass
class ReportFacts:
    """``metrics`` (a report) and what its readers take from it, typed."""

    metrics: dict
    run: RunFacts
    loop: LoopFacts
    stop: Optional[StopReport]  # the stop of a run that stopped early (``stopping``)
    headline: List[str]  # the headline metrics this report has, in order
    intervals: dict  # ``confidence_intervals`` ({} without)
    interval_names: List[str]  # the headline metrics with an interval, in order

    @classmethod
    def of(cls, report: Union[dict, ReportFacts]) -> ReportFacts:
        """``report`` (metrics.json's content) read; one read already, as it is."""
        if isinstance(report, ReportFacts):
            return report
        stop = StopReport.from_json(report["stopping"]) if report.get("stopping") else None
        intervals = report.get("confidence_intervals") or {}
        return cls(report, RunFacts.of(report), LoopFacts.of(report), stop, headline_names(report), intervals,
                   headline_names(report, INTERVAL_METRICS, intervals) if intervals else [])
