"""Bootstrap intervals of the probability scores: each resample recomputed by the point
functions (themselves checked against scikit-learn) on explicitly drawn rows, the same
for any row order (so any world size) and seed, and bootstrap_intervals untouched."""
import numpy as np
import pytest

from dist_eval.intervals import (
    EXACT_SCORE_ROWS,
    SCORES_STREAM,
    _score_metric_resamples,
    bootstrap_intervals,
    bootstrap_score_intervals,
    canonical_row_order,
)
from dist_eval.metrics import score_metrics, softmax


def synthetic(n, k, seed, coarse=False, separation=1.5, shares=None):
    """Probabilities and labels; ``shares``: each class's share of the rows (None: uniform)."""
    rng = np.random.default_rng(seed)
    labels = rng.choice(k, n, p=shares) if shares else rng.integers(0, k, n)
    logits = rng.normal(size=(n, k))
    logits[np.arange(n), labels] += separation
    probs = softmax(logits)
    if coarse:  # tied scores within and across rows
        weights = np.round(probs * 4) + 1.0
        probs = weights / weights.sum(axis=1, keepdims=True)
    return probs, labels


def explicit_resamples(probs, labels, resamples, seed, top_k=None):
    """Draw the row indices as documented and score each resample with score_metrics."""
    order = canonical_row_order(labels, probs)
    probs, labels = probs[order], labels[order]
    n = len(labels)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(SCORES_STREAM,))))
    rows = rng.integers(0, n, size=(resamples, n))  # one chunk: resamples x n is small here
    per_resample = [score_metrics(probs[r], labels[r], top_k=top_k) for r in rows]
    return {name: np.array([m[name] for m in per_resample]) for name in per_resample[0]}


@pytest.mark.parametrize("n,k,coarse,top_k", [(60, 4, False, None), (40, 3, True, 2), (50, 2, True, None),
                                              (30, 5, False, 3), (8, 3, True, None)])
def test_each_resample_equals_the_point_functions_on_its_rows(n, k, coarse, top_k):
    probs, labels = synthetic(n, k, seed=n + k, coarse=coarse)
    ours = _score_metric_resamples(probs, labels, 200, 5, top_k, 15)
    ref = explicit_resamples(probs, labels, 200, 5, top_k)
    assert set(ours) == set(ref)
    for name in ref:
        np.testing.assert_allclose(ours[name], ref[name], rtol=1e-12, atol=1e-14, equal_nan=True, err_msg=name)


@pytest.mark.parametrize("n,k", [(300, 4), (120, 2)])
def test_score_intervals_do_not_depend_on_the_order_of_the_rows_and_follow_the_seed(n, k):
    probs, labels = synthetic(n, k, seed=1, coarse=True)
    order = np.random.default_rng(2).permutation(n)
    first = bootstrap_score_intervals(probs, labels, resamples=300, seed=7)
    assert first == bootstrap_score_intervals(probs[order], labels[order], resamples=300, seed=7)
    other = bootstrap_score_intervals(probs, labels, resamples=300, seed=8)
    assert other["ece"] != first["ece"] and other["auroc_macro"] != first["auroc_macro"]
    assert first["method"] == "bootstrap-percentile" and first["resamples"] == 300 and first["seed"] == 7
    point = score_metrics(probs, labels)
    assert set(first) - {"method", "resamples", "seed", "level"} == set(point)
    for name, value in point.items():
        lo, hi = first[name]
        assert lo <= value <= hi, (name, lo, value, hi)


def test_score_intervals_edge_cases():
    probs, labels = synthetic(100, 3, seed=3)
    assert bootstrap_score_intervals(probs, labels, resamples=0) is None
    assert bootstrap_score_intervals(probs[:0], labels[:0]) is None
    with pytest.raises(ValueError):
        bootstrap_score_intervals(probs, labels, resamples=-1)
    one = bootstrap_score_intervals(probs[:1], labels[:1], resamples=50)  # one row: AUROC undefined
    assert np.isnan(one["auroc_macro"]).all() and one["brier"][0] == one["brier"][1]
    assert "top2_accuracy" in one and "top2_accuracy" not in bootstrap_score_intervals(*synthetic(20, 2, 0), 10)


# metrics.weighted_sums (each resample's sum of non-integer values in numpy's own order, the same
# bits for any number of BLAS threads) moved the last bits of those sums (up to 23 ulps of the pins
# here, sums of up to 3,001 rows): within 1e-12 relative, far below what another method moves. The
# rest (counts of hits, the AUROC's integer arithmetic, accuracy, F1) are the pinned bits.
RESUMMED = ("ece", "brier", "loss")
RESUMMED_RTOL = 1e-12


def assert_as_pinned(ci: dict, pinned: dict) -> None:
    got = {name: value for name, value in ci.items() if isinstance(value, list)}
    assert got.keys() == {name for name, value in pinned.items() if isinstance(value, list)}
    for name in got:
        if name in RESUMMED:
            np.testing.assert_allclose(got[name], pinned[name], rtol=RESUMMED_RTOL, atol=0)
        else:
            assert got[name] == pinned[name], name


def test_existing_intervals_are_unchanged():
    """bootstrap_intervals is not touched: its numbers at a fixed seed, recorded on the
    commit before the score intervals were added."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, 500)
    preds = np.where(rng.random(500) < 0.75, labels, rng.integers(0, 4, 500))
    losses = rng.lognormal(-1.0, 1.0, 500)
    ci = bootstrap_intervals(labels, preds, losses, 4, resamples=300, seed=7)
    assert {name: value for name, value in ci.items() if not isinstance(value, list)} == \
        {name: value for name, value in RECORDED.items() if not isinstance(value, list)}
    assert_as_pinned(ci, RECORDED)


RECORDED = {
    'method': 'bootstrap-percentile', 'resamples': 300, 'seed': 7, 'level': 0.95, 'accuracy': [0.796, 0.85905],
    'f1_macro': [0.7933861317844021, 0.8570595748986883], 'loss': [0.5724867919799044, 0.7021886757005841],
}


RECORDED_SCORES = {
    (400, 3, 1, False): {
        'ece': [0.07377155571371265, 0.14433303881378456], 'brier': [0.30173239944841895, 0.3720464832941516],
        'top2_accuracy': [0.9086875, 0.9563124999999999], 'auroc_macro': [0.8929042916391734, 0.935890100041755]},
    (300, 4, 2, True): {
        'ece': [0.22009474206349208, 0.30504844576719575], 'brier': [0.5103636975623582, 0.5626108571900983],
        'top2_accuracy': [0.7966666666666666, 0.8766666666666667],
        'auroc_macro': [0.8438759579503451, 0.8999518335000332]},
    (200, 2, 3, True): {
        'ece': [0.11622916666666668, 0.2063124999999999], 'brier': [0.2242986111111111, 0.29724999999999996],
        'auroc_macro': [0.8789460923191392, 0.9553439630375775]},
}


@pytest.mark.parametrize("case", sorted(RECORDED_SCORES))
def test_score_intervals_are_those_recorded_before_the_faster_auroc(case):
    """Issue 29 made the resampled AUROC exact integer arithmetic (faster): the intervals at a
    fixed seed are bit for bit those recorded on the commit before it (f8583d7)."""
    n, k, seed, coarse = case
    probs, labels = synthetic(n, k, seed, coarse=coarse)
    ci = bootstrap_score_intervals(probs, labels, resamples=300, seed=7)
    assert_as_pinned(ci, RECORDED_SCORES[case])



@pytest.mark.parametrize("world,n,resamples", [(1, 900, 1200), (2, 900, 1200), (3, 900, 1200), (4, 900, 1200),
                                               (3, 300_001, 5)])
def test_the_resamples_shared_over_ranks_are_those_of_one_process(world, n, resamples):
    """Issue 29: each rank computes every N-th chunk of resamples; joined, the same bits as
    one process (900 rows: 3 chunks of 582 resamples at most; 300,001 rows: one resample a
    chunk), so the intervals do not depend on N."""
    from dist_eval.intervals import join_score_resamples, score_percentiles, score_resamples_part
    from dist_eval.resampling import resample_chunks as _chunks

    probs, labels = synthetic(n, 3, seed=4, coarse=True)
    whole = _score_metric_resamples(probs, labels, resamples, 7, None, 15)
    parts = [score_resamples_part(probs, labels, resamples, 7, None, 15, (rank, world)) for rank in range(world)]
    chunks = len(list(_chunks(resamples, n)))
    assert sum(len(numbers) > 0 for numbers, _ in parts) == min(world, chunks)  # the work is shared
    joined = join_score_resamples(parts, resamples)
    assert set(joined) == set(whole)
    for name in whole:
        assert joined[name].tobytes() == whole[name].tobytes(), name
    if n <= EXACT_SCORE_ROWS:  # above, bootstrap_score_intervals draws grouped (tested below)
        assert score_percentiles(joined, 7) == bootstrap_score_intervals(probs, labels, resamples, 7)


# Issue 29, the faster score intervals: the same bits as before. Made at dc17d6c (before the
# AUROC read one cumulative sum per class and the draws came as int32) with
#   probs, labels = synthetic(n, k, seed, coarse)
#   bootstrap_score_intervals(probs, labels, resamples=resamples, seed=29, top_k=top_k)
# keyed (n, k, seed, coarse, top_k, resamples): 2 to 4 chunks of resamples each (3 with n=777).
PINNED_BEFORE_FASTER_AUROC = {
    (2500, 4, 11, False, None, 700): {
        'ece': [0.09082156992001876, 0.12305827570941313],
        'brier': [0.41447894748919195, 0.44160810234875447],
        'top2_accuracy': [0.8836, 0.90781],
        'auroc_macro': [0.8947209323386982, 0.9106476737228544],
    },
    (1999, 3, 12, True, 2, 600): {
        'ece': [0.20681441911431905, 0.24351379558827035],
        'brier': [0.40420646476866556, 0.4252426649123881],
        'top2_accuracy': [0.9239619809904952, 0.9454727363681841],
        'auroc_macro': [0.8961843577491893, 0.9162112309026653],
    },
    (1500, 2, 13, True, None, 500): {
        'ece': [0.13104722222222223, 0.16040277777777773],
        'brier': [0.25007037037037055, 0.27414814814814853],
        'auroc_macro': [0.9082810492545237, 0.9327271229090051],
    },
    (3001, 5, 14, True, 3, 400): {
        'ece': [0.2521469364709119, 0.2855705824128851],
        'brier': [0.5919015840245017, 0.606471403194766],
        'top3_accuracy': [0.9043652115961346, 0.9240253248917027],
        'auroc_macro': [0.8665052807074578, 0.8834779917511418],
    },
    (777, 6, 15, False, None, 2100): {
        'ece': [0.08943551505710548, 0.14993405811588947],
        'brier': [0.5163162001018836, 0.5662930803038538],
        'top2_accuracy': [0.7824967824967825, 0.8378378378378378],
        'auroc_macro': [0.8749898648209805, 0.9030832577595004],
    },
}


@pytest.mark.parametrize("case", sorted(PINNED_BEFORE_FASTER_AUROC))
def test_score_intervals_are_those_pinned_before_the_faster_resamples(case):
    n, k, seed, coarse, top_k, resamples = case
    probs, labels = synthetic(n, k, seed, coarse=coarse)
    ci = bootstrap_score_intervals(probs, labels, resamples=resamples, seed=29, top_k=top_k)
    assert_as_pinned(ci, PINNED_BEFORE_FASTER_AUROC[case])


def reference_weighted_auroc(counts, scores, positive):
    """The resampled AUROC as computed before (dc17d6c): the rows' weights in score order,
    one group per run of tied scores, the negatives' cumulative sum over all rows."""
    order = np.argsort(scores, kind="mergesort")
    ordered = scores[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    weights = counts[:, order]
    pos = weights * positive[order][None, :]
    if starts.size < order.size:
        pos = np.add.reduceat(pos, starts, axis=1)
        weights = np.add.reduceat(weights, starts, axis=1)
    neg = weights - pos
    upto = np.cumsum(neg, axis=1, dtype=np.int64)
    twice_wins = (pos * (2 * upto - neg)).sum(axis=1, dtype=np.int64)
    pairs = pos.sum(axis=1, dtype=np.int64) * neg.sum(axis=1, dtype=np.int64)
    wins = twice_wins.astype(np.float64) / 2
    return np.divide(wins, pairs.astype(np.float64), out=np.full(wins.shape, np.nan), where=pairs > 0)


@pytest.mark.parametrize("n,levels,share,contiguous", [(500, None, 0.3, True), (400, 5, 0.5, False),
                                                       (300, 2, 0.1, True), (50, 3, 0.0, True),
                                                       (50, 3, 1.0, False), (1, None, 1.0, True),
                                                       (200, 4, 0.4, False)])
def test_weighted_auroc_is_bit_for_bit_the_former_one(n, levels, share, contiguous):
    """The one-cumulative-sum AUROC against the former computation: distinct and tied
    scores, NaN scores, positives in one block (the canonical order) or scattered, no
    positive or no negative row, and resamples where one side draws nothing."""
    from dist_eval.intervals import ranking_of, weighted_auroc

    rng = np.random.default_rng(n + int(10 * share))
    scores = rng.random(n) if levels is None else rng.integers(0, levels, n) / levels
    if n >= 200:
        scores[rng.integers(0, n, 5)] = np.nan
    positive = rng.random(n) < share
    if contiguous:
        positive = np.sort(positive)[::-1].copy()
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=40).astype(np.int32)
    counts[0] = 0
    counts[0, 0] = n  # one row drawn n times
    got = weighted_auroc(counts, ranking_of(scores, positive))
    want = reference_weighted_auroc(counts, scores, positive)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("n,resamples", [(1, 3), (999, 1200), (300_001, 3)])
def test_resample_counts_are_those_of_the_documented_int64_draws(n, resamples):
    """The draws come as int32 (faster); the counts and the stream after them are those of
    rng.integers(0, n, size=(r, n)) per chunk, as documented (n > 2**18: one resample a chunk)."""
    from dist_eval.resampling import resample_chunks as _chunks
    from dist_eval.resampling import resample_counts as _integer_resample_counts

    ours = np.random.Generator(np.random.PCG64(3))
    ref = np.random.Generator(np.random.PCG64(3))
    got = list(_integer_resample_counts(ours, n, resamples))
    chunks = list(_chunks(resamples, n))
    assert [start for start, _ in got] == [start for start, _ in chunks]
    for (_, counts), (_, r) in zip(got, chunks):
        rows = ref.integers(0, n, size=(r, n))
        want = np.stack([np.bincount(row, minlength=n) for row in rows])
        assert counts.dtype == np.int32 and np.array_equal(counts, want)
    assert ours.integers(0, 2**62) == ref.integers(0, 2**62)


# Issue 29: above EXACT_SCORE_ROWS rows the score intervals are drawn grouped (the AUROC
# linearized). Checked here against the exact bootstrap on sets of 10,000 rows cut into 64
# groups (156 rows a group: coarser than SCORE_GROUPS makes them on any set the grouping is
# used for, 64 rows a group at least): each interval's width and centre, with 2000 resamples
# each. Two exact runs of different seeds differ by up to about 5% of the width on these sets,
# and the grouped ones from the exact ones as much (as on sets of 20,000 rows, at twice the time).
GROUPED_CASES = [  # (k, seed, coarse, separation, class shares)
    (4, 1, False, 1.5, None),
    (3, 2, True, 1.5, None),  # tied scores
    (4, 3, False, 3.0, [0.7, 0.2, 0.07, 0.03]),  # AUROC near 1, a class of 3%
    (2, 4, False, 0.3, None),  # AUROC near 1/2
    (5, 5, False, 0.2, None),  # well calibrated: ECE near 0
]


@pytest.mark.parametrize("case", GROUPED_CASES)
def test_grouped_score_intervals_agree_with_the_exact_bootstrap(case):
    from dist_eval.intervals import _grouped_score_resamples, score_percentiles

    probs, labels = synthetic(10_000, *case)
    exact = score_percentiles(_score_metric_resamples(probs, labels, 2000, 3, None, 15), 3)
    grouped = score_percentiles(_grouped_score_resamples(probs, labels, 2000, 3, None, 15, groups=64), 3)
    assert set(grouped) == set(exact)
    for name in ("ece", "brier", f"top{2 if case[0] > 2 else 0}_accuracy", "auroc_macro"):
        if name not in exact:
            continue
        lo, hi = exact[name]
        width = hi - lo
        g_lo, g_hi = grouped[name]
        assert abs((g_hi - g_lo) / width - 1) <= 0.08, name
        assert abs((g_lo + g_hi) / 2 - (lo + hi) / 2) <= 0.08 * width, name


def test_the_influences_are_the_derivatives_of_the_auroc():
    """auroc_influence: the macro AUROC of metrics.auroc_macro, influences summing to 0, and
    moving one row's weight onto another changes the resampled AUROC by the difference of
    their influences / n, up to a second-order term (the class sizes change too)."""
    from dist_eval.intervals import auroc_influence, ranking_of, weighted_auroc

    for k, coarse in ((4, False), (3, True), (2, True), (2, False)):
        probs, labels = synthetic(3000, k, seed=k, coarse=coarse)
        auroc, influence = auroc_influence(probs, labels)
        assert auroc == pytest.approx(score_metrics(probs, labels)["auroc_macro"], abs=1e-12)
        assert abs(influence.sum()) < 1e-9 * len(labels)
        classes = [1] if k == 2 else range(k)
        rankings = [ranking_of(probs[:, c], labels == c) for c in classes]
        rng = np.random.default_rng(k)
        for doubled, dropped in rng.integers(0, len(labels), size=(20, 2)):
            counts = np.ones((1, len(labels)), dtype=np.int32)
            counts[0, doubled] += 1
            counts[0, dropped] -= 1
            moved = np.mean([weighted_auroc(counts, ranking)[0] for ranking in rankings])
            linear = auroc + (influence[doubled] - influence[dropped]) / len(labels)
            assert moved == pytest.approx(linear, abs=30 / len(labels) ** 2)
    one_class = np.zeros(50, dtype=np.int64)
    assert np.isnan(auroc_influence(synthetic(50, 3, 0)[0], one_class)[0])


def test_the_grouped_draws_are_used_above_the_exact_rows_for_every_order_and_not_for_a_rare_class():
    from dist_eval.intervals import (
        GROUPED_SCORES_METHOD,
        METHOD,
        MIN_AUROC_SIDE,
        _grouped_score_resamples,
        grouped_score_intervals,
        score_percentiles,
    )

    n = EXACT_SCORE_ROWS + 1
    probs, labels = synthetic(n, 3, seed=6)
    assert grouped_score_intervals(probs, labels)
    assert not grouped_score_intervals(probs[:-1], labels[:-1])  # EXACT_SCORE_ROWS rows: exact
    ci = bootstrap_score_intervals(probs, labels, resamples=300, seed=7)
    assert ci["method"] == GROUPED_SCORES_METHOD and ci["resamples"] == 300 and ci["seed"] == 7
    assert ci == {**score_percentiles(_grouped_score_resamples(probs, labels, 300, 7, None, 15), 7),
                  "method": GROUPED_SCORES_METHOD}
    order = np.random.default_rng(8).permutation(n)
    assert ci == bootstrap_score_intervals(probs[order], labels[order], resamples=300, seed=7)
    point = score_metrics(probs, labels)
    for name in point:
        assert ci[name][0] <= point[name] <= ci[name][1], name
    rare = labels.copy()
    rare[rare == 2] = 0
    rare[:MIN_AUROC_SIDE - 1] = 2  # a class with fewer rows than the linearized AUROC asks
    assert not grouped_score_intervals(probs, rare)
    assert bootstrap_score_intervals(probs, rare, resamples=3, seed=7)["method"] == METHOD
    rare[:MIN_AUROC_SIDE] = 2
    assert grouped_score_intervals(probs, rare)
    with_nan = probs.copy()
    with_nan[5] = np.nan
    assert not grouped_score_intervals(with_nan, labels)
