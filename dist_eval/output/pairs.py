"""The table comparing the (checkpoint, set) pairs of one run (:mod:`dist_eval.plan`):
``OUT/summary.md`` (printed too) and ``OUT/summary.json``, read from each pair's metrics.json.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional, Sequence

from dist_eval.atomic import atomic_write

COLUMNS = ("accuracy", "f1_macro", "loss")


def pair_rows(output_dir: str, pairs: Sequence) -> List[dict]:
    """One row per pair (a :class:`dist_eval.plan.Pair`): its names, folder and headline
    numbers, copied from its metrics.json (so the table cannot disagree with the reports).
    """
    rows = []
    for pair in pairs:
        folder = os.path.join(output_dir, pair.folder)
        with open(os.path.join(folder, "metrics.json")) as f:
            metrics = json.load(f)
        intervals = metrics.get("confidence_intervals") or {}
        rows.append({
            "checkpoint": pair.checkpoint.name,
            "checkpoint_path": pair.checkpoint.path,
            "set": pair.data.name,
            "data_files": list(pair.data.files),
            "folder": pair.folder,
            "rows": metrics["num_samples"],
            **{name: metrics[name] for name in COLUMNS},
            "confidence_intervals": {name: intervals[name] for name in COLUMNS if name in intervals},
        })
    return rows


def format_pairs_table(rows: Sequence[dict]) -> str:
    """A Markdown table, columns aligned (readable on a terminal too); intervals in brackets."""
    header = ["checkpoint", "set", "rows", *COLUMNS, "folder"]

    def cell(row: dict, name: str) -> str:
        ci = row["confidence_intervals"].get(name)
        return f"{row[name]:.4f}" + (f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "")

    cells = [[row["checkpoint"] or os.path.basename(row["checkpoint_path"] or "") or "-", row["set"] or "-",
              str(row["rows"]), *(cell(row, n) for n in COLUMNS), row["folder"] or "."] for row in rows]
    widths = [max(len(h), *(len(c[j]) for c in cells)) for j, h in enumerate(header)]
    right = {2, 3, 4, 5}

    def line(values) -> str:
        return "| " + " | ".join(v.rjust(w) if j in right else v.ljust(w)
                                 for j, (v, w) in enumerate(zip(values, widths))) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if j in right else "-" * (w + 2) for j, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule, *(line(c) for c in cells)])


def write_pairs_summary(output_dir: str, pairs: Sequence, comparisons: Optional[dict] = None,
                        compared: str = "") -> str:
    """Rank 0: OUT/summary.md and OUT/summary.json; returns the text to print. ``comparisons``: the
    checkpoints compared on each set (``dist_eval.compare.checkpoint_comparisons``), ``compared``
    their table: in both files and printed.
    """
    rows = pair_rows(output_dir, pairs)
    level = "[lo, hi]: the bootstrap confidence intervals of each report" if any(
        r["confidence_intervals"] for r in rows) else ""
    table = format_pairs_table(rows)
    md = os.path.join(output_dir, "summary.md")
    atomic_write(md, f"# dist_eval: {len(rows)} evaluations\n\n{table}\n" + (f"\n{level}\n" if level else "")
                 + (f"\n```\n{compared}\n```\n" if compared else ""))
    path = os.path.join(output_dir, "summary.json")
    atomic_write(path, lambda f: json.dump({"pairs": rows, **({"comparisons": comparisons} if comparisons else {})},
                                           f, indent=2))
    return (f"dist_eval: {len(rows)} evaluations\n{table}\n" + (f"{compared}\n" if compared else "")
            + f"  summary: {md} ({os.path.basename(path)} beside it)")
