"""The report's lines of the slices and the clusters (``metrics["slices"]``, ``metrics["clustering"]``):
the summary's, and slices.csv. Pure functions of the report, beside the other writers of it.
"""
from __future__ import annotations

import csv
import io
from typing import List

from dist_eval.atomic import csv_cell
from dist_eval.loop_facts import SampleFacts

# The summary's lines of slices: the worst first.
SUMMARY_SLICES = 5


def slices_of(report: dict) -> list:
    """Every slice as (column, value, its metrics), the lowest accuracy first (ties by name)."""
    found = [(column, name, values) for column, by_value in report["by"].items() for name, values in by_value.items()]
    return sorted(found, key=lambda item: (item[2]["accuracy"], item[0], item[1]))


def format_slices(metrics: dict, shown: int = SUMMARY_SLICES) -> List[str]:
    """The summary's lines: the ``shown`` slices of lowest accuracy, with their intervals."""
    report = metrics.get("slices")
    if not report:
        return []
    found = slices_of(report)
    sample = SampleFacts.of(metrics)
    over = f"over {report['rows']} rows"
    if report["rows"] != report["rows_in_set"]:
        over = f"over the {report['rows']} rows used of {report['rows_in_set']}"
    elif sample.sampled and sample.rows < sample.rows_in_data:
        over = f"over the {report['rows']} rows of a random sample of {sample.rows_in_data}"
    lines = [f"  slices by {', '.join(report['columns'])} ({len(found)}, {over}), lowest accuracy first:"]
    for column, name, values in found[:shown]:
        interval = (values.get("confidence_intervals") or {}).get("accuracy")
        where = f"[{interval[0]:.4f}, {interval[1]:.4f}]" if interval else values.get("interval_note", "")
        lines.append(f"    {column}={name}: accuracy {values['accuracy']:.4f} {where}, macro F1 "
                     f"{values['f1_macro']:.4f}, {values['num_samples']} rows")
    if len(found) > shown:
        lines.append(f"    ... {len(found) - shown} more in slices.csv")
    return lines


CSV_METRICS = ("accuracy", "f1_macro", "f1_weighted", "precision_macro", "recall_macro", "loss", "ece", "brier",
               "auroc_macro")


def slices_csv(metrics: dict) -> str:
    """slices.csv: a line per slice (lowest accuracy first): its rows, each headline metric
    and, where it has one, its interval; ``note`` when it has none. A column or value (the
    data's texts) that a spreadsheet would run as a formula is quoted (:func:`~dist_eval.atomic.csv_cell`).
    """
    report = metrics["slices"]
    names = list(CSV_METRICS)
    k = metrics.get("top_k")
    if k:
        names.insert(-1, f"top{k}_accuracy")
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["column", "value", "rows", *[f"{n}{part}" for n in names for part in ("", "_low", "_high")],
                     "note"])
    for column, name, values in slices_of(report):
        intervals = values.get("confidence_intervals") or {}
        cells = []
        for n in names:
            low, high = intervals.get(n) or (None, None)
            cells += [_cell(values.get(n)), _cell(low), _cell(high)]
        writer.writerow([csv_cell(column), csv_cell(name), values["num_samples"], *cells,
                         values.get("interval_note", "")])
    return buffer.getvalue()


def _cell(value) -> str:
    return "" if value is None else repr(float(value))


def format_clustering(metrics: dict) -> list:
    """The summary's lines of ``clustering``: the clusters, the design effect, and the intervals of
    the rows taken as independent beside the clustered ones (accuracy and macro F1).
    """
    clustering = metrics.get("clustering")
    if not clustering:
        return []
    deff = clustering["design_effect"]
    effect = f"design effect {deff:.2f} on accuracy" if deff is not None else "design effect undefined"
    lines = [f"  clusters by {clustering['column']}: {clustering['clusters']} clusters of {metrics['num_samples']} "
             f"rows, {effect} (the set is worth about {metrics['num_samples'] / deff:.0f} independent rows)"
             if deff else f"  clusters by {clustering['column']}: {clustering['clusters']} clusters, {effect}"]
    clustered, rows = metrics.get("confidence_intervals") or {}, clustering.get("unclustered_intervals") or {}
    for name in ("accuracy", "f1_macro"):
        if clustered.get(name) and rows.get(name):
            lines.append(f"    {name}: [{clustered[name][0]:.4f}, {clustered[name][1]:.4f}] clustered, "
                         f"[{rows[name][0]:.4f}, {rows[name][1]:.4f}] with the rows taken as independent")
    return lines
