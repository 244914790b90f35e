"""The run's files, written by rank 0 only: metrics.json, predictions.jsonl and the readable
report (per_class.csv / .md, confusion_matrix.png, report.html).
"""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from dist_eval.atomic import atomic_write
from dist_eval.errors import UsageError, warn
from dist_eval.merge import MergedResults


def check_output_dir(path: str) -> None:
    """Fail before any work when the report could not be written."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".dist_eval_write_test_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"--output-dir {path}: not writable ({e.strerror}). Pass a folder you can write to.") from e


def write_metrics(output_dir: str, metrics: dict) -> str:
    path = os.path.join(output_dir, "metrics.json")
    return atomic_write(path, lambda f: json.dump(metrics, f, indent=2, sort_keys=False, default=_jsonable))


def _jsonable(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def write_predictions(
    output_dir: str,
    merged: MergedResults,
    label_names: Optional[Sequence[str]] = None,
    save_logits: bool = False,
    texts: Optional[Dict[str, Sequence[str]]] = None,
) -> str:
    """One JSON object per row of the split, in row order: ``index``, ``label``, ``pred``
    (and their names), ``prob`` (the softmax probability of ``pred``, when the logits are
    there), ``loss`` (the row's cross-entropy), ``logits`` with ``save_logits``, and each
    of ``texts`` ({key: one text per row, in row order}, e.g. {"text": [...]}).
    """
    from dist_eval.metrics import softmax

    path = os.path.join(output_dir, "predictions.jsonl")
    indices, labels, preds = merged.indices.tolist(), merged.labels.tolist(), merged.preds.tolist()
    losses = merged.losses.tolist()
    logits = merged.logits.tolist() if (save_logits and merged.logits is not None) else None
    probs = None
    if merged.logits is not None:
        probs = softmax(merged.logits)[np.arange(len(indices)), merged.preds].tolist()
    names = [json.dumps(name) for name in label_names] if label_names else None
    columns = [("index", _json_ints(indices)), ("label", _json_ints(labels)), ("pred", _json_ints(preds))]
    if names:
        columns += [("label_name", [names[i] for i in labels]), ("pred_name", [names[i] for i in preds])]
    if probs is not None:
        columns.append(("prob", _json_floats(probs)))
    columns.append(("loss", _json_floats(losses)))
    if logits is not None:
        columns.append(("logits", ["[" + ", ".join(_json_floats(row)) + "]" for row in logits]))
    for key, values in (texts or {}).items():
        text_column = (key, [json.dumps(values[i]) for i in indices])
        taken = [position for position, (name, _) in enumerate(columns) if name == key]
        if taken:  # a dict keeps the first place of a key given twice, with the last value
            columns[taken[0]] = text_column
        else:
            columns.append(text_column)
    # each line as json.dumps(row) writes it, the keys in this order, built a column at a
    # time: a dict and a json.dumps per row were most of the report's time on big sets
    template = "{" + ", ".join(json.dumps(key).replace("%", "%%") + ": %s" for key, _ in columns) + "}\n"

    def write(f):
        for start in range(0, len(indices), _LINES_PER_WRITE):
            rows = zip(*(values[start:start + _LINES_PER_WRITE] for _, values in columns))
            f.write("".join([template % row for row in rows]))

    return atomic_write(path, write)


_LINES_PER_WRITE = 1 << 16


def _json_ints(values: list) -> List[str]:
    return list(map(int.__repr__, values))


def _json_floats(values: list) -> List[str]:
    """Each float as json.dumps writes it: repr, or NaN / Infinity / -Infinity."""
    special = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
    return [special.get(text, text) for text in map(float.__repr__, values)]


def write_report_files(output_dir: str, metrics: dict, warn: Callable[[str], None] = warn) -> List[str]:
    """per_class.csv, per_class.md, slices.csv (with ``slices``), confusion_matrix.png,
    reliability_diagram.png and report.html; returns their paths.

    Without matplotlib the figure is skipped with one ``warn`` line and report.html
    shows the matrix as a table instead.
    """
    from dist_eval.output.figures import confusion_matrix_png
    from dist_eval.output.html import render_html
    from dist_eval.output.per_class import class_names, per_class_csv, per_class_markdown

    written = []

    def text_file(name: str, text: str) -> None:
        path = os.path.join(output_dir, name)
        atomic_write(path, text)
        written.append(path)

    text_file("per_class.csv", per_class_csv(metrics))
    text_file("per_class.md", per_class_markdown(metrics))
    if metrics.get("slices"):
        from dist_eval.slices import slices_csv

        text_file("slices.csv", slices_csv(metrics))
    title = f"{metrics['num_samples']} samples, accuracy {metrics['accuracy']:.4f}, macro F1 {metrics['f1_macro']:.4f}"
    try:
        png = confusion_matrix_png(metrics["confusion_matrix"], class_names(metrics), title=title)
        if png is None:
            warn(
                "matplotlib is not installed, so confusion_matrix.png was not written "
                "(pip install matplotlib); report.html shows the matrix as a table"
            )
    except Exception as e:  # a figure must not cost the user the rest of the report
        png = None
        warn(
            f"confusion_matrix.png could not be drawn ({type(e).__name__}: {e}); "
            "report.html shows the matrix as a table"
        )
    if png is not None:
        path = os.path.join(output_dir, "confusion_matrix.png")
        atomic_write(path, png)
        written.append(path)
    reliability = _reliability_png(metrics, warn)
    if reliability is not None:
        path = os.path.join(output_dir, "reliability_diagram.png")
        atomic_write(path, reliability)
        written.append(path)
    text_file("report.html", render_html(metrics, png, reliability_png=reliability))
    return written


def _reliability_png(metrics: dict, warn: Callable[[str], None]) -> Optional[bytes]:
    """The reliability diagram of metrics.json's ``reliability`` table, or None (no table,
    no matplotlib: already said for the confusion matrix, or a drawing error: warned).
    """
    from dist_eval.output.figures import reliability_table_png

    if not metrics.get("reliability"):
        return None
    try:
        return reliability_table_png(metrics["reliability"], metrics["ece"])
    except Exception as e:  # a figure must not cost the user the rest of the report
        warn(f"reliability_diagram.png could not be drawn ({type(e).__name__}: {e})")
        return None
