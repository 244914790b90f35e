"""What every pair of a CLI run shares, typed (:class:`RunContext`): the flags, the job (:class:`Job`:
the model, data and columns it evaluates), the swarm, the loaded model, the clock. The run's flow
(:mod:`dist_eval.pipeline`) makes and fills it; the report writers (:mod:`dist_eval.output.report`,
:mod:`dist_eval.receipt`) read it, never change it.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from dist_eval.config import EvalConfig, Settings
from dist_eval.plan import Plan


@dataclass
class Job:
    """What this run evaluates: the flags', or the built-in demo's model, data and columns
    (made by :func:`dist_eval.job.prepare`).
    """

    model_dir: str
    split: Optional[str]
    settings: Settings
    plan: Plan
    demo: bool
    head: Optional[str] = None
    dht_prefix: Optional[str] = None  # petals' default for a --model hub id


@dataclass
class Clock:
    """When the run began, for its report's times."""

    started: float  # perf_counter at the start of the run
    started_at: str  # the same moment, ISO 8601 UTC

    @classmethod
    def now(cls) -> Clock:
        return cls(time.perf_counter(), datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


@dataclass
class RunContext:
    """What every pair of the run shares: the flags, the job, the swarm, the clock; the model and
    tokenizer once loaded, the phases before the first pair, each set's rows once drawn.
    """

    config: EvalConfig
    job: Job
    on_swarm: bool  # the backend's model runs on a swarm (--backend petals)
    swarm: Tuple[Optional[List[str]], Optional[str]]  # (initial peers, DHT prefix)
    clock: Clock
    say: Callable[..., None]  # rank 0's print (a no-op elsewhere and under --quiet)
    model: object = None  # the LoadedModel (dist_eval.backends.classifier)
    tokenizer: object = None
    shared_phases: Dict[str, float] = field(default_factory=dict)  # phases before the first pair
    datasets: Dict[Optional[str], object] = field(default_factory=dict)  # set name -> its Rows, drawn once
