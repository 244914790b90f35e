"""report.html: one self-contained page (inline CSS, the figures as base64 data URIs)
that opens from the file system: headline metrics with their confidence intervals, the
per-class table, the confusion matrix and the facts of the run.

The page is ``templates/report.html.j2`` (and its ``report.css``), package data rendered by
jinja2 with autoescape on: every text of a run (class names, paths, the title) is escaped
there. This module gathers what the template shows.
"""
from __future__ import annotations

import base64
import functools
from typing import Optional

from dist_eval.loop_facts import SampleFacts
from dist_eval.metrics import headline_names
from dist_eval.output.per_class import class_names, per_class_rows
from dist_eval.output.report_facts import ReportFacts
from dist_eval.output.slice_lines import slices_of

_CARD_TITLES = {
    "accuracy": "Accuracy", "f1_macro": "Macro F1", "f1_weighted": "Weighted F1", "precision_macro": "Macro precision",
    "recall_macro": "Macro recall", "loss": "Loss (cross-entropy)", "ece": "ECE (15 bins)", "brier": "Brier score",
    "auroc_macro": "AUROC (macro OvR)",
}
_ALL_METRICS = (
    ("accuracy", "accuracy (= micro P/R/F1)"),
    ("precision_macro", "precision, macro"),
    ("recall_macro", "recall, macro"),
    ("f1_macro", "F1, macro"),
    ("precision_weighted", "precision, weighted"),
    ("recall_weighted", "recall, weighted"),
    ("f1_weighted", "F1, weighted"),
    ("loss", "loss (mean cross-entropy)"),
    ("ece", "expected calibration error (15 equal-width bins)"),
    ("brier", "Brier score (mean sum of squares, range [0, 2])"),
    ("top{k}_accuracy", "top-k accuracy"),
    ("auroc_macro", "AUROC, one-vs-rest macro (positive class with 2)"),
)


def _title(key: str, titles: dict) -> str:
    if key.startswith("top") and key.endswith("_accuracy"):
        return f"Top-{key[3:-len('_accuracy')]} accuracy"
    return titles[key]


def _slice_rows(metrics: dict) -> list:
    """Every slice (--slice-by), lowest accuracy first: its cells, and a one-row plot of its
    accuracy and 95% interval on [0, 1] (inline SVG), the whole set's accuracy dashed.
    """
    if not metrics.get("slices"):
        return []
    rows = []
    for column, name, values in slices_of(metrics["slices"]):
        ci = (values.get("confidence_intervals") or {}).get("accuracy")
        rows.append({
            "column": column, "name": name, "rows": values["num_samples"], "accuracy": f"{values['accuracy']:.4f}",
            "ci": f"[{ci[0]:.4f}, {ci[1]:.4f}]" if ci else values.get("interval_note", ""),
            "f1": f"{values['f1_macro']:.4f}",
            "loss": f"{values['loss']:.4f}" if values.get("loss") is not None else "",
            "plot": _interval_svg(values["accuracy"], ci, metrics["accuracy"]),  # markup of numbers only: |safe
        })
    return rows


def _slices_note(metrics: dict) -> Optional[dict]:
    report = metrics.get("slices")
    if not report:
        return None
    used = report["rows"] != report["rows_in_set"]
    return {"columns": ", ".join(report["columns"]), "rows": report["rows"],
            "rows_in_set": report["rows_in_set"] if used else None, "min_rows": report["min_rows_for_interval"]}


def _interval_svg(value: float, interval: Optional[list], whole: float, width: int = 220) -> str:
    """A one-row forest plot: the interval as a line, the value as a dot, ``whole`` dashed."""
    x = [round(4 + (width - 8) * min(1.0, max(0.0, v)), 1) for v in (value, whole, *(interval or ()))]
    line = f'<line x1="{x[2]}" x2="{x[3]}" y1="8" y2="8" stroke="#4c8ed9" stroke-width="3"/>' if interval else ""
    return (f'<svg width="{width}" height="16" role="img" aria-label="accuracy {value:.4f}">'
            f'<line x1="4" x2="{width - 4}" y1="8" y2="8" stroke="#d0d7de"/>'
            f'<line x1="{x[1]}" x2="{x[1]}" y1="1" y2="15" stroke="#8c959f" stroke-dasharray="2,2"/>{line}'
            f'<circle cx="{x[0]}" cy="8" r="4" fill="{"#1f2328" if interval else "#fff"}" stroke="#1f2328"/></svg>')


def _sample_text(sample: SampleFacts) -> Optional[str]:
    if not sample.sampled:
        return None
    return (f"{sample.rows} of {sample.rows_in_data} rows, a random sample (--limit {sample.limit} "
            f"--limit-seed {sample.limit_seed}), chosen by a hash of each row's content")


def _run_facts(report: ReportFacts) -> list:
    """The page's table of the run: (name, value) of what the report records."""
    metrics, run, loop = report.metrics, report.run, report.loop
    facts = [
        ("samples", metrics["num_samples"]),
        ("classes", metrics["num_labels"]),
        ("data", ", ".join(run.data_files) or None),
        ("split", run.split),
        ("sample (--limit)", _sample_text(run.sample)),
        ("stopped early", report.stop.sentence() if report.stop else None),
        ("model", run.model),
        ("checkpoint", run.checkpoint),
        ("backend", run.backend),
        ("world size (ranks)", loop.world_size),
        ("samples per rank", loop.per_rank_samples),
        ("batch size", run.batch_size),
        ("max length", run.max_length),
        ("texts truncated", metrics.get("num_truncated")),
        ("swarm peers", ", ".join(run.initial_peers) or None),
        ("DHT prefix", run.dht_prefix),
        ("started at", run.started_at),
        ("wall time", f"{run.wall_seconds:.1f} s" if run.wall_seconds is not None else None),
        ("eval loop", f"{loop.eval_loop_seconds:.1f} s" if loop.eval_loop_seconds is not None else None),
        ("samples/s (eval loop)", f"{loop.samples_per_second:.1f}" if loop.samples_per_second else None),
        ("versions", ", ".join(f"{k} {v}" for k, v in run.versions.items() if v)),
    ]
    return [(key, value) for key, value in facts if value not in (None, "")]


@functools.lru_cache(maxsize=1)
def _environment():
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("dist_eval.output", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )


def _interval(metrics: dict, name: str) -> Optional[list]:
    return (metrics.get("confidence_intervals") or {}).get(name)


def _metric_rows(metrics: dict, names: list, titles: dict) -> list:
    """A row of each metric ``names`` (this run's) says, with its interval."""
    return [{"title": _title(key, titles), "value": metrics[key], "ci": _interval(metrics, key)} for key in names]


def _base64(png: Optional[bytes]) -> Optional[str]:
    return base64.b64encode(png).decode("ascii") if png else None


def render_html(
    metrics: dict,
    confusion_png: Optional[bytes] = None,
    title: str = "dist_eval report",
    reliability_png: Optional[bytes] = None,
) -> str:
    """The whole page as a string; ``confusion_png`` is embedded when given, else the
    matrix appears as a table only; ``reliability_png`` (the reliability diagram) when given.
    """
    facts = ReportFacts.of(metrics)
    run = facts.run
    subtitle = [x for x in (f"{metrics['num_samples']} samples, {metrics['num_labels']} classes",
                            ", ".join(run.data_files), run.started_at) if x]
    names = class_names(metrics)
    beside = ["metrics.json", "predictions.jsonl", "per_class.csv", "per_class.md"]
    beside += ["slices.csv"] if metrics.get("slices") else []
    beside += ["confusion_matrix.png"] if confusion_png else []
    beside += ["reliability_diagram.png"] if reliability_png else []
    return _environment().get_template("report.html.j2").render(
        title=title,
        subtitle=subtitle,
        num_truncated=metrics.get("num_truncated"),
        max_length=run.max_length if run.max_length is not None else "?",
        cards=_metric_rows(metrics, facts.headline, _CARD_TITLES),
        metric_rows=_metric_rows(metrics, headline_names(metrics, [key for key, _ in _ALL_METRICS]),
                                 dict(_ALL_METRICS)),
        intervals=metrics.get("confidence_intervals"),
        clustering=metrics.get("clustering"),
        per_class=per_class_rows(metrics),
        class_names=names,
        confusion=list(zip(names, metrics["confusion_matrix"])),
        confusion_png=_base64(confusion_png),
        reliability_png=_base64(reliability_png),
        facts=_run_facts(facts),
        slices=_slice_rows(metrics),
        slices_note=_slices_note(metrics),
        beside=beside,
    )
