"""Compare two runs over the same data: ``python -m dist_eval.compare OUT_A OUT_B [OUT ...]``.

Prints the main metrics of both runs with B - A (and their confidence intervals when
the runs have them), a paired test on the shared rows (McNemar's exact test of the
accuracies; paired bootstrap intervals of B - A in accuracy, macro-F1 and loss; also
written to ``--json PATH``), per slice when both runs have ``--slice-by``'s (McNemar's test of each
slice, its p-value adjusted by Holm for the number of slices, and the slice's paired interval of
B - A), then the rows whose prediction changed (index, label,
pred A, pred B), up to ``--max-rows``. The rows are paired by their content (predictions.jsonl's
``key``): rows of one run only are counted, named in one warning and left out of the paired test
(runs without keys: by position). More than two runs: each pair, or each against ``--baseline``,
Holm-adjusted over every comparison. Exit 0; exit 2 with one error line when a folder is not a
finished run or the runs share no row.
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
    keys: Optional[list] = None  # each row's content key (runs since issue 52): how two runs' rows are paired

    def subset(self, rows: np.ndarray) -> RunOutputs:
        """These outputs of ``rows`` only (positions in this run), in their order."""
        pick = rows.tolist()

        def each(values):
            return None if values is None else [values[i] for i in pick]

        return RunOutputs(self.folder, self.metrics, self.indices[rows], self.labels[rows], self.preds[rows],
                          None if self.losses is None else self.losses[rows], each(self.slices), each(self.clusters),
                          each(self.keys))


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
        keys = [r["key"] for r in rows] if rows and all("key" in r for r in rows) else None
        num_samples = int(metrics["num_samples"])
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(
            f"{folder}: metrics.json or predictions.jsonl is not a dist_eval output ({type(e).__name__}: {e})."
        ) from e
    # a run that stopped early holds the rows it used: their places in the set, not 0..n-1
    if len(rows) != num_samples or np.unique(indices).size != indices.size:
        raise UsageError(
            f"{folder}: predictions.jsonl has {len(rows)} rows but metrics.json counts {num_samples} samples "
            "(a partial or edited output). Re-run the evaluation."
        )
    return RunOutputs(folder, metrics, indices, labels, preds, losses, slices, clusters, keys)


@dataclass
class Comparison:
    a: RunOutputs
    b: RunOutputs
    changed: np.ndarray  # row indices whose prediction differs
    fixed: int  # wrong in A, right in B
    broken: int  # right in A, wrong in B
    paired: Optional[dict] = None  # paired_test()
    a_only: Optional[np.ndarray] = None  # indices of A's rows that B has not (runs joined by content)
    b_only: Optional[np.ndarray] = None
    whole: tuple = ()  # (A, B) whole, when a and b are their shared rows


def join_by_content(a: RunOutputs, b: RunOutputs) -> tuple:
    """(the positions in A of the rows B has too, their positions in B, in A's order; A's positions
    B has not; B's positions A has not), by each row's content key: the k-th row of a content in
    A is paired with the k-th of that content in B (identical rows are interchangeable).
    """
    def tagged(keys):
        seen: dict = {}
        out = []
        for key in keys:
            seen[key] = seen.get(key, 0) + 1
            out.append((key, seen[key]))
        return out

    in_b = {tag: j for j, tag in enumerate(tagged(b.keys))}
    pairs = [(i, in_b.pop(tag, -1)) for i, tag in enumerate(tagged(a.keys))]
    shared_a = np.array([i for i, j in pairs if j >= 0], dtype=np.int64)
    shared_b = np.array([j for _, j in pairs if j >= 0], dtype=np.int64)
    a_only = np.array([i for i, j in pairs if j < 0], dtype=np.int64)
    return shared_a, shared_b, a_only, np.array(sorted(in_b.values()), dtype=np.int64)


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

        losses = (a.losses, b.losses) if with_loss else (zeros, zeros)
        out["slices"] = compare_slices(
            cells, a.preds == a.labels, b.preds == b.labels,
            paired=lambda mask: _slice_intervals(a, b, losses, clusters, mask, resamples, seed))
    return out


def _slice_intervals(a: RunOutputs, b: RunOutputs, losses: tuple, clusters: Optional[list], mask: np.ndarray,
                     resamples: int, seed: int) -> dict:
    """A slice's paired interval of B - A in accuracy, the one compare gives of the slice's rows
    alone: ``interval`` (with clusters, the paired cluster bootstrap's, and ``interval_rows``, the
    rows drawn one by one, beside it, with the slice's ``clusters``, ``design_effect`` and the
    cluster-robust test's ``pvalue_clustered``).
    """
    from dist_eval.paired import paired_bootstrap

    rows = np.flatnonzero(mask)
    num_labels = int(a.metrics["num_labels"])
    arrays = (a.labels[rows], a.preds[rows], b.preds[rows], losses[0][rows], losses[1][rows])
    by_rows = paired_bootstrap(*arrays, num_labels, resamples=resamples, seed=seed)["accuracy"]["interval"]
    if clusters is None:
        return {"interval": by_rows}
    from dist_eval.clusters import cluster_numbers, paired_cluster_bootstrap

    clustered = paired_cluster_bootstrap(*arrays, cluster_numbers([clusters[i] for i in rows.tolist()]), num_labels,
                                         resamples=resamples, seed=seed)
    accuracy = clustered["accuracy"]
    return {"interval": accuracy["interval"], "interval_rows": by_rows, "clusters": clustered["clusters"],
            "design_effect": accuracy["design_effect"], "pvalue_clustered": accuracy["pvalue_clustered"]}


def _shared_clusters(a: RunOutputs, b: RunOutputs) -> Optional[list]:
    """Each shared row's cluster when both runs have them (``--cluster-by``); refused where they differ."""
    if not a.clusters or not b.clusters:
        return None
    if a.clusters != b.clusters:
        first = next(i for i, (x, y) in enumerate(zip(a.clusters, b.clusters)) if x != y)
        raise UsageError(f"{a.folder} and {b.folder}: the clusters of row {a.indices[first]} differ "
                         f"({a.clusters[first]!r} vs {b.clusters[first]!r}): the runs were clustered by different "
                         "columns or are over "
                         "different data. Run both with the same --cluster-by.")
    return a.clusters


def _shared_slices(a: RunOutputs, b: RunOutputs) -> Optional[list]:
    """Each shared row's slices, {column: value}, over the columns both runs sliced by (and
    where the two agree on every row: else the runs' data differ there, and it is refused). The
    token-length quartiles are of each run's whole set: left out where two sets cut them apart.
    """
    from dist_eval.slices import TOKEN_LENGTH_SLICES

    if not a.slices or not b.slices:
        return None
    columns = [column for column in a.slices[0] if column in b.slices[0]]
    if TOKEN_LENGTH_SLICES in columns and any(x[TOKEN_LENGTH_SLICES] != y[TOKEN_LENGTH_SLICES]
                                              for x, y in zip(a.slices, b.slices)):
        columns.remove(TOKEN_LENGTH_SLICES)
    cells = [{column: cell[column] for column in columns} for cell in a.slices]
    other = [{column: cell[column] for column in columns} for cell in b.slices]
    if cells != other:
        first = next(i for i, (x, y) in enumerate(zip(cells, other)) if x != y)
        raise UsageError(f"{a.folder} and {b.folder}: the slices of row {a.indices[first]} differ ({cells[first]} vs "
                         f"{other[first]}): the runs are over different data. Compare two runs of the same split.")
    return cells if columns else None


def compare_runs(a: RunOutputs, b: RunOutputs, resamples: int = 1000, seed: int = 0) -> Comparison:
    """The differences of two runs on the rows they share: paired by each row's content key when
    both have them (rows of one run only are counted, named, and left out of the paired test),
    else by position (older runs: the same rows in the same order, or refused).
    """
    if a.metrics.get("num_labels") != b.metrics.get("num_labels"):
        raise UsageError(
            f"{a.folder} has {a.metrics.get('num_labels')} classes and {b.folder} has {b.metrics.get('num_labels')}: "
            "the runs are over different tasks. Compare two runs of the same split."
        )
    if a.keys is not None and b.keys is not None:
        shared_a, shared_b, a_only, b_only = join_by_content(a, b)
        if not shared_a.size:
            raise UsageError(f"{a.folder} and {b.folder} have no row in common (no row of the same text, text pair "
                             "and label): the runs are over different data. Compare two runs of the same set.")
        comparison = _compare_aligned(a.subset(shared_a), b.subset(shared_b), resamples, seed)
        comparison.a_only, comparison.b_only, comparison.whole = a.indices[a_only], b.indices[b_only], (a, b)
        comparison.paired["rows_only_in_a"] = _only(comparison.a_only)
        comparison.paired["rows_only_in_b"] = _only(comparison.b_only)
        return comparison
    n_a, n_b = a.metrics["num_samples"], b.metrics["num_samples"]
    if n_a != n_b:
        raise UsageError(
            f"{a.folder} has {n_a} samples and {b.folder} has {n_b}: the runs are over different datasets. "
            "Compare two runs of the same split."
        )
    if not np.array_equal(a.indices, b.indices):
        raise UsageError(f"{a.folder} and {b.folder} hold other rows of the set (runs that stopped early on other "
                         "rows?), and have no content keys to pair them by. Compare runs written since keys were.")
    return _compare_aligned(a, b, resamples, seed)


ONLY_SHOWN = 5  # rows of one run only named in the warning and the JSON


def _only(indices: np.ndarray) -> dict:
    return {"count": int(indices.size), "first": indices[:ONLY_SHOWN].tolist()}


def one_side_warning(c: Comparison) -> Optional[str]:
    """The one warning line on the rows of one run only (None when every row is in both)."""
    if c.a_only is None or not (c.a_only.size or c.b_only.size):
        return None

    def named(indices: np.ndarray, run: RunOutputs, other: RunOutputs) -> str:
        more = ", ..." if indices.size > ONLY_SHOWN else ""
        shown = ", ".join(map(str, indices[:ONLY_SHOWN].tolist()))
        return f"{indices.size} row(s) of {run.folder} not in {other.folder} (index {shown}{more})" if indices.size \
            else f"every row of {run.folder} is in {other.folder}"

    a, b = c.whole
    return (f"dist_eval.compare: warning: {named(c.a_only, a, b)}; {named(c.b_only, b, a)}: left out of the paired "
            f"test, which pairs the {c.paired['shared_rows']} rows of the same content in both")


def _compare_aligned(a: RunOutputs, b: RunOutputs, resamples: int, seed: int) -> Comparison:
    """:func:`compare_runs` of two runs whose row i is the same row (refused where the labels differ)."""
    n_a = a.labels.shape[0]
    differ = np.flatnonzero(a.labels != b.labels)
    if differ.size:
        raise UsageError(
            f"{a.folder} and {b.folder}: the labels differ on {differ.size} of {n_a} rows (first at index "
            f"{a.indices[differ[:5]].tolist()}): the runs are over different datasets. Compare two runs of the same "
            "split."
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
    clustered_p = ((boot or {}).get("accuracy") or {}).get("pvalue_clustered")
    if clustered_p is not None:
        lines.append(f"  cluster-robust test of accuracy (CR1, t on {boot['clusters'] - 1} df): p = {clustered_p:.4g} "
                     "(McNemar's takes the rows as independent)")
        def p_text(name: str, p: float) -> str:  # the bootstrap's p of 0: no resample beyond 0, under 2 / R
            return f"p < {2 / max(1, boot['resamples']):.2g}" if name == "f1_macro" and p == 0 else f"p = {p:.4g}"

        others = [f"{what} {p_text(name, boot[name]['pvalue_clustered'])}" for name, what in
                  (("f1_macro", "of macro F1 (the cluster bootstrap's)"), ("loss", "of loss (CR1 t)"))
                  if (boot.get(name) or {}).get("pvalue_clustered") is not None]
        if others:
            lines.append(f"  cluster-robust tests {', '.join(others)}")
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
            deff = boot["accuracy"]["design_effect"]
            lines.append(f"  (paired cluster bootstrap: {boot['resamples']} resamples of the {boot['clusters']} "
                         f"clusters, seed {boot['seed']}, the same clusters for A and B; design effect of the "
                         f"difference {'undefined' if deff is None else f'{deff:.2f}'})")
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
    n = len(c.a.labels)
    rows = f"{n} samples"
    if c.a_only is not None and (c.a_only.size or c.b_only.size):
        rows = f"{ma['num_samples']} and {mb['num_samples']} samples, {n} in both"
    lines = [f"dist_eval.compare: A = {c.a.folder}, B = {c.b.folder} ({rows}, {ma.get('num_labels')} classes)", ""]
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
    return "\n".join(lines + _changed_rows(c, max_rows))


def _changed_rows(c: Comparison, max_rows: int) -> List[str]:
    """The rows whose prediction changed: a count, then a table of the first ``max_rows`` (each
    row's index in A, and in B where it differs).
    """
    other = len(c.changed) - c.fixed - c.broken
    lines = [f"predictions changed on {len(c.changed)} of {len(c.a.labels)} rows: {c.fixed} now right, "
             f"{c.broken} now wrong, {other} wrong in both"]
    shown = c.changed[: max(0, max_rows)]
    if not len(shown):
        return lines
    names = _names(c.a.metrics) or _names(c.b.metrics)

    def show(k: int) -> str:
        return f"{k} {names[k]}" if names and 0 <= k < len(names) else str(k)

    moved = bool((c.a.indices[shown] != c.b.indices[shown]).any())
    heads = ("index", *(["index B"] if moved else []), "label", "pred A", "pred B")
    cells = [(str(c.a.indices[i]), *([str(c.b.indices[i])] if moved else []), show(c.a.labels[i]),
              show(c.a.preds[i]), show(c.b.preds[i])) for i in shown.tolist()]
    widths = [max(len(h), *(len(row[j]) for row in cells)) for j, h in enumerate(heads)]
    lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(heads, widths)).rstrip())
    lines.extend("  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells)
    if len(c.changed) > len(shown):
        lines.append(f"  ... {len(c.changed) - len(shown)} more (the first {len(shown)} shown; --max-rows N shows "
                     "more)")
    return lines


def compare_many(runs: Sequence[RunOutputs], baseline: Optional[int] = None, resamples: int = 1000,
                 seed: int = 0, alpha: float = 0.05) -> dict:
    """K runs (checkpoints) on the same data: each pair, or each run against ``runs[baseline]``,
    compared as :func:`compare_runs` compares two (McNemar's exact test, or the cluster-robust
    test of runs with the same clusters, and the paired bootstrap of B - A on the rows they
    share), the p-values adjusted by Holm over every pair compared; ``differs`` where the
    adjusted p is below ``alpha``.
    """
    from itertools import combinations

    from dist_eval.paired import holm_adjusted

    pairs = ([(baseline, j) for j in range(len(runs)) if j != baseline] if baseline is not None
             else list(combinations(range(len(runs)), 2)))
    out = []
    for i, j in pairs:
        c = compare_runs(runs[i], runs[j], resamples, seed)
        paired, boot = c.paired, c.paired.get("bootstrap") or {}
        accuracy_a, accuracy_b = (float((run.preds == run.labels).mean()) for run in (c.a, c.b))
        clustered_p = (boot.get("accuracy") or {}).get("pvalue_clustered")  # clustered runs: the clusters counted
        out.append({"a": runs[i].folder, "b": runs[j].folder, "shared_rows": paired["shared_rows"],
                    "rows_only_in_a": (paired.get("rows_only_in_a") or {}).get("count", 0),
                    "rows_only_in_b": (paired.get("rows_only_in_b") or {}).get("count", 0),
                    "accuracy_a": accuracy_a, "accuracy_b": accuracy_b, "difference": accuracy_b - accuracy_a,
                    "interval": (boot.get("accuracy") or {}).get("interval"),
                    "test": "McNemar exact" if clustered_p is None else "cluster-robust t (CR1)",
                    "pvalue": paired["mcnemar"]["pvalue"] if clustered_p is None else clustered_p,
                    "minimum_detectable_effect": paired["power"]["minimum_detectable_effect"]})
    for row, adjusted in zip(out, holm_adjusted([row["pvalue"] for row in out])):
        row["pvalue_holm"] = adjusted
        row["differs"] = adjusted < alpha
    return {"test": "McNemar exact, per pair", "adjustment": "holm", "alpha": alpha,
            "baseline": runs[baseline].folder if baseline is not None else None, "pairs": out}


def checkpoint_comparisons(output_dir: str, pairs: Sequence, alpha: float = 0.05) -> Optional[dict]:
    """A run of several checkpoints (:mod:`dist_eval.plan`'s pairs, their reports written): on each
    set, every two checkpoints compared as :func:`compare_many` compares runs (McNemar's exact
    test and the minimum detectable effect on the rows they share; no bootstrap: ``compare``
    gives the intervals), the p-values adjusted by Holm over every comparison of the run. None
    with fewer than two checkpoints on every set.
    """
    from dist_eval.paired import holm_adjusted

    by_set: dict = {}
    for pair in pairs:
        by_set.setdefault(pair.data.name, []).append(pair)
    rows = []
    for name, set_pairs in by_set.items():
        if len(set_pairs) < 2:
            continue
        runs = [load_run(os.path.join(output_dir, pair.folder)) for pair in set_pairs]
        for run, pair in zip(runs, set_pairs):
            run.folder = pair.folder or "."
        rows += [{"set": name, **row} for row in compare_many(runs, None, 0, 0, alpha)["pairs"]]
    if not rows:
        return None
    for row, adjusted in zip(rows, holm_adjusted([row["pvalue"] for row in rows])):
        row["pvalue_holm"] = adjusted
        row["differs"] = adjusted < alpha
    return {"test": "McNemar exact, per pair of checkpoints on each set", "adjustment": "holm", "alpha": alpha,
            "baseline": None, "pairs": rows}


def checkpoints_table(output_dir: str, pairs: Sequence) -> tuple:
    """(:func:`checkpoint_comparisons` or None, its table to print): a run's summary. Reports that
    compare refuses get a line saying why, not a failed run (its reports stand).
    """
    try:
        compared = checkpoint_comparisons(output_dir, pairs)
    except UsageError as e:
        return None, f"  the checkpoints are not compared: {e}"
    return compared, format_many(compared, "  checkpoints compared on each set") if compared else ""


def format_many(result: dict, title: str = "dist_eval.compare") -> str:
    """The table ``compare`` prints for K runs: each pair's accuracies, B - A, its interval, p, Holm's p."""
    rows = result["pairs"]
    what = f"each against {result['baseline']}" if result["baseline"] else "each pair"
    width_a, width_b = (max(1, *(len(r[side]) for r in rows)) for side in ("a", "b"))
    tests = " and ".join(sorted({r["test"] for r in rows}))
    lines = [f"{title}: {what}, {len(rows)} comparisons (paired, {tests}; p adjusted by Holm "
             f"for the {len(rows)} comparisons):",
             f"  {'A':<{width_a}}  {'B':<{width_b}} {'rows':>6} {'A acc':>7} {'B acc':>7} {'B-A':>8} "
             f"{'95% CI of B-A':>18} {'p':>8} {'p (Holm)':>9}  {'MDE':>6}"]
    for r in rows:
        ci = f"[{r['interval'][0]:+.4f}, {r['interval'][1]:+.4f}]" if r["interval"] else ""
        mde = f"{r['minimum_detectable_effect']:.4f}" if r["minimum_detectable_effect"] is not None else "-"
        lines.append(f"  {r['a']:<{width_a}}  {r['b']:<{width_b}} {r['shared_rows']:6d} {r['accuracy_a']:7.4f} "
                     f"{r['accuracy_b']:7.4f} {r['difference']:+8.4f} {ci:>18} {r['pvalue']:8.4g} "
                     f"{r['pvalue_holm']:9.4g}  {mde:>6}" + ("  differs" if r["differs"] else ""))
    differ = [f"{r['a']} vs {r['b']} ({r['b'] if r['difference'] > 0 else r['a']} better)"
              for r in rows if r["differs"]]
    lines.append(f"  pairs that differ (Holm-adjusted p < {result['alpha']:g}): {', '.join(differ)}" if differ
                 else f"  no pair differs (every Holm-adjusted p >= {result['alpha']:g})")
    return "\n".join(lines)


def many_warning(result: dict) -> Optional[str]:
    """The one warning line on the rows of one run only, over every pair compared (None: none)."""
    uneven = [r for r in result["pairs"] if r["rows_only_in_a"] or r["rows_only_in_b"]]
    if not uneven:
        return None
    shown = "; ".join(f"{r['a']} vs {r['b']}: {r['rows_only_in_a']} and {r['rows_only_in_b']}" for r in uneven[:3])
    return (f"dist_eval.compare: warning: rows of one run only in {len(uneven)} of the {len(result['pairs'])} pairs "
            f"({shown}{'; ...' if len(uneven) > 3 else ''}): left out of those pairs' tests")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dist_eval.compare",
        description="Compare two dist_eval runs over the same data, their rows paired by content: metric differences, "
                    "the paired test and changed predictions; more runs: each pair (or each against --baseline), "
                    "Holm-adjusted.",
    )
    parser.add_argument("run_a", metavar="OUT_A", help="output folder of run A (metrics.json, predictions.jsonl)")
    parser.add_argument("run_b", metavar="OUT_B", help="output folder of run B")
    parser.add_argument("more", metavar="OUT", nargs="*",
                        help="more runs (checkpoints): each pair is compared, or each against --baseline, with "
                             "Holm's adjustment over every comparison")
    parser.add_argument("--baseline", metavar="OUT", default=None,
                        help="compare every other run with this one (one of the folders given), not each pair")
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


def _check_args(args) -> tuple:
    """(the folders, the baseline's place among them or None); bad arguments refused in one line."""
    folders = [args.run_a, args.run_b, *args.more]
    if args.bootstrap_resamples < 0 or args.bootstrap_seed < 0:
        raise UsageError("--bootstrap-resamples and --bootstrap-seed: expected integers >= 0.")
    if args.baseline is not None and args.baseline not in folders:
        raise UsageError(f"--baseline {args.baseline}: expected one of the folders compared ({', '.join(folders)}). "
                         "Pass one of them, or drop --baseline (each pair).")
    if len(folders) > 2 and len(set(folders)) != len(folders):
        raise UsageError(f"{', '.join(folders)}: a folder is given twice. Pass each run once.")
    if args.rows_for_effect is not None and len(folders) > 2:
        raise UsageError(f"--rows-for-effect {args.rows_for_effect:g}: expected two runs (the discordance of one "
                         f"pair), got {len(folders)}. Compare the pair alone to plan its rows.")
    return folders, None if args.baseline is None else folders.index(args.baseline)


def _compared(args) -> tuple:
    """What the runs the arguments name compare to: (a warning line or '', the lines to print, what
    ``--json`` writes, its name). Two runs: the paired test (and the rows an effect needs); more: every
    pair, or each against the baseline, Holm over them all.
    """
    folders, baseline = _check_args(args)
    if len(folders) > 2:
        result = compare_many([load_run(folder) for folder in folders], baseline, args.bootstrap_resamples,
                              args.bootstrap_seed)
        return many_warning(result), [format_many(result)], result, "comparisons"
    if baseline == 1:  # the baseline is A
        folders.reverse()
    a, b = load_run(folders[0]), load_run(folders[1])
    comparison = compare_runs(a, b, args.bootstrap_resamples, args.bootstrap_seed)
    lines = [format_comparison(comparison, args.max_rows)]
    if args.rows_for_effect is not None:
        lines.append(format_rows_for_effect(comparison.paired, args.rows_for_effect))
    return one_side_warning(comparison), [line for line in lines if line], comparison.paired, "paired test"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        warning, lines, written, name = _compared(args)
    except UsageError as e:
        print(f"dist_eval.compare: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if warning:
        print(warning, file=sys.stderr, flush=True)
    for line in lines:
        print(line, flush=True)
    if args.json:
        from dist_eval.atomic import atomic_write

        atomic_write(args.json, lambda f: json.dump(written, f, indent=2))
        print(f"{name} written to {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
