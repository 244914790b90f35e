"""Paired comparison: McNemar's exact test is scipy's binomtest, equal to the exact binomial tail
(rationals) over a grid of counts, and to hand counts; the paired bootstrap against explicitly drawn resamples
scored by scikit-learn, invariant to row order, seeded."""
import math
from fractions import Fraction

import numpy as np
import pytest
from scipy.stats import binomtest
from sklearn import metrics as skm

from dist_eval.intervals import canonical_row_order
from dist_eval.paired import PAIRED_STREAM, binomial_two_sided_pvalue, mcnemar_exact, paired_bootstrap

GRID = range(31)  # every b, c up to 30 (n up to 60); larger counts: test_pvalue_for_large_counts


def exact_two_sided(b, c):
    """min(1, 2 P[X <= min(b, c)]) for X ~ Binomial(b + c, 1/2), in exact rationals."""
    n, m = b + c, min(b, c)
    if n == 0 or b == c:
        return Fraction(1)
    return min(Fraction(1), Fraction(2 * sum(math.comb(n, i) for i in range(m + 1)), 2**n))


def test_pvalue_is_scipy_binomtest_and_the_exact_tail_over_a_grid():
    for b in GRID:
        for c in GRID:
            ours = binomial_two_sided_pvalue(b, c)
            assert ours == (binomtest(b, b + c, 0.5).pvalue if b + c else 1.0), (b, c)
            assert ours == pytest.approx(float(exact_two_sided(b, c)), rel=1e-12, abs=0), (b, c)


@pytest.mark.parametrize("b,c", [(100, 130), (4000, 4300), (50000, 51000), (0, 200)])
def test_pvalue_for_large_counts(b, c):
    assert binomial_two_sided_pvalue(b, c) == binomtest(b, b + c, 0.5).pvalue
    if b + c <= 1000:  # the exact rationals of larger counts cost seconds
        assert binomial_two_sided_pvalue(b, c) == pytest.approx(float(exact_two_sided(b, c)), rel=1e-9, abs=0)


def test_pvalue_by_hand():
    # b=1, c=5: 2 * (C(6,0) + C(6,1)) / 2^6 = 14/64
    assert binomial_two_sided_pvalue(1, 5) == pytest.approx(14 / 64, rel=1e-15)
    by_hand = 2 * sum(math.comb(11, i) for i in range(3)) / 2**11
    assert binomial_two_sided_pvalue(2, 9) == pytest.approx(by_hand, rel=1e-14)
    with pytest.raises(ValueError):
        binomial_two_sided_pvalue(-1, 3)


def test_mcnemar_counts_and_statsmodels():
    rng = np.random.default_rng(0)
    a = rng.random(500) < 0.7
    b = np.where(rng.random(500) < 0.2, ~a, a)
    result = mcnemar_exact(a, b)
    assert result["a_only"] == int((a & ~b).sum()) and result["b_only"] == int((~a & b).sum())
    assert result["discordant"] == result["a_only"] + result["b_only"]
    ref = binomtest(result["a_only"], result["discordant"], 0.5).pvalue
    assert result["pvalue"] == pytest.approx(ref, rel=1e-12)
    assert mcnemar_exact(a, a)["pvalue"] == 1.0


def synthetic_pair(n, k, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, k, n)
    preds_a = np.where(rng.random(n) < 0.6, labels, rng.integers(0, k, n))
    preds_b = np.where(rng.random(n) < 0.3, labels, preds_a)  # B fixes some of A's errors
    losses_a = rng.lognormal(-0.5, 1.0, n)
    losses_b = losses_a * rng.uniform(0.6, 1.1, n)
    return labels, preds_a, preds_b, losses_a, losses_b


@pytest.mark.parametrize("n,k", [(80, 3), (40, 5), (60, 2)])
def test_paired_bootstrap_equals_explicit_resamples_scored_by_sklearn(n, k):
    labels, pa, pb, la, lb = synthetic_pair(n, k, seed=n)
    resamples, seed = 150, 3
    ours = paired_bootstrap(labels, pa, pb, la, lb, k, resamples=resamples, seed=seed)
    order = canonical_row_order(labels, pa, pb, la, lb)
    labels, pa, pb, la, lb = labels[order], pa[order], pb[order], la[order], lb[order]
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(PAIRED_STREAM,))))
    rows = rng.integers(0, n, size=(resamples, n))
    kw = {"labels": list(range(k)), "average": "macro", "zero_division": 0}
    draws = {
        "accuracy": [skm.accuracy_score(labels[r], pb[r]) - skm.accuracy_score(labels[r], pa[r]) for r in rows],
        "f1_macro": [skm.f1_score(labels[r], pb[r], **kw) - skm.f1_score(labels[r], pa[r], **kw) for r in rows],
        "loss": [np.mean(lb[r]) - np.mean(la[r]) for r in rows],
    }
    point = {
        "accuracy": skm.accuracy_score(labels, pb) - skm.accuracy_score(labels, pa),
        "f1_macro": skm.f1_score(labels, pb, **kw) - skm.f1_score(labels, pa, **kw),
        "loss": np.mean(lb) - np.mean(la),
    }
    for name, values in draws.items():
        assert ours[name]["difference"] == pytest.approx(point[name], abs=1e-12)
        np.testing.assert_allclose(ours[name]["interval"], np.percentile(values, [2.5, 97.5]), rtol=1e-10, atol=1e-12)


def test_paired_bootstrap_order_seed_and_edge_cases():
    labels, pa, pb, la, lb = synthetic_pair(400, 4, seed=1)
    order = np.random.default_rng(5).permutation(400)
    first = paired_bootstrap(labels, pa, pb, la, lb, 4, resamples=300, seed=7)
    shuffled = (labels[order], pa[order], pb[order], la[order], lb[order])
    assert first == paired_bootstrap(*shuffled, 4, resamples=300, seed=7)
    assert paired_bootstrap(labels, pa, pb, la, lb, 4, resamples=300, seed=8)["accuracy"] != first["accuracy"]
    for name in ("accuracy", "f1_macro", "loss"):
        lo, hi = first[name]["interval"]
        assert lo <= first[name]["difference"] <= hi
    assert first["accuracy"]["interval"][0] > 0 and first["loss"]["interval"][1] < 0  # B clearly better here
    same = paired_bootstrap(labels, pa, pa, la, la, 4, resamples=50)
    assert all(same[name] == {"difference": 0.0, "interval": [0.0, 0.0]} for name in ("accuracy", "f1_macro", "loss"))
    assert paired_bootstrap(labels, pa, pb, la, lb, 4, resamples=0)["accuracy"]["interval"] is None
    assert paired_bootstrap(labels[:0], pa[:0], pb[:0], la[:0], lb[:0], 4) is None
    with pytest.raises(ValueError):
        paired_bootstrap(labels, pa, pb[:-1], la, lb, 4)
