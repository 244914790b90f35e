"""The run's outputs, written by rank 0 only: metrics.json, predictions.jsonl, the
readable report (per_class.csv / .md, confusion_matrix.png, report.html) and a summary."""
from __future__ import annotations

import json
import os
import sys
from typing import Callable, List, Optional, Sequence

import numpy as np

from dist_eval.errors import UsageError
from dist_eval.results import MergedResults


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


def _atomic_write(path: str, write) -> None:
    # write to a temp file in the same folder, then rename: a reader never sees half a file
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        write(f)
    os.replace(tmp, path)


def write_metrics(output_dir: str, metrics: dict) -> str:
    path = os.path.join(output_dir, "metrics.json")
    _atomic_write(path, lambda f: json.dump(metrics, f, indent=2, sort_keys=False, default=_jsonable))
    return path


def _jsonable(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def write_predictions(output_dir: str, merged: MergedResults, label_names: Optional[Sequence[str]] = None, save_logits: bool = False) -> str:
    """One JSON object per row of the split, in row order."""
    path = os.path.join(output_dir, "predictions.jsonl")
    indices, labels, preds = merged.indices.tolist(), merged.labels.tolist(), merged.preds.tolist()
    logits = merged.logits.tolist() if (save_logits and merged.logits is not None) else None

    def write(f):
        for i in range(len(indices)):
            row = {"index": indices[i], "label": labels[i], "pred": preds[i]}
            if label_names:
                row["label_name"] = label_names[labels[i]]
                row["pred_name"] = label_names[preds[i]]
            if logits is not None:
                row["logits"] = logits[i]
            f.write(json.dumps(row))
            f.write("\n")

    _atomic_write(path, write)
    return path


def _atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _warn_on_stderr(line: str) -> None:
    print(f"dist_eval: warning: {line}", file=sys.stderr, flush=True)


def write_report_files(output_dir: str, metrics: dict, warn: Callable[[str], None] = _warn_on_stderr) -> List[str]:
    """per_class.csv, per_class.md, confusion_matrix.png and report.html; returns their paths.

    Without matplotlib the figure is skipped with one ``warn`` line and report.html
    shows the matrix as a table instead.
    """
    from dist_eval.figures import confusion_matrix_png
    from dist_eval.html_report import render_html
    from dist_eval.per_class import class_names, per_class_csv, per_class_markdown

    written = []

    def text_file(name: str, text: str) -> None:
        path = os.path.join(output_dir, name)
        _atomic_write(path, lambda f: f.write(text))
        written.append(path)

    text_file("per_class.csv", per_class_csv(metrics))
    text_file("per_class.md", per_class_markdown(metrics))
    title = f"{metrics['num_samples']} samples, accuracy {metrics['accuracy']:.4f}, macro F1 {metrics['f1_macro']:.4f}"
    try:
        png = confusion_matrix_png(metrics["confusion_matrix"], class_names(metrics), title=title)
        if png is None:
            warn("matplotlib is not installed, so confusion_matrix.png was not written "
                 "(pip install matplotlib); report.html shows the matrix as a table")
    except Exception as e:  # noqa: BLE001 - a figure must not cost the user the rest of the report
        png = None
        warn(f"confusion_matrix.png could not be drawn ({type(e).__name__}: {e}); report.html shows the matrix as a table")
    if png is not None:
        path = os.path.join(output_dir, "confusion_matrix.png")
        _atomic_write_bytes(path, png)
        written.append(path)
    text_file("report.html", render_html(metrics, png))
    return written


def format_intervals(metrics: dict) -> Optional[str]:
    """``95% CI (bootstrap, 1000 resamples, seed 0): acc [lo, hi] ...``, or None."""
    intervals = metrics.get("confidence_intervals")
    if not intervals:
        return None
    # "acc", not "accuracy": the line above is the one line that says "accuracy X.XXXX"
    parts = "   ".join(
        f"{short} [{intervals[name][0]:.4f}, {intervals[name][1]:.4f}]"
        for name, short in (("accuracy", "acc"), ("f1_macro", "f1_macro"), ("loss", "loss"))
    )
    return (f"{100 * intervals['level']:g}% CI (bootstrap, {intervals['resamples']} resamples, "
            f"seed {intervals['seed']}): {parts}")


def format_summary(metrics: dict) -> str:
    """A short, readable summary for the terminal."""
    run = metrics.get("run", {})
    lines = [
        f"dist_eval: {metrics['num_samples']} samples, {run.get('world_size', 1)} rank(s), "
        f"backend {run.get('backend', '?')}, {run.get('wall_seconds', 0):.1f} s wall, "
        f"{run.get('samples_per_second') or 0:.1f} samples/s (eval loop)",
        f"  accuracy {metrics['accuracy']:.4f}   f1_macro {metrics['f1_macro']:.4f}   "
        f"f1_weighted {metrics['f1_weighted']:.4f}   loss {metrics['loss']:.4f}",
    ]
    intervals = format_intervals(metrics)
    if intervals:
        lines.append(f"  {intervals}")
    if metrics.get("num_truncated"):
        lines.append(f"  {metrics['num_truncated']} text(s) truncated to --max-length")
    per_class = metrics["per_class"]
    width = max(8, max(len(name) for name in per_class))
    lines.append(f"  {'class':<{width}}  precision  recall      f1  support")
    for name, values in per_class.items():
        lines.append(
            f"  {name:<{width}}  {values['precision']:9.4f}  {values['recall']:6.4f}  {values['f1']:6.4f}  {values['support']:7d}"
        )
    cm = metrics["confusion_matrix"]
    cell = max(5, max(len(str(v)) for row in cm for v in row) + 1)
    lines.append("  confusion matrix (rows = true, columns = predicted):")
    for name, row in zip(per_class, cm):
        lines.append(f"  {name:<{width}}" + "".join(f"{v:>{cell}d}" for v in row))
    return "\n".join(lines)
