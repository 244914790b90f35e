"""The confusion-matrix figure: counts and row-normalised side by side (matplotlib, Agg).

matplotlib is imported here only, lazily: a run without it still writes every other
file of the report (:func:`confusion_matrix_png` then returns None). The figure is a
bare ``matplotlib.figure.Figure`` rendered by the Agg canvas, never pyplot, so it needs
no display and leaves the backend of a notebook that calls it untouched.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

_ANNOTATE_UP_TO = 25  # classes; beyond, cell numbers would not fit
_LABEL_CHARS = 18


def _short(name: str) -> str:
    return name if len(name) <= _LABEL_CHARS else name[: _LABEL_CHARS - 1] + "\u2026"


def confusion_matrix_png(cm, class_names: Sequence[str], title: str = "") -> Optional[bytes]:
    """PNG bytes of the figure, or None when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    import io

    counts = np.asarray(cm, dtype=np.int64)
    k = counts.shape[0]
    support = counts.sum(axis=1, keepdims=True)
    normalised = np.divide(counts, support, out=np.zeros(counts.shape), where=support != 0)
    side = float(np.clip(0.42 * k + 2.2, 4.2, 13.0))  # inches per panel: grows with the classes
    fig = Figure(figsize=(2 * side + 1.6, side + 0.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    names = [_short(str(n)) for n in class_names]
    panels = (
        (axes[0], counts, "Counts", lambda v: f"{int(v)}", counts.max() if counts.size else 1),
        (axes[1], normalised, "Row-normalised (recall of each true class)", lambda v: f"{v:.2f}", 1.0),
    )
    for ax, values, panel_title, fmt, vmax in panels:
        image = ax.imshow(values, cmap="Blues", vmin=0, vmax=max(vmax, 1e-12), interpolation="nearest")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03)
        ax.set_title(panel_title, fontsize=11)
        ax.set_xlabel("Predicted class")
        ax.set_ylabel("True class")
        if k <= 60:
            ax.set_xticks(range(k), labels=names, rotation=45 if k > 3 else 0, ha="right" if k > 3 else "center",
                          fontsize=9 if k <= 20 else 7)
            ax.set_yticks(range(k), labels=names, fontsize=9 if k <= 20 else 7)
        if k <= _ANNOTATE_UP_TO:
            threshold = 0.5 * vmax
            for i in range(k):
                for j in range(k):
                    empty_row = values is normalised and support[i, 0] == 0
                    text = "-" if empty_row else fmt(values[i, j])
                    ax.text(j, i, text, ha="center", va="center", fontsize=9 if k <= 10 else 7,
                            color="white" if values[i, j] > threshold else "#1a1a1a")
    if title:
        fig.suptitle(title, fontsize=12)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def reliability_table_png(table: dict, ece: float, title: str = "") -> bytes | None:
    """The reliability diagram of a :func:`dist_eval.metrics.reliability_table` (arrays or
    the lists metrics.json holds under ``reliability``); None without matplotlib.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    import io

    edges, count = np.asarray(table["edges"], dtype=np.float64), np.asarray(table["count"])
    accuracy, confidence = np.asarray(table["accuracy"]), np.asarray(table["confidence"])
    bins, total = len(count), int(count.sum())
    centers = (edges[:-1] + edges[1:]) / 2.0
    width = edges[1] - edges[0]
    filled = count > 0
    fig = Figure(figsize=(5.6, 6.4), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.plot([0, 1], [0, 1], linestyle="--", color="#888888", linewidth=1, label="Perfect calibration")
    top.bar(centers[filled], accuracy[filled], width=width, color="#4c78a8", edgecolor="#1f3b57",
            linewidth=0.6, label="Accuracy")
    gap = confidence[filled] - accuracy[filled]
    top.bar(centers[filled], gap, bottom=accuracy[filled], width=width, color="#e45756", alpha=0.35,
            edgecolor="#e45756", linewidth=0.6, label="Gap to mean confidence")
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.set_ylabel("Accuracy")
    top.legend(loc="upper left", fontsize=8)
    top.set_title(f"{title + ': ' if title else ''}ECE {ece:.4f} ({bins} bins, {total} rows)", fontsize=11)
    bottom.bar(centers, count / max(total, 1), width=width, color="#9d9d9d", edgecolor="#555555", linewidth=0.5)
    bottom.set_xlabel("Confidence (top-class probability)")
    bottom.set_ylabel("Share of rows")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
