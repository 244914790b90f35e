"""The summary printed on the terminal at the end of a run."""
from __future__ import annotations

from typing import List, Optional, Union

from dist_eval.loop_facts import LoopFacts, RunFacts, StoreFacts
from dist_eval.output.report_facts import ReportFacts
from dist_eval.output.slice_lines import format_clustering, format_slices

# "acc", not "accuracy", in the intervals line: the line above is the one that says "accuracy X.XXXX"
_SHORT = {"accuracy": "acc"}


def format_intervals(report: Union[dict, ReportFacts]) -> Optional[str]:
    """``95% CI (bootstrap, 1000 resamples, seed 0): acc [lo, hi] ...``, or None."""
    facts = ReportFacts.of(report)
    intervals = facts.intervals
    if not intervals:
        return None
    parts = "   ".join(f"{_SHORT.get(n, n)} [{intervals[n][0]:.4f}, {intervals[n][1]:.4f}]"
                       for n in facts.interval_names)
    kind = f"cluster bootstrap of {intervals['clusters']} clusters" if "clusters" in intervals else "bootstrap"
    return (f"{100 * intervals['level']:g}% CI ({kind}, {intervals['resamples']} resamples, "
            f"seed {intervals['seed']}): {parts}")


def format_stopping(report: Union[dict, ReportFacts]) -> Optional[str]:
    """What a run that stops early (``stopping`` in metrics.json) stopped on, or None."""
    stop = ReportFacts.of(report).stop
    return stop.sentence() if stop else None


def _rate(loop: LoopFacts) -> str:
    """The loop's samples/s (the rows it evaluated), or why there is none."""
    if loop.samples_per_second:
        return f"{loop.samples_per_second:.1f} samples/s"
    return "no row evaluated" if loop.row_store.rows_evaluated == 0 else "0.0 samples/s"


def format_summary(report: Union[dict, ReportFacts]) -> str:
    """A short, readable summary for the terminal of ``report`` (metrics.json's content, or it read)."""
    facts = ReportFacts.of(report)
    metrics, run, loop = facts.metrics, facts.run, facts.loop
    lines = [
        f"dist_eval: {metrics['num_samples']} samples, {loop.world_size or 1} rank(s), "
        f"backend {run.backend or '?'}, {run.wall_seconds or 0:.1f} s wall, {_rate(loop)} (eval loop)",
        "  " + "   ".join(f"{name} {metrics[name]:.4f}" for name in facts.headline),
    ]
    if run.sample.sampled:
        lines.append(f"  a random sample of {run.sample.rows} of {run.sample.rows_in_data} rows "
                     f"(--limit {run.sample.limit} --limit-seed {run.sample.limit_seed})")
    lines += [f"  {line}" for line in (format_stopping(facts), format_intervals(facts)) if line]
    times = [line for line in (_time_line(run), loop.row_store.folder and format_row_store(loop.row_store)) if line]
    truncated = [f"  {loop.num_truncated} text(s) truncated to --max-length"] if loop.num_truncated else []
    table = _per_class_lines(metrics)
    from dist_eval.backends.petals.audit import summary_line
    from dist_eval.backends.provenance import replicas_warning

    slices = format_slices(metrics)
    clustering = format_clustering(metrics)
    recorded = metrics.get("run") or {}  # the swarm's facts (run.swarm), read by the swarm's own modules
    swarm = [line for line in (replicas_warning(recorded), summary_line(recorded)) if line]
    return "\n".join(lines + clustering + times + swarm + slices + truncated + table)


def _per_class_lines(metrics: dict) -> List[str]:
    """The per-class table and the confusion matrix."""
    per_class = metrics["per_class"]
    width = max(8, max(len(name) for name in per_class))
    lines = [f"  {'class':<{width}}  precision  recall      f1  support"]
    for name, values in per_class.items():
        lines.append(
            f"  {name:<{width}}  {values['precision']:9.4f}  {values['recall']:6.4f}  {values['f1']:6.4f}  "
            f"{values['support']:7d}"
        )
    cm = metrics["confusion_matrix"]
    cell = max(5, max(len(str(v)) for row in cm for v in row) + 1)
    lines.append("  confusion matrix (rows = true, columns = predicted):")
    for name, row in zip(per_class, cm):
        lines.append(f"  {name:<{width}}" + "".join(f"{v:>{cell}d}" for v in row))
    return lines


def format_row_store(store: Union[dict, StoreFacts]) -> str:
    """The row store's line: rows it served, rows evaluated, the time it saved; when it served
    none (a first run), where the evaluated rows were kept for the next.
    """
    store = StoreFacts(**store) if isinstance(store, dict) else store
    if store.fresh_rows:
        return f"  row store: --fresh-rows, none read; {store.rows_evaluated} evaluated and stored ({store.folder})"
    if not store.rows_from_store:
        return f"  row store: {store.rows_evaluated} rows evaluated and stored for later runs ({store.folder})"
    return (f"  {store.rows_from_store} rows from the row store, {store.rows_evaluated} evaluated; "
            f"about {store.seconds_saved:.1f} s saved ({store.folder})")


def _time_line(run: RunFacts) -> str:
    """The run's phases that took >= 0.05 s, in order (every phase is in metrics.json)."""
    phases = dict(run.phase_seconds)
    if not phases:
        return ""
    if run.startup_seconds is not None:
        phases = {"launch and imports": run.startup_seconds, **phases}
    shown = [f"{name} {seconds:.1f} s" for name, seconds in phases.items() if seconds >= 0.05]
    return "  time: " + ", ".join(shown)
