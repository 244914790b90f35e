"""Bootstrap confidence intervals for accuracy, macro-F1 and mean loss.

A pure, vectorised function of the merged per-sample arrays that depends only on the
multiset of (label, pred, loss) samples, never on their order: the same for any world
size, and the same seed gives the same interval on any machine.

Why it is fast for any n: a bootstrap resample draws n samples with replacement, so the
number of draws that land in each confusion-matrix cell is Multinomial(n, cm / n). The
confusion matrices of the resamples are drawn directly from that law (exactly the
bootstrap distribution, at a cost of resamples x non-empty cells, not resamples x n).
The loss needs the values themselves: the sorted losses are split into at most
``LOSS_GROUPS`` equal-count groups, the draws per group are Multinomial(n, size / n)
(exact), and the sum of a group's draws is its count x mean plus a normal term with the
group's variance. Up to ``LOSS_GROUPS`` samples every group is one sample and the loss
bootstrap is exact too; above, the groups are narrow quantile bins and the normal term
keeps the within-group spread (mean and variance exact).
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from dist_eval.metrics import weighted_sums
from dist_eval.resampling import check_resampling, generator, multinomial_counts, percentile_intervals, resample_counts

METHOD = "bootstrap-percentile"
LOSS_GROUPS = 4096


def bootstrap_intervals(
    labels: np.ndarray,
    preds: np.ndarray,
    losses: np.ndarray,
    num_labels: int,
    resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> Optional[Dict]:
    """Percentile bootstrap intervals: ``{"method", "resamples", "seed", "level",
    "accuracy": [lo, hi], "f1_macro": [lo, hi], "loss": [lo, hi]}``.

    Metrics are recomputed per resample as :mod:`dist_eval.metrics` computes them
    (macro-F1 over all ``num_labels`` classes, absent ones as 0). Random numbers come
    from ``numpy.random.Generator(PCG64(seed))``. Returns None when ``resamples`` is 0
    or there are no samples. Cost: independent of n beyond 4096 samples, but for the sort of
    the losses (figures: benchmarks/RESULTS.md).
    """
    labels = np.asarray(labels, dtype=np.int64)
    preds = np.asarray(preds, dtype=np.int64)
    losses = np.asarray(losses, dtype=np.float64)
    check_resampling(resamples, level)
    if not labels.shape == preds.shape == losses.shape:
        raise ValueError(f"labels, preds and losses differ in shape: {labels.shape}, {preds.shape}, {losses.shape}")
    n = labels.shape[0]
    if resamples == 0 or n == 0:
        return None
    rng = generator(seed)
    accuracy, f1_macro = _resample_confusion_metrics(rng, labels, preds, num_labels, resamples)
    loss = _resample_mean_loss(rng, losses, resamples)
    return percentile_intervals({"accuracy": accuracy, "f1_macro": f1_macro, "loss": loss}, seed, level, METHOD)


def _resample_confusion_metrics(rng, labels, preds, num_labels: int, resamples: int):
    """Accuracy and macro-F1 of ``resamples`` bootstrap confusion matrices."""
    n = labels.shape[0]
    cell_counts = np.bincount(labels * num_labels + preds, minlength=num_labels * num_labels)
    cells = np.flatnonzero(cell_counts)  # only non-empty cells can receive draws
    probabilities = cell_counts[cells] / n
    true_of, pred_of = cells // num_labels, cells % num_labels
    on_diagonal = true_of == pred_of
    accuracy = np.empty(resamples)
    f1_macro = np.empty(resamples)
    for start, counts in multinomial_counts(rng, n, probabilities, resamples):  # counts: [r, cells]
        stop = start + counts.shape[0]
        support = _per_class(true_of, counts, num_labels)
        predicted = _per_class(pred_of, counts, num_labels)
        tp = _per_class(true_of, counts * on_diagonal[None, :], num_labels)
        denominator = support + predicted  # 2tp + fp + fn
        f1 = np.divide(2 * tp, denominator, out=np.zeros_like(tp), where=denominator != 0)
        accuracy[start:stop] = tp.sum(axis=1) / n
        f1_macro[start:stop] = f1.mean(axis=1)
    return accuracy, f1_macro


def _per_class(class_of_cell: np.ndarray, weights: np.ndarray, num_labels: int) -> np.ndarray:
    """[r, K] sums of ``weights`` [r, cells] by the class of each cell, one row per resample."""
    r = weights.shape[0]
    offsets = (np.arange(r) * num_labels)[:, None]
    flat = (offsets + class_of_cell[None, :]).ravel()
    return np.bincount(flat, weights=weights.ravel(), minlength=r * num_labels).reshape(r, num_labels)


def _resample_mean_loss(rng, losses: np.ndarray, resamples: int) -> np.ndarray:
    """Mean loss of ``resamples`` bootstrap resamples (exact up to LOSS_GROUPS samples)."""
    ordered = np.sort(losses)  # canonical order: invariant to how the rows arrived
    return _grouped_sums(rng, ordered, np.zeros(1, dtype=np.int64), resamples, LOSS_GROUPS)[:, 0] / losses.shape[0]


def _grouped_sums(rng, ordered: np.ndarray, segment_starts: np.ndarray, resamples: int, groups: int) -> np.ndarray:
    """[resamples, segments]: each resample's sum of the drawn values of each segment of
    ``ordered`` (sorted within each segment; ``segment_starts`` ascending from 0, empty
    segments allowed). A segment of m of the n values is cut into min(m, ceil(groups x m / n))
    equal-count groups (sizes differ by <= 1; one segment: min(n, groups) groups). A
    resample's n draws fall on the groups as Multinomial(n, size / n) (exact), and the sum of
    a group's d draws is d x its mean plus, when some group holds several values, a normal
    term of variance d x its variance (exact in mean and variance; exact outright when every
    group is one value).
    """
    n = ordered.size
    starts, counts = [], []
    for start, end in zip(segment_starts.tolist(), np.r_[segment_starts[1:], n].tolist()):
        size = end - start
        count = min(size, -(-groups * size // n))
        starts.append(start + (np.arange(count) * size) // max(count, 1))
        counts.append(count)
    starts = np.concatenate(starts)
    edges = np.r_[0, np.cumsum(counts)].tolist()  # segment j's groups: edges[j] to edges[j + 1]
    sizes = np.diff(np.r_[starts, n])
    means = np.add.reduceat(ordered, starts) / sizes
    variances = np.add.reduceat((ordered - np.repeat(means, sizes)) ** 2, starts) / sizes
    grouped = starts.size < n
    out = np.empty((resamples, segment_starts.size))
    for start, draws in multinomial_counts(rng, n, sizes / n, resamples):  # draws: [r, groups]
        if grouped:  # the spread of the draws inside each group
            spread = np.sqrt(draws * variances[None, :]) * rng.standard_normal(draws.shape)
        for segment, (first, last) in enumerate(zip(edges[:-1], edges[1:])):
            totals = weighted_sums(draws[:, first:last], means[first:last])
            if grouped:
                totals += spread[:, first:last].sum(axis=1)
            out[start:start + len(draws), segment] = totals
    return out


# --- intervals of the probability scores (ECE, Brier, top-k accuracy, AUROC) -------------
# Kept apart from bootstrap_intervals so its numbers stay bit for bit what they were: these
# draw from their own stream of the same seed (SeedSequence(seed, spawn_key=(1,))).

SCORES_STREAM = 1


def bootstrap_score_intervals(
    probs: np.ndarray,
    labels: np.ndarray,
    resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    top_k: int | None = None,
    bins: int = 15,
) -> dict | None:
    """Percentile bootstrap intervals of :func:`dist_eval.metrics.score_metrics`:
    ``{"method", "resamples", "seed", "level", "ece": [lo, hi], "brier": [lo, hi],
    "top{k}_accuracy": [lo, hi], "auroc_macro": [lo, hi]}`` (the same keys as
    :func:`bootstrap_intervals`, so the two dicts can be merged).

    Every metric is recomputed on the same resamples, drawn as row indices over a
    canonical order of the rows (sorted by label and probabilities), so the result depends
    only on the multiset of rows: the same for any world size and row order, and the same
    seed gives the same intervals on any machine. An exact bootstrap up to EXACT_SCORE_ROWS
    rows: cost about resamples x rows x (classes + bins) operations (figures:
    benchmarks/RESULTS.md). Above, when :func:`grouped_score_intervals` holds, the rows are
    drawn grouped (:func:`_grouped_score_resamples`: ``method`` says so), at a cost of
    resamples x SCORE_GROUPS and a sort of the rows. ``auroc_macro`` of a resample is
    over the classes present in it; resamples where it is undefined (one class) are left
    out of its percentiles (NaN interval when all are). Returns None when ``resamples`` is
    0 or there are no rows.
    """
    from dist_eval.metrics import _scores_and_labels

    probs, labels = _scores_and_labels(probs, labels)
    return drawn_score_intervals(probs, labels, resamples, seed, level, top_k, bins)


def drawn_score_intervals(probs: np.ndarray, labels: np.ndarray, resamples: int, seed: int, level: float = 0.95,
                          top_k: int | None = None, bins: int = 15) -> dict | None:
    """:func:`bootstrap_score_intervals` of rows already checked: float64 probabilities (rows x classes)
    and integer labels in range, as a report has them once :func:`dist_eval.metrics.score_metrics` took
    them (the rows' report and the run's merge, :mod:`dist_eval.scoring`, :mod:`dist_eval.merge`).
    """
    check_resampling(resamples, level)
    if resamples == 0 or labels.shape[0] == 0:
        return None
    if grouped_score_intervals(probs, labels):
        values = _grouped_score_resamples(probs, labels, resamples, seed, top_k, bins)
        return {**score_percentiles(values, seed, level), "method": GROUPED_SCORES_METHOD}
    return score_percentiles(_score_metric_resamples(probs, labels, resamples, seed, top_k, bins), seed, level)


def score_resamples_part(probs, labels, resamples: int, seed: int, top_k, bins: int, part: tuple) -> tuple:
    """One rank's share of :func:`bootstrap_score_intervals`' work: ``part`` = (rank, world
    size) computes every world-size-th chunk of resamples (the draws of the others are made
    and skipped, so the random stream is the same). Returns (the resample numbers, their
    values); :func:`join_score_resamples` puts the parts together, the same bits for any N.
    ``probs`` and ``labels``: as the run's merge sends them (float64 probabilities, int64 labels,
    checked on rank 0 by the report's scores), taken as they are.
    """
    return _score_metric_resamples(probs, labels, resamples, seed, top_k, bins, part)


def join_score_resamples(parts: list, resamples: int) -> dict:
    """Every resample's values from the parts of :func:`score_resamples_part`."""
    out: dict = {}
    for numbers, values in parts:
        for name, part_values in values.items():
            out.setdefault(name, np.empty(resamples))[numbers] = part_values
    return out


def score_percentiles(values: dict, seed: int, level: float = 0.95) -> dict:
    """The intervals (:func:`bootstrap_score_intervals`' dict) of every resample's values."""
    return percentile_intervals(values, seed, level, METHOD, defined=True)


def kept_score_intervals(intervals: Optional[dict], scores: dict) -> dict:
    """The score intervals a report keeps: those of the scores it has (``scores``' names), None for a
    NaN one, and the method that drew them (the grouped one names itself: see bootstrap_score_intervals).
    """
    kept = {name: None if np.isnan(value).any() else value
            for name, value in (intervals or {}).items() if name in scores}
    if intervals:
        kept["method"] = intervals["method"]
    return kept


def canonical_row_order(*columns: np.ndarray) -> np.ndarray:
    """A permutation that sorts rows by the given columns (1-D or 2-D, first column most
    significant): rows equal in every column are interchangeable, so anything computed on
    the reordered rows depends only on their multiset, not on how they arrived.
    """
    keys = []
    for column in columns:
        column = np.asarray(column)
        keys.extend([column] if column.ndim == 1 else [column[:, j] for j in range(column.shape[1])])
    return np.lexsort(keys[::-1])


def _score_metric_resamples(probs, labels, resamples: int, seed: int, top_k, bins: int, part=None):
    """Each score metric of every resample: ``{name: float64[resamples]}``; with ``part``
    (rank, world size), (the resample numbers, ``{name: values}``) of that rank's chunks.
    """
    from dist_eval import metrics as M

    order = canonical_row_order(labels, probs)
    probs, labels = probs[order], labels[order]
    n, num_labels = probs.shape
    k = M.default_top_k(num_labels) if top_k is None else top_k
    confidence = probs.max(axis=1)
    gap = confidence - (probs.argmax(axis=1) == labels)
    bin_of = M.calibration_bins(confidence, bins)
    brier = M.per_sample_brier(probs, labels)
    hits = M.top_k_hits(probs, labels, k).astype(np.float64) if k is not None else None
    auroc_classes = [1] if num_labels == 2 else range(num_labels)
    rankings = [ranking_of(probs[:, c], labels == c) for c in auroc_classes]
    out = {name: np.empty(resamples) for name in ("ece", "brier")}
    if k is not None:
        out[f"top{k}_accuracy"] = np.empty(resamples)
    out["auroc_macro"] = np.empty(resamples)
    rng = generator(seed, SCORES_STREAM)
    numbers = []
    for start, whole in resample_counts(rng, n, resamples, part or (0, 1)):
        counts = whole.astype(np.float64)
        stop = start + counts.shape[0]
        numbers.append(np.arange(start, stop))
        out["ece"][start:stop] = np.abs(M.binned_sums(counts, gap, bin_of, bins)).sum(axis=1) / n
        out["brier"][start:stop] = weighted_sums(counts, brier) / n
        if k is not None:
            out[f"top{k}_accuracy"][start:stop] = counts @ hits / n  # counts of hits: exact in any order
        per_class = np.stack([weighted_auroc(whole, ranking) for ranking in rankings], axis=1)
        out["auroc_macro"][start:stop] = macro_of_defined(per_class)
    if part is None:
        return out
    mine = np.concatenate(numbers) if numbers else np.zeros(0, dtype=np.int64)
    return mine, {name: values[mine] for name, values in out.items()}


def macro_of_defined(per_class: np.ndarray) -> np.ndarray:
    """Each resample's mean of its defined (not NaN) per-class AUROCs [r, classes]: the classes
    present in the resample; NaN when none is (fewer than two classes present).
    """
    with np.errstate(invalid="ignore"):
        defined = ~np.isnan(per_class)
        sums = np.where(defined, per_class, 0.0).sum(axis=1)
        return np.where(defined.any(axis=1), sums / defined.sum(axis=1), np.nan)


def ranking_of(scores: np.ndarray, positive: np.ndarray) -> tuple:
    """What :func:`weighted_auroc` needs of one class, made once: (the positive rows: a
    slice when they are contiguous, as in the canonical order, else their indices; the
    negative rows in score order; for each positive row, how many negative rows score
    strictly lower; and for the positive rows with tied negatives, their positions among
    the positive rows and how many negatives score lower or the same).

    Ties are runs of equal scores after a stable sort (a NaN ties with nothing), as before.
    """
    order = np.argsort(scores, kind="mergesort")
    ordered = scores[order]
    group = np.empty(order.size, dtype=np.int64)  # rank of each row's run of tied scores
    group[order] = np.cumsum(np.r_[True, ordered[1:] != ordered[:-1]]) - 1
    negatives = order[~positive[order]]
    rows = np.flatnonzero(positive)
    below = np.searchsorted(group[negatives], group[rows], side="left")
    upto = np.searchsorted(group[negatives], group[rows], side="right")
    tied = np.flatnonzero(upto != below)
    contiguous = rows.size > 0 and rows[-1] - rows[0] + 1 == rows.size
    positives = slice(int(rows[0]), int(rows[-1]) + 1) if contiguous else rows
    return positives, negatives, below, tied, upto[tied]


def weighted_auroc(counts: np.ndarray, ranking: tuple, totals: np.ndarray | None = None) -> np.ndarray:
    """AUROC of each resample (int32 row weights ``counts`` [r, n], each row summing to n, or to ``totals`` [r]:
    a cluster bootstrap's; ``ranking`` from :func:`ranking_of`): Mann-Whitney with ties as 1/2; NaN where the
    resample has no positive or no negative row.

    In integers, exactly: twice the wins = sum over positive rows of weight x (2 x negative
    weight below + negative weight tied) = weight x (negatives below + negatives up to and
    including the tie): one cumulative sum over the negatives in score order, read at each
    positive row. The float result is then the same bits however it is summed (every count
    < 2**53).
    """
    positives, negatives, below, tied, tied_upto = ranking
    r, n = counts.shape
    negative_upto = np.zeros((r, negatives.size + 1), dtype=np.int32)  # [:, j]: the first j negatives' weight
    np.cumsum(np.take(counts, negatives, axis=1), axis=1, dtype=np.int32, out=negative_upto[:, 1:])
    pos = counts[:, positives] if isinstance(positives, slice) else np.take(counts, positives, axis=1)
    twice_wins = 2 * np.einsum("ij,ij->i", pos, np.take(negative_upto, below, axis=1), dtype=np.int64)
    if tied.size:  # + the negatives tied with each positive row, once
        tied_negatives = np.take(negative_upto, tied_upto, axis=1) - np.take(negative_upto, below[tied], axis=1)
        twice_wins += np.einsum("ij,ij->i", np.take(pos, tied, axis=1), tied_negatives, dtype=np.int64)
    positive_weight = pos.sum(axis=1, dtype=np.int64)
    pairs = positive_weight * ((n if totals is None else totals) - positive_weight)
    wins = twice_wins.astype(np.float64) / 2
    return np.divide(wins, pairs.astype(np.float64), out=np.full(wins.shape, np.nan), where=pairs > 0)


# --- the score intervals of a big set: grouped draws (issue 29) -------------------------
# An exact resample costs a draw per row: resamples x rows, most of a big set's merge
# (benchmarks/RESULTS.md). Above EXACT_SCORE_ROWS rows, when every AUROC class has
# MIN_AUROC_SIDE rows on each side, each score metric is drawn from sums of grouped values,
# as the loss is above LOSS_GROUPS samples: at a cost of resamples x SCORE_GROUPS, whatever
# the rows (but for their sort).

GROUPED_SCORES_METHOD = "bootstrap-percentile; score metrics grouped, AUROC linearized"
EXACT_SCORE_ROWS = 1 << 16
SCORE_GROUPS = 1024
MIN_AUROC_SIDE = 1000


def grouped_score_intervals(probs: np.ndarray, labels: np.ndarray) -> bool:
    """Whether :func:`bootstrap_score_intervals` draws the rows grouped: more than
    EXACT_SCORE_ROWS rows, finite probabilities, and every class whose AUROC is averaged
    present with at least MIN_AUROC_SIDE rows on each side (or absent: left out anyway).
    """
    n, num_labels = probs.shape
    if n <= EXACT_SCORE_ROWS or not np.isfinite(probs).all():
        return False
    positives = np.bincount(labels, minlength=num_labels)
    if num_labels == 2:
        positives = positives[1:]
    sides = np.minimum(positives, n - positives)
    return bool(np.all((positives == 0) | (sides >= MIN_AUROC_SIDE)))


def exact_score_cost(probs: np.ndarray, labels: np.ndarray, resamples: int) -> dict | None:
    """What an exact score bootstrap of a set above EXACT_SCORE_ROWS rows costs, for the report
    (issue 51: the one computation of the merge whose memory grows with the rows on every rank):
    None where :func:`grouped_score_intervals` holds, or the set is small, or nothing is resampled.
    ``bytes_per_rank``: about ``rows x (32 x classes + 68)`` (the probabilities each rank receives
    and unpickles, their canonical order, the per-row values and each class's ranking, a resample's
    draws), ``row_draws``: resamples x rows, the work it shares over the ranks.
    """
    n, num_labels = probs.shape
    if not resamples or n <= EXACT_SCORE_ROWS or grouped_score_intervals(probs, labels):
        return None
    if not np.isfinite(probs).all():
        why = "a probability is not finite"
    else:
        positives = np.bincount(labels, minlength=num_labels)
        sides = np.minimum(positives, n - positives)
        rare = [int(c) for c in np.flatnonzero((positives > 0) & (sides < MIN_AUROC_SIDE))
                if num_labels > 2 or c == 1]
        why = (f"class {rare[0]} has {int(sides[rare[0]])} rows on one side of its AUROC, fewer than "
               f"{MIN_AUROC_SIDE}")
    return {"rows": int(n), "why": why, "bytes_per_rank": int(n * (32 * num_labels + 68)),
            "row_draws": int(resamples) * int(n)}


def _grouped_score_resamples(probs, labels, resamples: int, seed: int, top_k, bins: int, groups: int = SCORE_GROUPS):
    """Each score metric of ``resamples`` bootstrap resamples, drawn grouped:
    ``{name: float64[resamples]}`` (the keys of :func:`_score_metric_resamples`).

    - ``top{k}_accuracy``: the hits of a resample are Binomial(n, hits / n): exact.
    - ``brier``: the mean of the per-row values, drawn as the loss is (equal-count groups of
      the sorted values, Multinomial draws per group, a normal term for the spread inside).
    - ``ece``: the same per calibration bin (groups never straddle a bin); each resample's
      ECE is the sum of the bins' absolute drawn gap sums over n, as the point ECE.
    - ``auroc_macro``: linearized. A resample's macro AUROC is taken as the set's plus the
      weighted mean of each row's influence on it (the Mann-Whitney placements, DeLong's
      components, with the change of the class sizes), drawn as ``brier``. Its neglected
      term is of the order of 1/sqrt of the smaller side of a class, which the guard of
      :func:`grouped_score_intervals` keeps small.

    Depends only on the multiset of rows (every grouping is of sorted values).
    """
    from dist_eval import metrics as M

    n, num_labels = probs.shape
    k = M.default_top_k(num_labels) if top_k is None else top_k
    rng = generator(seed, SCORES_STREAM)
    confidence = probs.max(axis=1)
    gap = confidence - (probs.argmax(axis=1) == labels)
    bin_of = M.calibration_bins(confidence, bins)
    by_bin = np.lexsort((gap, bin_of))
    bin_starts = np.searchsorted(bin_of[by_bin], np.arange(bins))
    out = {"ece": np.abs(_grouped_sums(rng, gap[by_bin], bin_starts, resamples, groups)).sum(axis=1) / n}
    brier = np.sort(M.per_sample_brier(probs, labels))
    out["brier"] = _grouped_sums(rng, brier, np.zeros(1, dtype=np.int64), resamples, groups)[:, 0] / n
    if k is not None:
        hits = int(M.top_k_hits(probs, labels, k).sum())
        out[f"top{k}_accuracy"] = rng.binomial(n, hits / n, size=resamples) / n
    auroc, influence = auroc_influence(probs, labels)
    if influence is None:  # fewer than two classes: undefined in every resample
        out["auroc_macro"] = np.full(resamples, np.nan)
    else:
        drawn = _grouped_sums(rng, np.sort(influence), np.zeros(1, dtype=np.int64), resamples, groups)[:, 0]
        out["auroc_macro"] = auroc + drawn / n
    return out


def auroc_influence(probs: np.ndarray, labels: np.ndarray) -> tuple:
    """(the macro AUROC of :func:`dist_eval.metrics.auroc_macro`, each row's influence on it)
    or (NaN, None) when it is undefined. The influence of row i is n x the derivative of the
    AUROC in row i's weight: for a positive row of class c, n (V_i - A_c) / P_c, for a
    negative one n (V_i - A_c) / N_c, averaged over the classes (V_i: the share of the other
    side it beats, ties 1/2). The influences sum to 0; a resample with weights w then has
    the AUROC A + sum_i (w_i - 1) influence_i / n to first order. Counts are exact integers.
    """
    n, num_labels = probs.shape
    classes = [1] if num_labels == 2 else np.flatnonzero(np.bincount(labels, minlength=num_labels))
    aurocs, influence = [], np.zeros(n)
    for c in classes:
        positive = labels == c
        num_pos = int(positive.sum())
        num_neg = n - num_pos
        if num_pos == 0 or num_neg == 0:
            continue
        twice_pos, twice_neg = _twice_wins(probs[:, c], positive)
        auroc = int(twice_pos.sum(dtype=np.int64)) / (2 * num_pos * num_neg)
        influence[positive] += n * (twice_pos / (2 * num_neg) - auroc) / num_pos
        influence[~positive] += n * (twice_neg / (2 * num_pos) - auroc) / num_neg
        aurocs.append(auroc)
    if not aurocs:  # a class present alone has no negatives: so none is defined
        return float("nan"), None
    return float(np.mean(aurocs)), influence / len(aurocs)


def _twice_wins(scores: np.ndarray, positive: np.ndarray) -> tuple:
    """Twice the wins of each positive row (2 x the negatives scoring lower + those tied)
    and of each negative row (2 x the positives scoring higher + those tied), in row order:
    one sort, then counts per run of equal scores.
    """
    order = np.argsort(scores, kind="stable")
    ordered, is_pos = scores[order], positive[order]
    run_starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    run_of = np.repeat(np.arange(run_starts.size), np.diff(np.r_[run_starts, scores.size]))
    pos_before = np.r_[0, np.cumsum(is_pos)][run_starts]  # positives in the runs below each run
    pos_in = np.add.reduceat(is_pos.astype(np.int64), run_starts)
    neg_before, neg_in = run_starts - pos_before, np.diff(np.r_[run_starts, scores.size]) - pos_in
    twice = np.where(is_pos, 2 * neg_before[run_of] + neg_in[run_of],
                     2 * (int(is_pos.sum()) - pos_before[run_of] - pos_in[run_of]) + pos_in[run_of])
    in_rows = np.empty_like(twice)
    in_rows[order] = twice
    return in_rows[positive], in_rows[~positive]

