"""Formatting: the lines ``compare`` prints (two runs, K runs, a run's summary of its checkpoints) and its
warnings on rows of one run only.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from dist_eval.compare.read import RunOutputs
from dist_eval.compare.statistics import ONLY_SHOWN, Comparison, checkpoint_comparisons
from dist_eval.errors import UsageError
from dist_eval.metrics import headline_names


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
    elif (boot or {}).get("clusters") and (boot.get("accuracy") or {}).get("standard_error_clustered") is not None:
        lines.append("  cluster-robust test of accuracy: none (every cluster holds the same difference: no spread to "
                     "test with); McNemar's above is the test")
    if (boot or {}).get("clusters"):
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
    same_rows = not (c.a_only is not None and (c.a_only.size or c.b_only.size))
    if not same_rows:
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
        # on other rows B - A is no difference of the models: the paired one below, on the rows in both, is
        difference = f"{mb[name] - ma[name]:+9.4f}" if same_rows else f"{'-':>9}"
        line = f"  {name:<16} {ma[name]:8.4f} {mb[name]:8.4f} {difference}"
        if with_ci:
            line += f"   {ci_text(ci_a, name):>18}   {ci_text(ci_b, name):>18}"
        lines.append(line.rstrip())
    if not same_rows:
        lines.append(f"  (A and B as each run reported them, on its own rows; B - A below is on the {n} rows in both)")
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
