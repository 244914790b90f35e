"""Recompute every metric of a finished run from its per-row output alone:
``python -m dist_eval.rescore OUT``.

Reads ``OUT/predictions.jsonl`` (labels, predictions, losses, and the logits when the run
had ``--save-logits``: without them the probability scores are left out) and, from
``OUT/metrics.json``, only the settings of the scores (number of classes, class names,
top-k, bootstrap resamples and seed). Computes the metrics with the function the run's
merge uses (:func:`dist_eval.scoring.row_metrics`), so they are the same numbers, and
prints each next to the run's. Exit 0 when every one is equal, 1 when one differs, 2
when the folder is not a finished run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

import numpy as np

from dist_eval.errors import UsageError
from dist_eval.metrics import headline_names
from dist_eval.results import MergedResults

EXIT_USAGE = 2
# what rescore recomputes, besides top{K}_accuracy (named with the run's k: see rescored_keys);
# the rest of metrics.json (run facts, user metrics) is the run's
RESCORED = ("num_samples", "num_labels", "accuracy", "precision_macro", "recall_macro", "f1_macro",
            "precision_micro", "recall_micro", "f1_micro", "precision_weighted", "recall_weighted", "f1_weighted",
            "per_class", "confusion_matrix", "loss", "confidence_intervals", "ece", "brier", "auroc_macro", "top_k",
            "reliability")


def rescored_keys(run: dict, rescored: dict) -> list:
    """The keys compared: RESCORED and every ``top{K}_accuracy`` either side holds, wherever
    rescore computed it or the run wrote a probability score it could recompute (a listed
    name was once missing here, and a differing top-k passed as "same").
    """
    top_k = sorted({key for key in (*run, *rescored) if key.startswith("top") and key.endswith("_accuracy")})
    probability_scores = "ece" in rescored  # only with logits: else they are left out, and said so
    clustered = ["clustering"] if "clustering" in run or "clustering" in rescored else []  # --cluster-by
    return [key for key in (*RESCORED, *clustered, *top_k)
            if key in rescored or (probability_scores and key in run and key.startswith("top"))]


def not_rescored(run: dict, rescored: dict) -> list:
    """The run's metrics among those rescore recomputes that it could not recompute here (the probability scores of
    a run without logits).
    """
    compared = set(rescored_keys(run, rescored))
    return [key for key in run if key not in compared and key != "top_k" and  # top_k: the k of top{K}_accuracy
            (key in RESCORED or key.startswith("top") and key.endswith("_accuracy"))]


def _read(folder: str):
    paths = {name: os.path.join(folder, name) for name in ("metrics.json", "predictions.jsonl")}
    missing = [name for name, path in paths.items() if not os.path.isfile(path)]
    if missing:
        raise UsageError(f"{folder}: missing {' and '.join(missing)}. Pass the --output-dir of a finished run.")
    try:
        with open(paths["metrics.json"]) as f:
            metrics = json.load(f)
        with open(paths["predictions.jsonl"]) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        columns = {key: [r[key] for r in rows] for key in ("index", "label", "pred", "loss")}
        for key in ("slice", "cluster"):
            if rows and key in rows[0]:
                columns[key] = [r[key] for r in rows]
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(
            f"{folder}: not a dist_eval output with per-row losses ({type(e).__name__}: {e}). "
            "Runs before per-row losses were written cannot be rescored."
        ) from e
    logits = np.array([r["logits"] for r in rows], dtype=np.float32) if rows and "logits" in rows[0] else None
    return metrics, columns, logits


def rescore(folder: str) -> dict:
    """The built-in metrics of the run in ``folder``, recomputed from predictions.jsonl."""
    from dist_eval.scoring import row_metrics

    metrics, columns, logits = _read(folder)
    _check_rows_are_the_runs(folder, metrics, columns["index"])
    clustering = metrics.get("clustering")
    intervals = metrics.get("confidence_intervals") or (clustering or {}).get("unclustered_intervals") or {}
    bootstrap = (intervals["resamples"], intervals["seed"]) if intervals else None
    clusters = (clustering["column"], columns["cluster"]) if clustering and "cluster" in columns else None
    rows = MergedResults(np.array(columns["index"], dtype=np.int64), np.array(columns["label"], dtype=np.int64),
                         np.array(columns["pred"], dtype=np.int64), np.array(columns["loss"], dtype=np.float64), logits)
    out = row_metrics(rows.labels, rows.preds, rows.losses, logits, int(metrics["num_labels"]),
                      metrics.get("label_names"), bootstrap, metrics.get("top_k"))
    if clusters is not None:
        from dist_eval.clusters import clustered_report
        from dist_eval.metrics import softmax

        out = clustered_report(out, rows.labels, rows.preds, rows.losses, None if logits is None else softmax(logits),
                               clusters[1], clusters[0], bootstrap)
    if metrics.get("slices") and "slice" in columns:
        out["slices"] = _slices(metrics, columns["slice"], rows, bootstrap, clusters)
    return out


def _check_rows_are_the_runs(folder: str, metrics: dict, index: list) -> None:
    """predictions.jsonl holds each of the run's rows once, in the set's order: rows 0..n-1, or, for a run that
    stopped early (a random sample of the set) or a job array's shard (``shard.json`` beside it), ``num_samples``
    rows of increasing index. Anything else is a partial or edited output, whose metrics rescore cannot judge.
    """
    if index == list(range(len(index))):
        return
    # shard.json: output.shard_files.MANIFEST, a layer this one may not import
    subset = bool(metrics.get("stopping")) or os.path.isfile(os.path.join(folder, "shard.json"))
    if subset and len(index) == metrics.get("num_samples") and all(isinstance(i, int) and i >= 0 for i in index) and \
            all(a < b for a, b in zip(index, index[1:])):
        return
    what = "num_samples rows of increasing index" if subset else "one row per index 0..n-1"
    raise UsageError(f"{folder}: predictions.jsonl is not {what} (a partial or edited output).")


def _slices(metrics: dict, cells: list, rows: MergedResults, bootstrap, clusters=None) -> dict:
    """The run's ``slices``, recomputed from each row's ``slice`` field (:mod:`dist_eval.slices`)."""
    from dist_eval.slices import slice_report

    stored = metrics["slices"]
    values = {column: [cell[column] for cell in cells] for column in stored["columns"]}
    return slice_report(rows, values, int(metrics["num_labels"]), metrics.get("label_names"),
                        (bootstrap, metrics.get("top_k")), stored["rows_in_set"], clusters)


def slice_differences(run: Optional[dict], rescored: Optional[dict]) -> list:
    """``column=value`` of each slice whose rescored metrics differ from the run's (the keys
    rescore computed: without logits, not the probability scores).
    """
    if not rescored:
        return []
    out = []
    for column, by_value in rescored["by"].items():
        stored_column = ((run or {}).get("by") or {}).get(column) or {}
        for name, values in by_value.items():
            if differences(stored_column.get(name) or {}, values):
                out.append(f"{column}={name}")
    return out + [f"{column}={name}" for column, by_value in ((run or {}).get("by") or {}).items()
                  for name in by_value if name not in rescored["by"].get(column, {})]


def differences(run: dict, rescored: dict) -> list:
    """The keys whose rescored value differs from the run's (the intervals: those rescored)."""
    stored = dict(run)
    if isinstance(rescored.get("confidence_intervals"), dict) and isinstance(run.get("confidence_intervals"), dict):
        stored["confidence_intervals"] = {k: v for k, v in run["confidence_intervals"].items()
                                          if k in rescored["confidence_intervals"]}
    unclustered = (rescored.get("clustering") or {}).get("unclustered_intervals")
    if isinstance(unclustered, dict) and isinstance((run.get("clustering") or {}).get("unclustered_intervals"), dict):
        stored["clustering"] = {**run["clustering"], "unclustered_intervals": {
            k: v for k, v in run["clustering"]["unclustered_intervals"].items() if k in unclustered}}
    differ = [key for key in rescored_keys(run, rescored)
              if json.dumps(rescored.get(key)) != json.dumps(stored.get(key))]
    if "slices" in rescored:
        slices = slice_differences(run.get("slices"), rescored["slices"])
        differ += [f"slices ({', '.join(slices)})"] if slices else []
    return differ


def build_parser() -> argparse.ArgumentParser:
    """The command's flags (also docs/cli.md's source)."""
    parser = argparse.ArgumentParser(
        prog="python -m dist_eval.rescore",
        description="Recompute every metric of a run from its predictions.jsonl (+ logits) alone; exit 0 when "
        "every one equals metrics.json, 1 when one differs, 2 when OUT is not a finished run.",
    )
    parser.add_argument("run", metavar="OUT", help="output folder of a finished run")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the recomputed metrics to PATH")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rescored = rescore(args.run)
        with open(os.path.join(args.run, "metrics.json")) as f:
            run = json.load(f)
    except UsageError as e:
        print(f"dist_eval.rescore: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    for name in headline_names(rescored):
        print(f"  {name:<16} {rescored[name]:.6f}   (run: {run.get(name)})")
    if "ece" not in rescored:
        print("  (no logits in predictions.jsonl: run with --save-logits to rescore ece, brier, top-k and AUROC)")
    if args.json:
        from dist_eval.atomic import atomic_write

        atomic_write(args.json, lambda f: json.dump(rescored, f, indent=2))
    differ = differences(run, rescored)
    if differ:
        print(f"dist_eval.rescore: differs from metrics.json: {', '.join(differ)}", flush=True)
        return 1
    checked = rescored_keys(run, rescored)
    sliced = (f" (and those of {sum(len(v) for v in rescored['slices']['by'].values())} slices)"
              if "slices" in rescored else "")
    print(f"dist_eval.rescore: all {len(checked)} recomputed metrics equal metrics.json{sliced}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
