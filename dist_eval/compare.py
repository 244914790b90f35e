"""Compare two runs over the same data: ``python -m dist_eval.compare OUT_A OUT_B``.

Prints the main metrics of both runs with B - A (and their confidence intervals when
the runs have them), a paired test on the shared rows (McNemar's exact test of the
accuracies; paired bootstrap intervals of B - A in accuracy, macro-F1 and loss; also
written to ``--json PATH``), per slice when both runs have ``--slice-by``'s (McNemar's test of each
slice, its p-value adjusted by Holm for the number of slices), then the rows whose prediction changed (index, label,
pred A, pred B), up to ``--max-rows``. Exit 0; exit 2 with one error line when a folder is not
a finished run or the runs are over different data.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from dist_eval.errors import UsageError
from dist_eval.metrics import headline_names

EXIT_USAGE = 2


@dataclass
class RunOutputs:
    """What compare needs from one output folder."""

    folder: str
    metrics: dict
    indices: np.ndarray
    labels: np.ndarray
    preds: np.ndarray
    losses: Optional[np.ndarray] = None  # each row's loss (runs before issue 14 have none)
    slices: Optional[list] = None  # each row's {column: value} (runs with --slice-by)
    clusters: Optional[list] = None  # each row's cluster (runs with --cluster-by)


def load_run(folder: str) -> RunOutputs:
    """metrics.json and predictions.jsonl of a finished run, checked for consistency."""
    if not os.path.isdir(folder):
        raise UsageError(f"{folder}: no such folder. Pass the --output-dir of a finished dist_eval run.")
    paths = {name: os.path.join(folder, name) for name in ("metrics.json", "predictions.jsonl")}
    missing = [name for name, path in paths.items() if not os.path.isfile(path)]
    if missing:
        raise UsageError(
            f"{folder}: missing {' and '.join(missing)} (not a finished dist_eval run). "
            "Pass the --output-dir of a finished run."
        )
    try:
        with open(paths["metrics.json"]) as f:
            metrics = json.load(f)
        with open(paths["predictions.jsonl"]) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        indices = np.array([r["index"] for r in rows], dtype=np.int64)
        labels = np.array([r["label"] for r in rows], dtype=np.int64)
        preds = np.array([r["pred"] for r in rows], dtype=np.int64)
        losses = np.array([r["loss"] for r in rows], dtype=np.float64) if all("loss" in r for r in rows) else None
        slices = [r["slice"] for r in rows] if rows and all("slice" in r for r in rows) else None
        clusters = [r["cluster"] for r in rows] if rows and all("cluster" in r for r in rows) else None
        num_samples = int(metrics["num_samples"])
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(
            f"{folder}: metrics.json or predictions.jsonl is not a dist_eval output ({type(e).__name__}: {e})."
        ) from e
    if len(rows) != num_samples or not np.array_equal(indices, np.arange(num_samples)):
        raise UsageError(
            f"{folder}: predictions.jsonl has {len(rows)} rows but metrics.json counts {num_samples} samples "
            "(a partial or edited output). Re-run the evaluation."
        )
    return RunOutputs(folder, metrics, indices, labels, preds, losses, slices, clusters)


@dataclass
class Comparison:
    a: RunOutputs
    b: RunOutputs
    changed: np.ndarray  # row indices whose prediction differs
    fixed: int  # wrong in A, right in B
    broken: int  # right in A, wrong in B
    paired: Optional[dict] = None  # paired_test()


def paired_test(a: RunOutputs, b: RunOutputs, resamples: int = 1000, seed: int = 0) -> dict:
    """McNemar's exact test of the accuracies and the paired bootstrap intervals of B - A
    (accuracy, macro-F1, loss) on the shared rows (row i of A is row i of B: checked by
    :func:`compare_runs`). Without per-row losses (older runs) the loss is left out. Runs
    with the same clusters (``--cluster-by``): ``bootstrap`` draws whole clusters, and
    ``bootstrap_rows`` (the rows one by one) is beside it. ``power``: the minimum detectable
    effect of these rows (:func:`dist_eval.power.power_summary`).
    """
    from dist_eval.paired import mcnemar_exact, paired_bootstrap
    from dist_eval.power import power_summary

    num_labels = int(a.metrics["num_labels"])
    out = {"a": a.folder, "b": b.folder, "shared_rows": int(a.labels.shape[0])}
    out["mcnemar"] = mcnemar_exact(a.preds == a.labels, b.preds == b.labels)
    with_loss = a.losses is not None and b.losses is not None
    zeros = np.zeros(a.labels.shape[0])
    boot = paired_bootstrap(
        a.labels, a.preds, b.preds, a.losses if with_loss else zeros, b.losses if with_loss else zeros,
        num_labels, resamples=resamples, seed=seed,
    )
    clusters = _shared_clusters(a, b)
    clustered = None
    if clusters is not None:
        from dist_eval.clusters import cluster_numbers, paired_cluster_bootstrap

        clustered = paired_cluster_bootstrap(
            a.labels, a.preds, b.preds, a.losses if with_loss else zeros, b.losses if with_loss else zeros,
            cluster_numbers(clusters), num_labels, resamples=resamples, seed=seed)
    for result in (boot, clustered):
        if result is not None and not with_loss:
            del result["loss"]
    out["bootstrap"] = clustered or boot
    if clustered:
        out["bootstrap_rows"] = boot
    deff = (clustered or {}).get("accuracy", {}).get("design_effect") or 1.0
    out["power"] = power_summary(out["shared_rows"], out["mcnemar"]["discordant"], max(1.0, deff))
    cells = _shared_slices(a, b)
    if cells:
        from dist_eval.slices import compare_slices

        out["slices"] = compare_slices(cells, a.preds == a.labels, b.preds == b.labels)
    return out


def _shared_clusters(a: RunOutputs, b: RunOutputs) -> Optional[list]:
    """Each shared row's cluster when both runs have them (``--cluster-by``); refused where they differ."""
    if not a.clusters or not b.clusters:
        return None
    if a.clusters != b.clusters:
        first = next(i for i, (x, y) in enumerate(zip(a.clusters, b.clusters)) if x != y)
        raise UsageError(f"{a.folder} and {b.folder}: the clusters of row {first} differ ({a.clusters[first]!r} vs "
                         f"{b.clusters[first]!r}): the runs were clustered by different columns or are over "
                         "different data. Run both with the same --cluster-by.")
    return a.clusters


def _shared_slices(a: RunOutputs, b: RunOutputs) -> Optional[list]:
    """Each shared row's slices, {column: value}, over the columns both runs sliced by (and
    where the two agree on every row: else the runs' data differ there, and it is refused).
    """
    if not a.slices or not b.slices:
        return None
    columns = [column for column in a.slices[0] if column in b.slices[0]]
    cells = [{column: cell[column] for column in columns} for cell in a.slices]
    other = [{column: cell[column] for column in columns} for cell in b.slices]
    if cells != other:
        first = next(i for i, (x, y) in enumerate(zip(cells, other)) if x != y)
        raise UsageError(f"{a.folder} and {b.folder}: the slices of row {first} differ ({cells[first]} vs "
                         f"{other[first]}): the runs are over different data. Compare two runs of the same split.")
    return cells if columns else None


def compare_runs(a: RunOutputs, b: RunOutputs, resamples: int = 1000, seed: int = 0) -> Comparison:
    """The differences of two runs; refuses runs over different data."""
    n_a, n_b = a.metrics["num_samples"], b.metrics["num_samples"]
    if n_a != n_b:
        raise UsageError(
            f"{a.folder} has {n_a} samples and {b.folder} has {n_b}: the runs are over different datasets. "
            "Compare two runs of the same split."
        )
    if a.metrics.get("num_labels") != b.metrics.get("num_labels"):
        raise UsageError(
            f"{a.folder} has {a.metrics.get('num_labels')} classes and {b.folder} has {b.metrics.get('num_labels')}: "
            "the runs are over different tasks. Compare two runs of the same split."
        )
    differ = np.flatnonzero(a.labels != b.labels)
    if differ.size:
        raise UsageError(
            f"{a.folder} and {b.folder}: the labels differ on {differ.size} of {n_a} rows (first at index "
            f"{differ[:5].tolist()}): the runs are over different datasets. Compare two runs of the same split."
        )
    changed = np.flatnonzero(a.preds != b.preds)
    right_a, right_b = a.preds == a.labels, b.preds == b.labels
    paired = paired_test(a, b, resamples, seed)
    return Comparison(a, b, changed, int((~right_a & right_b).sum()), int((right_a & ~right_b).sum()), paired)


def format_paired(paired: Optional[dict]) -> List[str]:
    """The paired test's lines: McNemar's p-value, and B - A with its bootstrap interval."""
    if not paired:
        return []
    m = paired["mcnemar"]
    lines = [
        f"paired test on the {paired['shared_rows']} shared rows:",
        f"  McNemar exact test of accuracy: p = {m['pvalue']:.4g} ({m['a_only']} rows right in A only, "
        f"{m['b_only']} in B only)",
    ]
    boot, rows = paired.get("bootstrap"), paired.get("bootstrap_rows")
    if boot:
        level = f"{100 * boot['level']:g}%"
        for name in ("accuracy", "f1_macro", "loss"):
            if name not in boot:
                continue
            d, ci = boot[name]["difference"], boot[name]["interval"]
            ci_text = f"   {level} CI [{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci else ""
            row_ci = ((rows or {}).get(name) or {}).get("interval")
            ci_text += f"   (rows as independent: [{row_ci[0]:+.4f}, {row_ci[1]:+.4f}])" if ci and row_ci else ""
            lines.append(f"  B-A {name:<12} {d:+.4f}{ci_text}")
        if boot["resamples"] and "clusters" in boot:
            lines.append(f"  (paired cluster bootstrap: {boot['resamples']} resamples of the {boot['clusters']} "
                         f"clusters, seed {boot['seed']}, the same clusters for A and B; design effect of the "
                         f"difference {boot['accuracy']['design_effect']:.2f})")
        elif boot["resamples"]:
            lines.append(f"  (paired bootstrap: {boot['resamples']} resamples, seed {boot['seed']}, "
                         "the same rows for A and B)")
    from dist_eval.slices import format_compared_slices

    return lines + format_power(paired.get("power")) + format_compared_slices(paired.get("slices"))


def format_power(power: Optional[dict]) -> List[str]:
    """The line on the power of the comparison: its minimum detectable effect."""
    if not power:
        return []
    share = f"{power['rows']} rows, {100 * power['discordance']:.1f}% of them right in one run only"
    share += f", design effect {power['design_effect']:.2f}" if "design_effect" in power else ""
    mde = power["minimum_detectable_effect"]
    if mde is None:
        return [f"  power: with {share}, no difference in accuracy can be detected with "
                f"{100 * power['power']:g}% power at level {power['alpha']:g}"]
    return [f"  power: with {share}, a difference in accuracy of {mde:.4f} ({100 * mde:.2f} points) or more is "
            f"detected with {100 * power['power']:g}% power at level {power['alpha']:g} (minimum detectable effect)"]


def format_rows_for_effect(paired: dict, effect: float) -> str:
    """``--rows-for-effect``: the rows a paired comparison needs for ``effect`` at the observed discordance."""
    from dist_eval.power import rows_for_effect

    power = paired["power"]
    deff = power.get("design_effect", 1.0)
    if not 0 < abs(effect) <= power["discordance"]:
        raise UsageError(f"--rows-for-effect {effect:g}: expected a difference in accuracy in (0, "
                         f"{power['discordance']:.4f}], the share of rows right in one run only here (a difference "
                         "is made of those rows). Pass a smaller difference (0.01 is one point).")
    needed = rows_for_effect(effect, power["discordance"], power["alpha"], power["power"], deff)
    return (f"rows needed to detect a difference in accuracy of {abs(effect):g} with {100 * power['power']:g}% power "
            f"at level {power['alpha']:g}: {needed} (at the discordance observed, "
            f"{100 * power['discordance']:.1f}%{f', design effect {deff:.2f}' if deff != 1.0 else ''}; "
            f"these runs have {power['rows']})")


def _names(metrics: dict) -> Optional[List[str]]:
    names = metrics.get("label_names")
    return [str(n) for n in names] if names else None


def format_comparison(c: Comparison, max_rows: int = 20) -> str:
    """The report compare prints."""
    ma, mb = c.a.metrics, c.b.metrics
    ci_a, ci_b = ma.get("confidence_intervals") or {}, mb.get("confidence_intervals") or {}
    with_ci = bool(ci_a or ci_b)
    n = ma["num_samples"]
    lines = [f"dist_eval.compare: A = {c.a.folder}, B = {c.b.folder} ({n} samples, {ma.get('num_labels')} classes)", ""]
    header = f"  {'metric':<16} {'A':>8} {'B':>8} {'B-A':>9}"
    if with_ci:
        level = ci_a.get("level") or ci_b.get("level")
        header += f"   {f'A {100 * level:g}% CI':>18}   {f'B {100 * level:g}% CI':>18}"
    lines.append(header)

    def ci_text(intervals: dict, name: str) -> str:
        return f"[{intervals[name][0]:.4f}, {intervals[name][1]:.4f}]" if name in intervals else ""

    for name in headline_names(ma):
        if mb.get(name) is None:
            continue
        line = f"  {name:<16} {ma[name]:8.4f} {mb[name]:8.4f} {mb[name] - ma[name]:+9.4f}"
        if with_ci:
            line += f"   {ci_text(ci_a, name):>18}   {ci_text(ci_b, name):>18}"
        lines.append(line.rstrip())
    lines.append("")
    paired = format_paired(c.paired)
    lines.extend([*paired, ""] if paired else [])
    other = len(c.changed) - c.fixed - c.broken
    lines.append(
        f"predictions changed on {len(c.changed)} of {n} rows: {c.fixed} now right, {c.broken} now wrong, "
        f"{other} wrong in both"
    )
    shown = c.changed[: max(0, max_rows)]
    if len(shown):
        names = _names(ma) or _names(mb)

        def show(k: int) -> str:
            return f"{k} {names[k]}" if names and 0 <= k < len(names) else str(k)

        cells = [(str(i), show(c.a.labels[i]), show(c.a.preds[i]), show(c.b.preds[i])) for i in shown.tolist()]
        widths = [
            max(len(h), *(len(row[j]) for row in cells)) for j, h in enumerate(("index", "label", "pred A", "pred B"))
        ]
        lines.append(
            "  " + "  ".join(h.ljust(w) for h, w in zip(("index", "label", "pred A", "pred B"), widths)).rstrip()
        )
        lines.extend("  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells)
        if len(c.changed) > len(shown):
            lines.append(
                f"  ... {len(c.changed) - len(shown)} more (the first {len(shown)} shown; --max-rows N shows more)"
            )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dist_eval.compare",
        description="Compare two dist_eval runs over the same data: metric differences and changed predictions.",
    )
    parser.add_argument("run_a", metavar="OUT_A", help="output folder of run A (metrics.json, predictions.jsonl)")
    parser.add_argument("run_b", metavar="OUT_B", help="output folder of run B")
    parser.add_argument("--max-rows", type=int, default=20, help="changed rows to list (default 20; 0: none)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the paired test (McNemar p-value, bootstrap intervals of B - A) to PATH")
    parser.add_argument("--bootstrap-resamples", type=int, default=1000,
                        help="resamples of the paired bootstrap (default 1000; 0: no intervals)")
    parser.add_argument("--bootstrap-seed", type=int, default=0, help="seed of the paired bootstrap (default 0)")
    parser.add_argument("--rows-for-effect", type=float, default=None, metavar="D",
                        help="also print how many rows a paired comparison needs to detect a difference in accuracy "
                             "of D (0.01: one point) with 80%% power at level 0.05, at the discordance of these runs")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.bootstrap_resamples < 0 or args.bootstrap_seed < 0:
            raise UsageError("--bootstrap-resamples and --bootstrap-seed: expected integers >= 0.")
        a, b = load_run(args.run_a), load_run(args.run_b)
        comparison = compare_runs(a, b, args.bootstrap_resamples, args.bootstrap_seed)
        planned = format_rows_for_effect(comparison.paired, args.rows_for_effect) \
            if args.rows_for_effect is not None else None
    except UsageError as e:
        print(f"dist_eval.compare: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    print(format_comparison(comparison, args.max_rows), flush=True)
    if planned:
        print(planned, flush=True)
    if args.json:
        from dist_eval.atomic import atomic_write

        atomic_write(args.json, lambda f: json.dump(comparison.paired, f, indent=2))
        print(f"paired test written to {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
