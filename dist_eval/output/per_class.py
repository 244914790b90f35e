"""The per-class table (precision, recall, F1, support, predicted) as rows, CSV and Markdown.

Rows come from ``metrics["per_class"]`` (keyed by class name when the data or the model
names the classes) and the confusion matrix (how often each class was predicted).
"""
from __future__ import annotations

import csv
import io
from typing import List

from dist_eval.atomic import csv_cell

COLUMNS = ("class", "label", "precision", "recall", "f1", "support", "predicted")


def class_names(metrics: dict) -> List[str]:
    """Display names in label order: the ClassLabel / id2label names, else the ids."""
    names = metrics.get("label_names")
    if names and len(names) == metrics["num_labels"]:
        return [str(n) for n in names]
    by_label = sorted(metrics["per_class"].items(), key=lambda item: item[1]["label"])
    return [str(name) for name, _ in by_label]


def per_class_rows(metrics: dict) -> List[dict]:
    """One dict per class, in label order, with the keys of :data:`COLUMNS`."""
    cm = metrics["confusion_matrix"]
    predicted = [sum(row[k] for row in cm) for k in range(len(cm))]
    rows = []
    for name, values in sorted(metrics["per_class"].items(), key=lambda item: item[1]["label"]):
        k = values["label"]
        rows.append({
            "class": name, "label": k, "precision": values["precision"], "recall": values["recall"],
            "f1": values["f1"], "support": values["support"], "predicted": predicted[k],
        })
    return rows


def per_class_csv(metrics: dict) -> str:
    """CSV text with a header row; floats at full precision (a file for programs); a class name a
    spreadsheet would run as a formula quoted (:func:`~dist_eval.atomic.csv_cell`).
    """
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows({**row, "class": csv_cell(row["class"])} for row in per_class_rows(metrics))  # a name: text
    return out.getvalue()


def per_class_markdown(metrics: dict) -> str:
    """A Markdown table (4 decimals), with a macro-average row (a file for people)."""

    def cell(text) -> str:
        return str(text).replace("|", "\\|")

    lines = ["| class | label | precision | recall | f1 | support | predicted |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in per_class_rows(metrics):
        lines.append(f"| {cell(r['class'])} | {r['label']} | {r['precision']:.4f} | {r['recall']:.4f} | "
                     f"{r['f1']:.4f} | {r['support']} | {r['predicted']} |")
    lines.append(f"| **macro avg** | | {metrics['precision_macro']:.4f} | {metrics['recall_macro']:.4f} | "
                 f"{metrics['f1_macro']:.4f} | {metrics['num_samples']} | {metrics['num_samples']} |")
    return "\n".join(lines) + "\n"
