"""Statistics: two runs compared on the rows they share (:func:`compare_runs`: McNemar's exact test, the paired
bootstrap, per slice, the power), K runs each pair or against a baseline with Holm's adjustment
(:func:`compare_many`), a run's checkpoints on each set (:func:`checkpoint_comparisons`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from dist_eval.compare.join import join_by_content, shared_clusters, shared_slices
from dist_eval.compare.read import RunOutputs, load_run
from dist_eval.errors import UsageError


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
    clusters = shared_clusters(a, b)
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
    cells = shared_slices(a, b)
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
    clustered = any(row["test"] != "McNemar exact" for row in out)
    test = "cluster-robust t (CR1; McNemar exact where it has no spread to test)" if clustered else "McNemar exact"
    return {"test": f"{test}, per pair", "adjustment": "holm", "alpha": alpha,
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
