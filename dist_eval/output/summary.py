"""The summary printed on the terminal at the end of a run."""
from __future__ import annotations

from typing import Optional

from dist_eval.loop_facts import SampleFacts
from dist_eval.metrics import INTERVAL_METRICS, headline_names
from dist_eval.sequential import StopReport

# "acc", not "accuracy", in the intervals line: the line above is the one that says "accuracy X.XXXX"
_SHORT = {"accuracy": "acc"}


def format_intervals(metrics: dict) -> Optional[str]:
    """``95% CI (bootstrap, 1000 resamples, seed 0): acc [lo, hi] ...``, or None."""
    intervals = metrics.get("confidence_intervals")
    if not intervals:
        return None
    names = headline_names(metrics, INTERVAL_METRICS, intervals)
    parts = "   ".join(f"{_SHORT.get(n, n)} [{intervals[n][0]:.4f}, {intervals[n][1]:.4f}]" for n in names)
    kind = f"cluster bootstrap of {intervals['clusters']} clusters" if "clusters" in intervals else "bootstrap"
    return (f"{100 * intervals['level']:g}% CI ({kind}, {intervals['resamples']} resamples, "
            f"seed {intervals['seed']}): {parts}")


def format_stopping(metrics: dict) -> Optional[str]:
    """What a run that stops early (``stopping`` in metrics.json) stopped on, or None."""
    stop = metrics.get("stopping")
    return StopReport.from_json(stop).sentence() if stop else None


def _rate(run: dict) -> str:
    """The loop's samples/s (the rows it evaluated), or why there is none."""
    if run.get("samples_per_second"):
        return f"{run['samples_per_second']:.1f} samples/s"
    return "no row evaluated" if (run.get("row_store") or {}).get("rows_evaluated") == 0 else "0.0 samples/s"


def format_summary(metrics: dict) -> str:
    """A short, readable summary for the terminal."""
    run = metrics.get("run", {})
    lines = [
        f"dist_eval: {metrics['num_samples']} samples, {run.get('world_size', 1)} rank(s), "
        f"backend {run.get('backend', '?')}, {run.get('wall_seconds', 0):.1f} s wall, "
        f"{_rate(run)} (eval loop)",
        "  " + "   ".join(f"{name} {metrics[name]:.4f}" for name in headline_names(metrics)),
    ]
    sample = SampleFacts.of(metrics)
    if sample.sampled:
        lines.append(f"  a random sample of {sample.rows} of {sample.rows_in_data} rows "
                     f"(--limit {sample.limit} --limit-seed {sample.limit_seed})")
    stopping = format_stopping(metrics)
    if stopping:
        lines.append(f"  {stopping}")
    intervals = format_intervals(metrics)
    if intervals:
        lines.append(f"  {intervals}")
    from dist_eval.clusters import format_clustering

    lines += format_clustering(metrics)
    time_line = _time_line(run)
    if time_line:
        lines.append(time_line)
    if (run.get("row_store") or {}).get("folder"):
        lines.append(format_row_store(run["row_store"]))
    from dist_eval.backends.provenance import replicas_warning

    warning = replicas_warning(run)
    if warning:
        lines.append(warning)
    from dist_eval.backends.audit import summary_line

    audited = summary_line(run)
    if audited:
        lines.append(audited)
    from dist_eval.slices import format_slices

    lines += format_slices(metrics)
    if metrics.get("num_truncated"):
        lines.append(f"  {metrics['num_truncated']} text(s) truncated to --max-length")
    per_class = metrics["per_class"]
    width = max(8, max(len(name) for name in per_class))
    lines.append(f"  {'class':<{width}}  precision  recall      f1  support")
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
    return "\n".join(lines)


def format_row_store(store: dict) -> str:
    """The row store's line: rows it served, rows evaluated, the time it saved; when it served
    none (a first run), where the evaluated rows were kept for the next.
    """
    if store.get("fresh_rows"):
        return (f"  row store: --fresh-rows, none read; {store['rows_evaluated']} evaluated and stored "
                f"({store['folder']})")
    if not store["rows_from_store"]:
        return f"  row store: {store['rows_evaluated']} rows evaluated and stored for later runs ({store['folder']})"
    return (f"  {store['rows_from_store']} rows from the row store, {store['rows_evaluated']} evaluated; "
            f"about {store['seconds_saved']:.1f} s saved ({store['folder']})")


def _time_line(run: dict) -> str:
    """The run's phases that took >= 0.05 s, in order (every phase is in metrics.json)."""
    phases = dict(run.get("phase_seconds") or {})
    if not phases:
        return ""
    if run.get("startup_seconds") is not None:
        phases = {"launch and imports": run["startup_seconds"], **phases}
    shown = [f"{name} {seconds:.1f} s" for name, seconds in phases.items() if seconds >= 0.05]
    return "  time: " + ", ".join(shown)
