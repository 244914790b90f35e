"""The run's report, written by rank 0: what ``metrics.json`` says of the run (:func:`run_facts`,
a :class:`~dist_eval.loop_facts.RunFacts` built in this one place), the rows' texts and slices for
``predictions.jsonl``, the files, the summary on the terminal, the tracker, a shard's files, and
the shutdown's times once every process has stopped.

The CLI's flow (:mod:`dist_eval.pipeline`) hands each evaluated pair to :func:`report_pair` with
its context (the flags, the job, the clock, the swarm, the model: read here, never changed).
"""
from __future__ import annotations

import contextlib
import os
import platform
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

from dist_eval import ranks
from dist_eval.loop_facts import RunFacts, SampleFacts
from dist_eval.receipt import build as build_receipt

if TYPE_CHECKING:
    from dist_eval.config import EvalConfig, Settings
    from dist_eval.plan import Pair
    from dist_eval.run_context import RunContext


@dataclass
class Written:
    """Rank 0: a pair's report written in ``folder``, completed with the shutdown's times once every
    process has stopped (:func:`record_shutdown`).
    """

    folder: str
    metrics: dict
    facts: RunFacts
    phases: Dict[str, float]  # the pair's own, to the end of its report's writing (facts.phase_seconds: before)


def report_pair(context: RunContext, pair: Pair, result, where: tuple, rows, pair_started: float) -> Optional[Written]:
    """The pair's report: every rank adds up the run's facts (:func:`run_facts`); rank 0 writes the
    report in ``where`` = (its folder, the partial results' folder, the run key, the run key of the
    checkpoint it was compared with or None), a shard's files last, marks the partial results finished,
    and returns it for the shutdown's times.
    """
    out, folder, key, partner = where
    facts = run_facts(context, pair, pair_started, (key, partner), rows)
    result.metrics["run"].update(facts.report())
    with ranks.phase("writing the report"):
        if ranks.is_main_process():
            config = context.config
            texts = texts_of(config, context.job.settings, rows, getattr(result, "slices", None))
            receipt = partial(build_receipt, context, pair, result, rows)
            write_report(config, out, result, context.say, texts, receipt)
            if config.options.shard is not None:  # what dist_eval.shard_merge reads: written last
                from dist_eval.output.shard_files import write_shard

                write_shard(out, result, context, pair, rows, texts)
    if not ranks.is_main_process():
        return None
    if folder is not None:
        from dist_eval import resume

        resume.finished(folder)  # the report is complete: the partial results have served
    return Written(out, result.metrics, facts, dict(ranks.phase_seconds))


def run_facts(context: RunContext, pair: Pair, pair_started: float, run_keys: tuple, rows) -> RunFacts:
    """What a report's metrics.json records of the run, besides what the loop measured: ``rows``
    (the run's :class:`~dist_eval.data.sample.Rows`) give the --limit sample; ``run_keys``: (its run
    key, the run key of the checkpoint it was compared with or None). For a plan of one
    pair, its times count from the run's start; with several, from the pair's, and ``pair`` names
    it, the phases the pairs shared and the run it was compared with (--resume skips a comparison only
    when its two reports name each other). Every rank calls it (a swarm's audit is added up over them).
    """
    config, job, several = context.config, context.job, context.job.plan.several
    settings, (run_key, compared_with) = job.settings, run_keys
    facts = RunFacts(
        backend=config.backend,
        model=os.path.abspath(job.model_dir),
        data_files=[os.path.abspath(p) if os.path.exists(p) else p for p in pair.data.files],
        split=job.split,
        checkpoint=(os.path.abspath(pair.checkpoint.path) if os.path.exists(pair.checkpoint.path)  # not a hub id
                    else pair.checkpoint.path) if pair.checkpoint.path else None,
        head=os.path.abspath(job.head) if job.head else None,
        demo=job.demo,
        label_words=list(settings.label_words) if settings.label_words else None,
        template=settings.template,
        batch_size=settings.batch_size,
        max_length=settings.max_length,
        max_batch_tokens=settings.max_batch_tokens or 0,
        length_buckets=settings.length_buckets,
        in_flight=config.options.in_flight,
        initial_peers=list(context.swarm[0] or []),
        dht_prefix=context.swarm[1],
        started_at=context.clock.started_at,
        wall_seconds=time.perf_counter() - (pair_started if several else context.clock.started),
        startup_seconds=_startup_seconds(context.clock.started),
        phase_seconds=_rounded(_report_phases(context)),
        versions=_versions(),
        run_key=run_key,
        sample=SampleFacts(**rows.facts()),
    )
    if several:
        facts.pair = {"checkpoint": pair.checkpoint.name, "set": pair.data.name, "folder": pair.folder,
                      "shared_phase_seconds": _rounded(context.shared_phases)}
        if compared_with is not None:  # --stop-when-decided: its stop was decided against that run's rows
            facts.pair["compared_with_run_key"] = compared_with
    if context.on_swarm:
        facts.swarm = _swarm_facts(context.model)
    return facts


def _swarm_facts(model) -> Optional[dict]:
    """Rank 0, a swarm's run: its servers as announced in the DHT, with the audit of every rank's
    client (each audits its own forwards) added up, and the servers of other RoPE any rank left out; every rank
    calls it.
    """
    from dist_eval.backends.petals.audit import combine

    swarm = model.provenance()
    gathered = ranks.all_gather_object([(swarm or {}).get(key) for key in ("audit", "rope_left_out")])
    audited = combine([audit for audit, _ in gathered])
    if swarm is not None and audited is not None:
        swarm["audit"] = audited
    # the servers of other RoPE every rank left out (one may have met a server the others did not)
    left_out = {peer: differ for _, part in gathered if part for peer, differ in part.items()}
    if swarm is not None and left_out:
        swarm["rope_left_out"] = dict(sorted(left_out.items()))
    return swarm if ranks.is_main_process() else None


def _report_phases(context: RunContext) -> Dict[str, float]:
    """The phases a report records, so far: the pair's own; for a plan of one pair, the run's
    shared ones before them too (with several pairs they go to ``pair.shared_phase_seconds``).
    """
    own = dict(ranks.phase_seconds)
    return own if context.job.plan.several else {**context.shared_phases, **own}


def record_shutdown(reports: List[Written], clock, shutdown_began: float, say) -> None:
    """Rank 0, once every process of the run has stopped: each report's metrics.json gains the times
    of its report and of the shutdown (the client, the other ranks, the local swarm), and the run's
    total from the launch; one line says them. ``clock``: the run's (``started``, a perf_counter time).
    """
    from dist_eval.output.files import write_metrics

    shutdown = round(time.perf_counter() - shutdown_began, 3)
    for report in reports:
        phases = {**report.facts.phase_seconds, **_rounded(report.phases), "shutting down": shutdown}
        report.facts = replace(report.facts, phase_seconds=phases,
                               total_seconds=round((report.facts.startup_seconds or 0.0)
                                                   + time.perf_counter() - clock.started, 3))
        report.metrics["run"].update(report.facts.report())
        write_metrics(report.folder, report.metrics)
    if reports:
        facts = reports[-1].facts
        say(f"dist_eval: done in {facts.total_seconds:.1f} s from the launch (writing the report "
            f"{facts.phase_seconds.get('writing the report', 0.0):.1f} s, shutting down {shutdown:.1f} s)",
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
    """{package: version} of python, datasets, dist_eval (with its code's digest) and the libraries that compute a
    row (the row store's and the resume key's, which the shards' merge compares: dist_eval.shard_merge.check_versions).
    """
    from importlib import metadata

    from dist_eval.backends.provenance import dist_eval_version, library_versions

    out = {"python": platform.python_version(), "dist_eval": dist_eval_version()}
    try:
        out["datasets"] = metadata.version("datasets")
    except metadata.PackageNotFoundError:
        out["datasets"] = None
    return {**out, **library_versions()}


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


def write_report(config: EvalConfig, out: str, result, say, texts: Optional[dict] = None,
                 receipt: Optional[Callable[[str], dict]] = None) -> None:
    """Rank 0: predictions.jsonl, metrics.json and the report files in ``out``; the summary; the tracker.
    ``receipt(the path of predictions.jsonl, written and closed)``: metrics.json's ``run.receipt``
    (:mod:`dist_eval.receipt`; without one, or None from it, none: a receipt copied from elsewhere, as a
    shard's into its merge's run facts, is dropped, it would not be this report's).
    """
    from dist_eval.output.files import write_metrics, write_predictions, write_report_files
    from dist_eval.output.report_facts import ReportFacts
    from dist_eval.output.summary import format_summary
    from dist_eval.output.tracking import log_to_tracker

    metrics = result.metrics
    with figures_aside(metrics, len(result.predictions.indices)) as figures:
        predictions = write_predictions(out, result.predictions, metrics.get("label_names"), config.save_logits,
                                        texts)
        metrics.setdefault("run", {}).pop("receipt", None)
        made = receipt(predictions) if receipt is not None else None
        if made is not None:  # written once: the shutdown's rewrite of metrics.json keeps it as it is
            metrics["run"]["receipt"] = made
        path = write_metrics(out, metrics)
        files = write_report_files(out, metrics, drawn=figures.drawn())
    report = ReportFacts.of(metrics)  # read once: the summary and the tracker say the same
    if config.quiet:
        stop = report.stop
        stopped = (f" (stopped after {stop.rows_used} of {stop.rows_in_set} rows: {stop.reason}, "
                   f"95% {'time-uniform' if stop.interval['time_uniform'] else 'fixed-width rule'} interval "
                   f"[{stop.interval['low']:.4f}, {stop.interval['high']:.4f}])"
                   if stop else "")
        print(f"dist_eval: accuracy {metrics['accuracy']:.4f} on {metrics['num_samples']} samples{stopped} -> {path}")
    else:
        print(format_summary(report))
        names = ", ".join(os.path.basename(f) for f in [path, os.path.join(out, "predictions.jsonl"), *files])
        print(f"  report: {os.path.join(out, 'report.html')} ({names} in {out})", flush=True)
    png = os.path.join(out, "confusion_matrix.png")
    where = log_to_tracker(config.report_to, report, out, png if png in files else None)
    if where:
        say(f"  logged to {config.report_to}: {where}", flush=True)


# seconds the report waits for its figures from the child before it draws them itself (a child stuck, e.g. on
# a lock a thread of the parent held at the fork, is killed)
FIGURES_TIMEOUT = 120.0


class _Figures:
    """The report's figures, drawn in a forked child beside rank 0 (:class:`dist_eval.aside.Aside`) or not yet."""

    def __init__(self, child):
        self.child = child

    def drawn(self) -> Optional[dict]:
        """:func:`dist_eval.output.files.draw_figures`' result from the child; None: to be drawn here (no child, or
        a child that gave none: the same figures either way).
        """
        from dist_eval.aside import AsideFailed

        if self.child is None:
            return None
        try:
            return self.child.result(timeout=FIGURES_TIMEOUT)
        except AsideFailed:
            return None


@contextlib.contextmanager
def figures_aside(metrics: dict, rows: int):
    """The figures of ``metrics`` drawn in a forked child while rank 0 writes predictions.jsonl, from
    ``chunk_rows("aside")`` rows on (matplotlib's import and its drawing, on a core the other ranks leave
    idle); killed and reaped on the way out, whatever happened.
    """
    from dist_eval.aside import started
    from dist_eval.chunks import chunk_rows
    from dist_eval.output.files import draw_figures

    # None: no child to be had, the figures drawn here
    child = started(lambda: draw_figures(metrics)) if rows >= chunk_rows("aside") else None
    try:
        yield _Figures(child)
    finally:
        if child is not None:
            child.close()
