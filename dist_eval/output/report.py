"""The run's report, written by rank 0: what ``metrics.json`` says of the run (:func:`run_facts`,
built in this one place and added by :func:`add_run_facts`), the rows' texts and slices for
``predictions.jsonl``, the files, the summary on the terminal, the tracker, and the shutdown's
times once every process has stopped.

The CLI's flow (:mod:`dist_eval.pipeline`) calls it with its session (the flags, the job, the
clock, the swarm, the model: read here, never changed).
"""
from __future__ import annotations

import os
import platform
import time
from typing import TYPE_CHECKING, Dict, List, Optional

from dist_eval import ranks

if TYPE_CHECKING:
    from dist_eval.config import EvalConfig, Settings
    from dist_eval.plan import Pair


# What a run key is made of, as run_facts names them: a shard's manifest names them too (shard_files)
RUN_KEY_FACTS = ("model", "checkpoint", "head", "data_files", "split", "backend")


def run_facts(session, pair: Pair, pair_started: float) -> dict:
    """What a report's metrics.json records of the run, besides what the merge measured. For a
    plan of one pair, its times count from the run's start; with several, from the pair's, and
    ``pair`` names it and the phases the pairs shared.
    """
    config, job, several = session.config, session.job, session.job.plan.several
    facts = dict(
        backend=config.backend,
        model=os.path.abspath(job.model_dir),
        data_files=[os.path.abspath(p) if os.path.exists(p) else p for p in pair.data.files],
        split=job.split,
        checkpoint=os.path.abspath(pair.checkpoint.path) if pair.checkpoint.path else None,
        head=os.path.abspath(job.head) if job.head else None,
        demo=job.demo,
        label_words=list(job.settings.label_words) if job.settings.label_words else None,
        template=job.settings.template,
        batch_size=job.settings.batch_size,
        max_length=job.settings.max_length,
        max_batch_tokens=job.settings.max_batch_tokens or 0,
        length_buckets=job.settings.length_buckets,
        in_flight=config.options.in_flight,
        initial_peers=list(session.swarm[0] or []),
        dht_prefix=session.swarm[1],
        started_at=session.clock.started_at,
        wall_seconds=time.perf_counter() - (pair_started if several else session.clock.started),
        startup_seconds=_startup_seconds(session.clock.started),
        phase_seconds=_rounded(report_phases(session)),
        versions=_versions(),
    )
    if several:
        facts["pair"] = {"checkpoint": pair.checkpoint.name, "set": pair.data.name, "folder": pair.folder,
                         "shared_phase_seconds": _rounded(session.shared_phases)}
    from dist_eval.backends.kinds import backend_kind

    on_swarm = backend_kind(config.backend).on_swarm
    swarm = session.model.provenance() if on_swarm else None  # every rank's: each client audits its own forwards
    if on_swarm:  # added up here
        from dist_eval.backends.audit import combine

        audited = combine(ranks.all_gather_object((swarm or {}).get("audit")))
        if swarm is not None and audited is not None:
            swarm["audit"] = audited
    if swarm is not None and ranks.is_main_process():  # a petals run: the servers as announced in the DHT
        facts["swarm"] = swarm
    return facts


def add_run_facts(metrics: dict, session, pair: Pair, pair_started: float, run_key: str, rows) -> None:
    """``metrics["run"]`` (what the loop measured) completed with :func:`run_facts`, the run key
    and what ``rows`` (the run's :class:`~dist_eval.data.sample.Rows`) record of the --limit sample.
    Every rank calls it (a swarm's audit is added up over them).
    """
    metrics["run"].update(run_facts(session, pair, pair_started), run_key=run_key, sample=rows.facts())


def report_phases(session) -> Dict[str, float]:
    """The phases a report records, so far: the pair's own; for a plan of one pair, the run's
    shared ones before them too (with several pairs they go to ``pair.shared_phase_seconds``).
    """
    own = dict(ranks.phase_seconds)
    return own if session.job.plan.several else {**session.shared_phases, **own}


def record_shutdown(reports: List, clock, shutdown_began: float, say) -> None:
    """Rank 0, once every process of the run has stopped: each report's (its ``folder``,
    ``metrics``, ``phases``) metrics.json gains the times of its report and of the shutdown (the
    client, the other ranks, the local swarm), and the run's total from the launch; one line
    says them. ``clock``: the run's (``started``, a perf_counter time).
    """
    from dist_eval.output.files import write_metrics

    shutdown = round(time.perf_counter() - shutdown_began, 3)
    for report in reports:
        run = report.metrics["run"]
        run["phase_seconds"] = {**_rounded(report.phases), "shutting down": shutdown}
        run["total_seconds"] = round((run.get("startup_seconds") or 0.0) + time.perf_counter() - clock.started, 3)
        write_metrics(report.folder, report.metrics)
    if reports:
        run = reports[-1].metrics["run"]
        say(f"dist_eval: done in {run['total_seconds']:.1f} s from the launch (writing the report "
            f"{run['phase_seconds'].get('writing the report', 0.0):.1f} s, shutting down {shutdown:.1f} s)",
            flush=True)


def _startup_seconds(started: float) -> Optional[float]:
    """Seconds from this process's start to ``started`` (a perf_counter time): the run's own
    start-up and imports, before the first phase, by the kernel's clock.

    Not from torchrun's start (this process's parent): /proc gives a process's fork time, and
    a shell that ``exec``s torchrun after other work (``bash -c './launch/install.sh &&
    torchrun ...'``) hands torchrun its own start, so the install counted as the launch.
    torchrun's own start-up, before it starts the ranks, is not counted.
    """
    alive = _seconds_alive(os.getpid())
    return None if alive is None else round(max(0.0, alive - (time.perf_counter() - started)), 3)


def _rounded(phases: Dict[str, float]) -> Dict[str, float]:
    """{phase: seconds}, in order, to the millisecond."""
    return {name: round(seconds, 3) for name, seconds in phases.items()}


def _seconds_alive(pid: int) -> Optional[float]:
    """How long process ``pid`` has been running (from /proc; None where that is unknown)."""
    from dist_eval.procs import start_time

    try:
        start_ticks = int(start_time(pid))
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError, TypeError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for package in ("dist_eval", "torch", "transformers", "datasets", "petals", "hivemind"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def texts_of(config: EvalConfig, settings: Settings, rows, slices: Optional[dict] = None) -> Optional[dict]:
    """Rank 0: with --save-text, {"text": ..., "text_pair": ...} of every row of ``rows`` (the run's
    :class:`~dist_eval.data.sample.Rows`), in row order; with --slice-by, {"slice": {column: value}} of
    every row; with --cluster-by, {"cluster": name}; always {"key": each row's content key}
    (:attr:`dist_eval.data.sample.Rows.keys`).
    """
    from dist_eval.output.files import ColumnCells, RowSlices

    # each a sequence by row index, its cells made or read as predictions.jsonl is written (issue 51)
    out = {"key": rows.keys}  # each row's content: compare pairs two runs' rows by it
    if config.save_text:
        columns = {"text": settings.text_column, "text_pair": settings.text_pair_column}
        out.update({key: ColumnCells(rows.dataset, column) for key, column in columns.items() if column})
    if slices:  # each row's slices (evaluate()'s EvalResult.slices)
        out["slice"] = RowSlices(slices)
    if rows.clusters is not None:  # each row's cluster (--cluster-by), read with the rows
        out["cluster"] = rows.clusters[1]
    return out


def write_report(config: EvalConfig, out: str, result, say, texts: Optional[dict] = None) -> None:
    """Rank 0: predictions.jsonl, metrics.json and the report files in ``out``; the summary; the tracker."""
    from dist_eval.output.files import write_metrics, write_predictions, write_report_files
    from dist_eval.output.summary import format_summary
    from dist_eval.output.tracking import log_to_tracker
    from dist_eval.sequential import StopReport

    metrics = result.metrics
    write_predictions(out, result.predictions, metrics.get("label_names"), config.save_logits, texts)
    path = write_metrics(out, metrics)
    files = write_report_files(out, metrics)
    if config.quiet:
        stop = StopReport.from_json(metrics["stopping"]) if metrics.get("stopping") else None
        stopped = (f" (stopped after {stop.rows_used} of {stop.rows_in_set} rows: {stop.reason}, "
                   f"95% {'time-uniform' if stop.interval['time_uniform'] else 'fixed-width rule'} interval "
                   f"[{stop.interval['low']:.4f}, {stop.interval['high']:.4f}])"
                   if stop else "")
        print(f"dist_eval: accuracy {metrics['accuracy']:.4f} on {metrics['num_samples']} samples{stopped} -> {path}")
    else:
        print(format_summary(metrics))
        names = ", ".join(os.path.basename(f) for f in [path, os.path.join(out, "predictions.jsonl"), *files])
        print(f"  report: {os.path.join(out, 'report.html')} ({names} in {out})", flush=True)
    png = os.path.join(out, "confusion_matrix.png")
    where = log_to_tracker(config.report_to, metrics, out, png if png in files else None)
    if where:
        say(f"  logged to {config.report_to}: {where}", flush=True)
