"""Metrics per slice of the data (``--slice-by COLUMN ...``, issue 39): a pure post-processing
of the merged, de-duplicated rows on rank 0.

Each slice (the rows with one value of one column) gets every metric of the whole set,
computed by the same function (:func:`dist_eval.scoring.row_metrics`) on its rows in row-index
order: so a slice's metrics are those of evaluating the slice on its own, exactly, for any
number of ranks (the merge is exact). A slice of fewer than :data:`MIN_INTERVAL_ROWS` rows
gets no bootstrap interval, and says so.
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Optional

import numpy as np

# each row's slice names are read with its rows (dist_eval.data.groups); the names stay importable here
from dist_eval.data.groups import EMPTY, MISSING, read_cluster_names, read_slice_values, slice_value  # noqa: F401
from dist_eval.data.tokenize import trim_heap

# Below this many rows a slice's bootstrap interval is not reported: a percentile bootstrap of
# a handful of rows is far narrower than the truth.
MIN_INTERVAL_ROWS = 30
# The slices of the rows by their token count's quartile, whatever the columns (--slice-by).
TOKEN_LENGTH_SLICES = "token_length_quartile"
TOO_FEW = f"too few rows for an interval (fewer than {MIN_INTERVAL_ROWS})"


def length_quartiles(tokenizer, settings, dataset) -> List[str]:
    """Each row's token-length quartile, named with its range: ``Q1 (3-7 tokens)`` (the text
    as the model gets it: the template filled in, truncated to ``max_length``). Quartile edges
    of the rows' lengths (lower values); tied lengths share a quartile, so there may be fewer.
    """
    from dist_eval.backends.families import tokenizers_calling_the_base
    from dist_eval.data.shard import token_lengths

    # the counts the batch plan measured (no second tokenization), else counted a chunk at a time
    lengths = token_lengths(dataset, tokenizer, settings, tokenizers_calling_the_base())
    if not lengths.size:
        return []
    edges = np.quantile(lengths, [0.25, 0.5, 0.75], method="lower")
    quartile = np.searchsorted(edges, lengths, side="left")  # <= edges[0]: Q1, ...
    names = {}
    for q in np.unique(quartile).tolist():
        inside = lengths[quartile == q]
        names[q] = f"Q{q + 1} ({inside.min()}-{inside.max()} tokens)"
    return [names[q] for q in quartile.tolist()]


def attach_slices(results: list, rows, tokenizer, settings, options) -> None:
    """Once, after the rounds, for every entry point (``evaluate``, ``evaluate_pair``, the CLI): each
    result's intervals resampling whole clusters (``--cluster-by``) and its metrics per slice
    (``--slice-by``: ``metrics["slices"]``), of the slices and clusters ``rows`` (the run's
    :class:`~dist_eval.data.sample.Rows`) were drawn with; computed on rank 0 from its merged rows,
    sent to every rank. ``result.slices``: each row's slice names, rank 0.
    """
    from dist_eval import ranks

    if options.slice_by is None and rows.clusters is None:
        return
    main, values = ranks.is_main_process(), rows.slices
    bootstrap = (options.bootstrap_resamples, options.bootstrap_seed)
    made = [(result.metrics, None) for result in results]  # each result's (metrics, slices' report)
    with ranks.phase("the slices and clusters"):  # rank 0's work: a failure there fails every rank at once
        if main and options.slice_by is not None and tokenizer is not None:
            values = {**values, TOKEN_LENGTH_SLICES: length_quartiles(tokenizer, settings, rows.dataset)}
        for number, result in enumerate(results if main else ()):
            if options.slice_by is not None:
                result.slices = values
            made[number] = clustered_slices(
                result.predictions, result.metrics, values if options.slice_by is not None else None,
                (result.metrics["num_labels"], result.metrics.get("label_names")),
                (bootstrap, result.metrics.get("top_k")), len(rows), rows.clusters)
    for result, (metrics, report) in zip(results, made):
        if rows.clusters is not None:
            result.metrics = metrics = ranks.broadcast_object(metrics if main else None)
        if options.slice_by is not None:
            metrics["slices"] = ranks.broadcast_object(report)


def clustered_slices(merged, metrics: Optional[dict], values: Optional[Dict[str, List[str]]], labels: tuple,
                     scoring: tuple, rows_in_set: Optional[int] = None, clusters: Optional[tuple] = None) -> tuple:
    """Rank 0: (``metrics``, the report of the slices of ``values``) of the merged rows: ``metrics`` (the
    whole set's; None: none) with every interval resampling whole clusters (``clusters``: (column, each
    row's cluster name); None: as it is), and the slices' (:func:`slice_report`; None without ``values``).
    ``labels``: (num_labels, label_names); ``scoring``: (bootstrap (resamples, seed) or None, top_k).
    The softmax of the rows' logits once, then each slice's report, then the clusters' intervals of the
    set and of every slice in one call (:func:`dist_eval.clusters.clustered_reports`).
    """
    from dist_eval.scoring import mapped_softmax, row_metrics

    indices = np.asarray(merged.indices, dtype=np.int64)
    numbered = {} if values is None else _slice_numbers(values, indices)
    (num_labels, label_names), (bootstrap, top_k) = labels, scoring
    # row by row: a slice's rows get the bits of the softmax of the slice's logits alone
    probs = None if merged.logits is None else mapped_softmax(merged.logits)
    by: dict = {}
    for column, (number_of, named) in numbered.items():
        by[column] = {}
        for name, number in named.items():  # a slice's point metrics and its rows' intervals
            mask = number_of == number
            enough = int(mask.sum()) >= MIN_INTERVAL_ROWS
            report = row_metrics(merged.labels[mask], merged.preds[mask], merged.losses[mask], None, num_labels,
                                 label_names, bootstrap if enough else None, top_k,
                                 probs=None if probs is None else probs[mask])
            trim_heap()  # each slice's temporaries given back before the next
            if bootstrap and bootstrap[0] and not enough:
                report["interval_note"] = TOO_FEW
            # NaN as None (JSON has no NaN): a slice's undefined AUROC, or its loss of no rows
            by[column][name] = {k: None if isinstance(v, float) and np.isnan(v) else v for k, v in report.items()}
    if clusters is not None:
        from dist_eval.clusters import clustered_reports

        # a slice's mask made as its turn comes (a bool a row), not every slice's at once
        pairs = itertools.chain([(metrics, None)] if metrics is not None else [], (
            (by[column][name], number_of == number) for column, (number_of, named) in numbered.items()
            for name, number in named.items()))
        done = iter(clustered_reports(pairs, merged, probs, clusters, bootstrap))
        metrics = next(done) if metrics is not None else None
        by = {column: {name: next(done) for name in named} for column, (_, named) in numbered.items()}
    report = None if values is None else {
        "columns": list(values), "min_rows_for_interval": MIN_INTERVAL_ROWS, "rows": int(indices.size),
        "rows_in_set": int(rows_in_set if rows_in_set is not None else indices.size), "by": by}
    return metrics, report


def clustered_metrics(metrics: dict, merged, clusters: tuple, bootstrap) -> dict:
    """Rank 0: ``metrics``, every interval resampling whole clusters (:func:`~dist_eval.clusters.clustered_report`)."""
    return clustered_slices(merged, metrics, None, (metrics["num_labels"], metrics.get("label_names")),
                            (bootstrap, metrics.get("top_k")), None, clusters)[0]


def slice_report(merged, values: Dict[str, List[str]], num_labels: int, label_names, scoring,
                 rows_in_set: Optional[int] = None, clusters: Optional[tuple] = None) -> dict:
    """Rank 0: ``{"columns", "min_rows_for_interval", "rows", "rows_in_set", "by": {column:
    {value: metrics}}}`` of the merged rows (``merged.indices`` index ``values``' rows).
    ``scoring``: (bootstrap (resamples, seed) or None, top_k). A slice's metrics are
    :func:`dist_eval.scoring.row_metrics` of its rows (``confidence_intervals`` only from
    MIN_INTERVAL_ROWS rows on; else ``interval_note`` says why there is none). ``clusters``:
    (column, each row's cluster) of ``--cluster-by``: the intervals resample the slice's clusters
    (:func:`dist_eval.clusters.clustered_report`).
    """
    return clustered_slices(merged, None, values, (num_labels, label_names), scoring, rows_in_set, clusters)[1]


def _slice_numbers(values: Dict[str, List[str]], indices: np.ndarray) -> dict:
    """``{column: (each merged row's slice number, {value: its number})}``, the values sorted by name, those of
    no merged row left out.
    """
    numbered = {}
    for column, column_values in values.items():
        # each row's slice as a number (4 bytes a row; issue 51: not a text array and a str a row)
        numbers: dict = {}
        number_of = np.fromiter((numbers.setdefault(str(value), len(numbers)) for value in column_values),
                                dtype=np.int32, count=len(column_values))[indices]
        present = set(np.unique(number_of).tolist())
        numbered[column] = (number_of, {name: number for name, number in sorted(numbers.items()) if number in present})
    return numbered


# compare's per-slice test: a slice differs when its Holm-adjusted McNemar p-value is below this
COMPARE_ALPHA = 0.05


def compare_slices(cells: list, correct_a: np.ndarray, correct_b: np.ndarray, alpha: float = COMPARE_ALPHA,
                   paired=None) -> dict:
    """Two runs per slice, paired on the shared rows: for every slice (``cells``: each row's
    ``{column: value}``), each run's accuracy, B - A, McNemar's exact p-value and Holm's
    adjustment of it over every slice compared; ``differs`` when the adjusted p is below
    ``alpha``. Slices in the order of their columns (column, then value).
    ``paired(mask)``: more of a slice (its interval of B - A; with clusters, ``pvalue_clustered``,
    the p-value Holm adjusts where there is one: :func:`dist_eval.compare.paired_test`).
    """
    from dist_eval.paired import holm_adjusted, mcnemar_exact

    columns = list(cells[0]) if cells else []
    out = []
    for column in columns:
        names = np.array([slice_value(cell.get(column)) for cell in cells], dtype=object).astype(str)
        for name in sorted(set(names.tolist())):
            mask = names == name
            test = mcnemar_exact(correct_a[mask], correct_b[mask])
            acc_a, acc_b = float(correct_a[mask].mean()), float(correct_b[mask].mean())
            out.append({"column": column, "value": name, "rows": int(mask.sum()), "accuracy_a": acc_a,
                        "accuracy_b": acc_b, "difference": acc_b - acc_a, "a_only": test["a_only"],
                        "b_only": test["b_only"], "pvalue": test["pvalue"], **(paired(mask) if paired else {})})
    clustered = any(row.get("pvalue_clustered") is not None for row in out)
    tested = [row["pvalue"] if row.get("pvalue_clustered") is None else row["pvalue_clustered"] for row in out]
    for row, adjusted in zip(out, holm_adjusted(tested)):
        row["pvalue_holm"] = adjusted
        row["differs"] = adjusted < alpha
    test = "cluster-robust t (CR1; McNemar exact where a slice has one cluster)" if clustered else "McNemar exact"
    return {"test": f"{test}, per slice", "adjustment": "holm", "alpha": alpha, "slices": out}


def format_compared_slices(compared: Optional[dict]) -> List[str]:
    """The lines ``python -m dist_eval.compare`` prints per slice: a table, then the slices that differ."""
    if not compared or not compared["slices"]:
        return []
    rows = compared["slices"]
    names = [f"{r['column']}={r['value']}" for r in rows]
    width = max(5, *map(len, names))
    clustered = compared["test"].startswith("cluster-robust")
    test = "the cluster-robust test (CR1)" if clustered else "McNemar's exact test"
    ci = [f"{'CI of B-A':>18}"] if any(r.get("interval") for r in rows) else []
    ci += [f"{'CI, rows as indep.':>18}"] if ci and clustered else []
    lines = [f"per slice (paired, {test}; p adjusted by Holm for the {len(rows)} slices compared):",
             (f"  {'slice':<{width}} {'rows':>6} {'A acc':>8} {'B acc':>8} {'B-A':>9} {'p':>8} {'p (Holm)':>9} "
              + " ".join(ci)).rstrip()]

    def interval(r, key):
        return f"[{r[key][0]:+.4f}, {r[key][1]:+.4f}]" if r.get(key) else ""

    for name, r in zip(names, rows):
        p = r["pvalue"] if r.get("pvalue_clustered") is None else r["pvalue_clustered"]
        cells = [f"{interval(r, 'interval'):>18}"] if ci else []
        cells += [f"{interval(r, 'interval_rows'):>18}"] if len(ci) == 2 else []
        lines.append((f"  {name:<{width}} {r['rows']:6d} {r['accuracy_a']:8.4f} {r['accuracy_b']:8.4f} "
                      f"{r['difference']:+9.4f} {p:8.4g} {r['pvalue_holm']:9.4g} " + " ".join(cells)).rstrip()
                     + ("  differs" if r["differs"] else ""))
    differ = [f"{name} ({'B' if r['difference'] > 0 else 'A'} better)" for name, r in zip(names, rows) if r["differs"]]
    lines.append(f"  slices that differ (Holm-adjusted p < {compared['alpha']:g}): {', '.join(differ)}" if differ
                 else f"  no slice differs (every Holm-adjusted p >= {compared['alpha']:g})")
    return lines
