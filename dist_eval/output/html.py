"""report.html: one self-contained page (inline CSS, the figure as a base64 data URI)
that opens from the file system: headline metrics with their confidence intervals, the
per-class table, the confusion matrix and the facts of the run.
"""
from __future__ import annotations

import base64
import html
from typing import Iterable, Optional

from dist_eval.metrics import headline_names
from dist_eval.output.per_class import class_names, per_class_rows
from dist_eval.output.summary import format_stopping

_CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; color: #1f2328;
       margin: 0; background: #f6f8fa; }
main { max-width: 1100px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 32px 0 10px; padding-bottom: 4px; border-bottom: 1px solid #d0d7de; }
.sub { color: #57606a; font-size: 13px; margin: 0 0 18px; word-break: break-all; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; }
.card { background: #fff; border: 1px solid #d0d7de; border-radius: 8px; padding: 12px 16px; min-width: 170px; }
.card .name { color: #57606a; font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.card .value { font-size: 26px; font-weight: 600; margin: 2px 0; font-variant-numeric: tabular-nums; }
.card .ci { color: #57606a; font-size: 12px; font-variant-numeric: tabular-nums; }
table { border-collapse: collapse; background: #fff; font-size: 13px; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #d0d7de; padding: 5px 10px; }
th { background: #f0f3f6; text-align: left; }
td.num { text-align: right; }
td.key { color: #57606a; white-space: nowrap; }
td.val { word-break: break-all; }
.bar { display: inline-block; height: 8px; background: #4c8ed9; border-radius: 2px; vertical-align: middle;
       margin-left: 6px; }
.note { color: #57606a; font-size: 12px; margin-top: 6px; }
.warn { background: #fff8c5; border: 1px solid #d4a72c; border-radius: 6px; padding: 8px 12px; font-size: 13px; }
img.cm { max-width: 100%; background: #fff; border: 1px solid #d0d7de; border-radius: 6px; }
details { margin-top: 10px; }
footer { color: #8c959f; font-size: 12px; margin-top: 36px; }
"""

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


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _interval(metrics: dict, name: str) -> Optional[list]:
    return (metrics.get("confidence_intervals") or {}).get(name)


def _table(header: Iterable[str], rows: Iterable[str]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _cards(metrics: dict) -> str:
    out = []
    for key in headline_names(metrics):
        title = _title(key, _CARD_TITLES)
        ci = _interval(metrics, key)
        ci_text = f"95% CI [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "&nbsp;"
        out.append(
            f'<div class="card"><div class="name">{_e(title)}</div>'
            f'<div class="value">{metrics[key]:.4f}</div><div class="ci">{ci_text}</div></div>'
        )
    return f'<div class="cards">{"".join(out)}</div>'


def _metrics_table(metrics: dict) -> str:
    rows = []
    titles = dict(_ALL_METRICS)
    for key in headline_names(metrics, [key for key, _ in _ALL_METRICS]):
        title = _title(key, titles)
        ci = _interval(metrics, key)
        ci_cell = f"[{ci[0]:.4f}, {ci[1]:.4f}]" if ci else ""
        rows.append(
            f'<tr><td>{_e(title)}</td><td class="num">{metrics[key]:.4f}</td><td class="num">{ci_cell}</td></tr>'
        )
    table = _table(("metric", "value", "95% CI"), rows)
    intervals = metrics.get("confidence_intervals")
    note = (
        f"Intervals: {_e(intervals['method'])}, {intervals['resamples']} resamples, seed {intervals['seed']}, "
        f"level {intervals['level']:g}; macro averages count every class, absent ones as 0."
        if intervals
        else "No confidence intervals (bootstrap disabled)."
    )
    return table + f'<div class="note">{note}</div>'


def _per_class_table(metrics: dict) -> str:
    rows = []
    for r in per_class_rows(metrics):
        bar = f'<span class="bar" style="width:{60 * r["f1"]:.0f}px"></span>'
        rows.append(
            f'<tr><td>{_e(r["class"])}</td><td class="num">{r["label"]}</td><td class="num">{r["precision"]:.4f}</td>'
            f'<td class="num">{r["recall"]:.4f}</td><td class="num">{r["f1"]:.4f}{bar}</td>'
            f'<td class="num">{r["support"]}</td><td class="num">{r["predicted"]}</td></tr>'
        )
    return _table(("class", "label", "precision", "recall", "F1", "support", "predicted"), rows)


def _slices_section(metrics: dict) -> str:
    """Every slice (--slice-by), lowest accuracy first: a table whose last column plots its
    accuracy and 95% interval on [0, 1] (inline SVG), the whole set's accuracy dashed.
    """
    from dist_eval.slices import slices_of

    report = metrics.get("slices")
    if not report:
        return ""
    rows = []
    for column, name, values in slices_of(report):
        ci = _interval(values, "accuracy")
        ci_cell = f"[{ci[0]:.4f}, {ci[1]:.4f}]" if ci else _e(values.get("interval_note", ""))
        loss = f"{values['loss']:.4f}" if values.get("loss") is not None else ""
        rows.append(f'<tr><td>{_e(column)}</td><td>{_e(name)}</td><td class="num">{values["num_samples"]}</td>'
                    f'<td class="num">{values["accuracy"]:.4f}</td><td class="num">{ci_cell}</td>'
                    f'<td class="num">{values["f1_macro"]:.4f}</td><td class="num">{loss}</td>'
                    f"<td>{_interval_svg(values['accuracy'], ci, metrics['accuracy'])}</td></tr>")
    over = f"{report['rows']} rows" + (f" used of {report['rows_in_set']}" if report["rows"] != report["rows_in_set"]
                                      else "")
    note = (f"Slices by {_e(', '.join(report['columns']))}, over {over}; each slice's metrics are those of its rows "
            f"alone. No interval below {report['min_rows_for_interval']} rows. The plot: accuracy (dot) and its 95% "
            "interval (line) on [0, 1]; dashed: the whole set. Every metric of each slice: metrics.json, slices.csv.")
    table = _table(("column", "value", "rows", "accuracy", "95% CI", "macro F1", "loss", "accuracy on [0, 1]"), rows)
    return f"<h2>Slices</h2>{table}<div class=\"note\">{note}</div>"


def _interval_svg(value: float, interval: Optional[list], whole: float, width: int = 220) -> str:
    """A one-row forest plot: the interval as a line, the value as a dot, ``whole`` dashed."""
    x = [round(4 + (width - 8) * min(1.0, max(0.0, v)), 1) for v in (value, whole, *(interval or ()))]
    line = f'<line x1="{x[2]}" x2="{x[3]}" y1="8" y2="8" stroke="#4c8ed9" stroke-width="3"/>' if interval else ""
    return (f'<svg width="{width}" height="16" role="img" aria-label="accuracy {value:.4f}">'
            f'<line x1="4" x2="{width - 4}" y1="8" y2="8" stroke="#d0d7de"/>'
            f'<line x1="{x[1]}" x2="{x[1]}" y1="1" y2="15" stroke="#8c959f" stroke-dasharray="2,2"/>{line}'
            f'<circle cx="{x[0]}" cy="8" r="4" fill="{"#1f2328" if interval else "#fff"}" stroke="#1f2328"/></svg>')


def _confusion_table(metrics: dict) -> str:
    names = class_names(metrics)
    header = ["true \\ predicted", *names]
    rows = [
        f"<tr><th>{_e(name)}</th>" + "".join(f'<td class="num">{v}</td>' for v in row) + "</tr>"
        for name, row in zip(names, metrics["confusion_matrix"])
    ]
    return _table(header, rows)


def _sample_text(sample: Optional[dict]) -> Optional[str]:
    if not sample or not sample.get("limit"):
        return None
    return (f"{sample['rows']} of {sample['rows_in_data']} rows, a random sample (--limit {sample['limit']} "
            f"--limit-seed {sample['limit_seed']}), chosen by a hash of each row's content")


def _run_facts(metrics: dict) -> str:
    run = metrics.get("run", {})
    facts = [
        ("samples", metrics["num_samples"]),
        ("classes", metrics["num_labels"]),
        ("data", ", ".join(run.get("data_files") or []) or None),
        ("split", run.get("split")),
        ("sample (--limit)", _sample_text(run.get("sample"))),
        ("stopped early", format_stopping(metrics)),
        ("model", run.get("model")),
        ("checkpoint", run.get("checkpoint")),
        ("backend", run.get("backend")),
        ("world size (ranks)", run.get("world_size")),
        ("samples per rank", run.get("per_rank_samples")),
        ("batch size", run.get("batch_size")),
        ("max length", run.get("max_length")),
        ("texts truncated", metrics.get("num_truncated")),
        ("swarm peers", ", ".join(run.get("initial_peers") or []) or None),
        ("DHT prefix", run.get("dht_prefix")),
        ("started at", run.get("started_at")),
        ("wall time", f"{run['wall_seconds']:.1f} s" if run.get("wall_seconds") is not None else None),
        ("eval loop", f"{run['eval_loop_seconds']:.1f} s" if run.get("eval_loop_seconds") is not None else None),
        ("samples/s (eval loop)", f"{run['samples_per_second']:.1f}" if run.get("samples_per_second") else None),
        ("versions", ", ".join(f"{k} {v}" for k, v in (run.get("versions") or {}).items() if v)),
    ]
    rows = [
        f'<tr><td class="key">{_e(k)}</td><td class="val">{_e(v)}</td></tr>' for k, v in facts if v not in (None, "")
    ]
    return _table(("", ""), rows).replace("<thead><tr><th></th><th></th></tr></thead>", "")


def _calibration(reliability_png: Optional[bytes]) -> str:
    if not reliability_png:
        return ""
    data = base64.b64encode(reliability_png).decode("ascii")
    return (
        "<h2>Calibration</h2>"
        '<div class="note">Accuracy against mean top-class probability in 15 equal-width bins; '
        "the ECE is the row-weighted mean gap.</div>"
        f'<img class="cm" alt="Reliability diagram" src="data:image/png;base64,{data}">'
    )


def render_html(
    metrics: dict,
    confusion_png: Optional[bytes] = None,
    title: str = "dist_eval report",
    reliability_png: Optional[bytes] = None,
) -> str:
    """The whole page as a string; ``confusion_png`` is embedded when given, else the
    matrix appears as a table only; ``reliability_png`` (the reliability diagram) when given.
    """
    run = metrics.get("run", {})
    subtitle = " &middot; ".join(
        _e(x)
        for x in (
            f"{metrics['num_samples']} samples, {metrics['num_labels']} classes",
            ", ".join(run.get("data_files") or []),
            run.get("started_at"),
        )
        if x
    )
    warnings = ""
    if metrics.get("num_truncated"):
        warnings = (
            f'<p class="warn">{metrics["num_truncated"]} text(s) were truncated to the maximum length '
            f"({_e(run.get('max_length', '?'))} tokens).</p>"
        )
    if confusion_png:
        data = base64.b64encode(confusion_png).decode("ascii")
        figure = (
            f'<img class="cm" alt="Confusion matrix: counts and row-normalised" src="data:image/png;base64,{data}">'
            f"<details><summary>The counts as a table</summary>{_confusion_table(metrics)}</details>"
        )
    else:
        figure = _confusion_table(metrics) + '<div class="note">No figure: matplotlib is not installed.</div>'
    beside = "metrics.json, predictions.jsonl, per_class.csv, per_class.md" + (
        ", slices.csv" if metrics.get("slices") else "") + (
        ", confusion_matrix.png" if confusion_png else ""
    ) + (", reliability_diagram.png" if reliability_png else "")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)}</title><style>{_CSS}</style></head>
<body><main>
<h1>{_e(title)}</h1><p class="sub">{subtitle}</p>
{warnings}
{_cards(metrics)}
<h2>Metrics</h2>
{_metrics_table(metrics)}
<h2>Per class</h2>
{_per_class_table(metrics)}
<h2>Confusion matrix</h2>
<div class="note">Rows: true class; columns: predicted class.</div>
{figure}
{_slices_section(metrics)}
{_calibration(reliability_png)}
<h2>Run</h2>
{_run_facts(metrics)}
<footer>Written by dist_eval. Files beside this one: {beside}.</footer>
</main></body></html>
"""
