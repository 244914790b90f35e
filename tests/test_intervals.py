"""Bootstrap confidence intervals as a pure function (dist_eval.intervals): seeded,
order-independent, containing the estimate, equal to a plain index bootstrap, fast."""

import numpy as np
import pytest

from dist_eval.intervals import LOSS_GROUPS, bootstrap_intervals
from dist_eval.metrics import confusion_matrix, metrics_from_confusion


def synthetic(n, k=4, seed=0, accuracy=0.75):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, k, n)
    preds = np.where(rng.random(n) < accuracy, labels, rng.integers(0, k, n))
    losses = rng.lognormal(-1.0, 1.0, n)
    return labels, preds, losses


def point_estimates(labels, preds, losses, k):
    m = metrics_from_confusion(confusion_matrix(labels, preds, k))
    return {"accuracy": m["accuracy"], "f1_macro": m["f1_macro"], "loss": float(np.mean(losses))}


def test_intervals_reproducible_with_the_seed():
    labels, preds, losses = synthetic(500)
    first = bootstrap_intervals(labels, preds, losses, 4, resamples=300, seed=7)
    assert first == bootstrap_intervals(labels, preds, losses, 4, resamples=300, seed=7)
    other = bootstrap_intervals(labels, preds, losses, 4, resamples=300, seed=8)
    assert other["accuracy"] != first["accuracy"] and other["loss"] != first["loss"]
    assert first["method"] == "bootstrap-percentile" and first["resamples"] == 300 and first["seed"] == 7
    assert first["level"] == 0.95


@pytest.mark.parametrize("n", [50, LOSS_GROUPS + 1000])  # exact path, and grouped losses
def test_intervals_do_not_depend_on_the_order_of_the_rows(n):
    labels, preds, losses = synthetic(n, seed=1)
    order = np.random.default_rng(2).permutation(n)
    assert bootstrap_intervals(labels, preds, losses, 4) == bootstrap_intervals(
        labels[order], preds[order], losses[order], 4
    )


@pytest.mark.parametrize("n,seed", [(30, 0), (200, 1), (3000, 2), (20000, 3)])
def test_intervals_contain_the_point_estimate(n, seed):
    labels, preds, losses = synthetic(n, seed=seed)
    ci = bootstrap_intervals(labels, preds, losses, 4, seed=seed)
    for name, value in point_estimates(labels, preds, losses, 4).items():
        lo, hi = ci[name]
        assert lo < value < hi, (name, lo, value, hi)


@pytest.mark.parametrize("n", [150, 2 * LOSS_GROUPS])  # exact path, and grouped losses
def test_intervals_agree_with_a_plain_index_bootstrap(n):
    """Against the textbook bootstrap (resample row indices, recompute), up to Monte Carlo
    noise: the tolerance is about 3 standard errors of the two percentile estimates."""
    labels, preds, losses = synthetic(n, k=3, seed=4, accuracy=0.6)
    resamples = 2000 if n < 1000 else 1000
    rng = np.random.default_rng(123)
    values = {"accuracy": [], "f1_macro": [], "loss": []}
    for _ in range(resamples):
        pick = rng.integers(0, n, n)
        for name, value in point_estimates(labels[pick], preds[pick], losses[pick], 3).items():
            values[name].append(value)
    ours = bootstrap_intervals(labels, preds, losses, 3, resamples=2000)
    for name, drawn in values.items():
        reference = np.percentile(drawn, [2.5, 97.5])
        width = reference[1] - reference[0]
        assert np.allclose(ours[name], reference, atol=0.08 * width), (name, ours[name], reference)


def test_intervals_disabled_and_bad_arguments():
    labels, preds, losses = synthetic(20)
    assert bootstrap_intervals(labels, preds, losses, 4, resamples=0) is None
    assert bootstrap_intervals(labels[:0], preds[:0], losses[:0], 4) is None
    with pytest.raises(ValueError, match="resamples must be an integer >= 0"):
        bootstrap_intervals(labels, preds, losses, 4, resamples=-1)
    one = bootstrap_intervals(labels[:1], preds[:1], losses[:1], 4)
    assert one["accuracy"][0] == one["accuracy"][1]  # one sample: no spread


def test_intervals_of_a_million_samples_are_narrow():
    # (how long it takes: benchmarks/bench_merge.py, not a unit test)
    labels, preds, losses = synthetic(10**6, seed=5)
    ci = bootstrap_intervals(labels, preds, losses, 4, resamples=1000)
    accuracy = float((labels == preds).mean())
    assert ci["accuracy"][0] < accuracy < ci["accuracy"][1] and ci["accuracy"][1] - ci["accuracy"][0] < 0.005
