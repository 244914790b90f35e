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
