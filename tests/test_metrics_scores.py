"""Calibration and ranking metrics (ECE, Brier, top-k accuracy, AUROC) against
scikit-learn, and ECE against a plain per-row loop, on random and edge-case data."""
import numpy as np
import pytest
from sklearn import metrics as skm

from dist_eval.metrics import (
    auroc_macro,
    brier_score,
    calibration_bins,
    expected_calibration_error,
    reliability_table,
    softmax,
    top_k_accuracy,
)

pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.UndefinedMetricWarning")  # sklearn, k >= K


def random_probs(n, k, seed, temperature=1.0, decimals=None):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, k)) * 2.0 / temperature
    labels = rng.integers(0, k, n)
    logits[np.arange(n), labels] += 1.0  # better than chance
    probs = softmax(logits)
    if decimals is not None:  # coarse scores that still sum to 1: many ties within and across rows
        weights = np.round(probs * 3 * decimals) + 1.0
        probs = weights / weights.sum(axis=1, keepdims=True)
    return probs, labels


def ece_reference(probs, labels, bins=15):
    """Per-row loop: bin m holds confidences in (m/bins, (m+1)/bins], bin 0 also 0."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    count = np.zeros(bins)
    conf = np.zeros(bins)
    acc = np.zeros(bins)
    for row, label in zip(probs, labels):
        c = float(row.max())
        m = 0
        while m < bins - 1 and c > edges[m + 1]:
            m += 1
        count[m] += 1
        conf[m] += c
        acc[m] += float(int(np.argmax(row)) == int(label))
    n = len(labels)
    return sum(count[m] / n * abs(acc[m] / count[m] - conf[m] / count[m]) for m in range(bins) if count[m])


CASES = [  # n, classes, seed, decimals (None: continuous scores; 1-2: many ties)
    (200, 4, 0, None), (500, 3, 1, 2), (50, 2, 2, None), (300, 2, 3, 1), (1000, 10, 4, None), (40, 5, 5, 1),
]


@pytest.mark.parametrize("n,k,seed,decimals", CASES)
def test_top_k_accuracy_equals_sklearn(n, k, seed, decimals):
    probs, labels = random_probs(n, k, seed, decimals=decimals)
    for top in range(1, k + 2):  # includes k >= number of classes
        ours = top_k_accuracy(probs, labels, top)
        if k == 2:
            ref = skm.top_k_accuracy_score(labels, probs[:, 1], k=top, labels=[0, 1])
        else:
            ref = skm.top_k_accuracy_score(labels, probs, k=top, labels=list(range(k)))
        assert ours == pytest.approx(ref, abs=1e-15), (top, ours, ref)


def test_top_k_accuracy_from_logits_and_with_an_absent_class():
    rng = np.random.default_rng(9)
    logits = rng.normal(size=(300, 6))
    labels = rng.choice([0, 2, 3, 5], 300)  # classes 1 and 4 absent
    for top in (1, 2, 3, 6, 9):
        ref = skm.top_k_accuracy_score(labels, logits, k=top, labels=list(range(6)))
        assert top_k_accuracy(logits, labels, top) == ref
        assert top_k_accuracy(softmax(logits), labels, top) == ref
    ties = np.zeros((4, 3))  # every score tied: the higher index ranks first
    assert top_k_accuracy(ties, [2, 1, 0, 2], 1) == skm.top_k_accuracy_score([2, 1, 0, 2], ties, k=1, labels=[0, 1, 2])
    assert top_k_accuracy(ties, [2, 1, 0, 2], 1) == 0.5
    binary = np.array([[0.5, 0.5], [0.5, 0.5], [0.25, 0.75]])  # two classes: a tie predicts class 0
    assert top_k_accuracy(binary, [0, 1, 1], 1) == skm.top_k_accuracy_score([0, 1, 1], binary[:, 1], k=1) == 2 / 3
    with pytest.raises(ValueError):
        top_k_accuracy(logits, labels, 0)


@pytest.mark.parametrize("n,k,seed,decimals", CASES)
def test_auroc_equals_sklearn(n, k, seed, decimals):
    probs, labels = random_probs(n, k, seed, decimals=decimals)
    ours = auroc_macro(probs, labels)
    if k == 2:
        ref = skm.roc_auc_score(labels, probs[:, 1])
    else:
        ref = skm.roc_auc_score(labels, probs, multi_class="ovr", average="macro", labels=list(range(k)))
    assert ours == pytest.approx(ref, rel=1e-12, abs=1e-14)


def test_auroc_macro_over_the_classes_present():
    probs, labels = random_probs(400, 5, 11, decimals=2)
    labels = np.where(labels == 3, 0, labels)  # class 3 absent
    per_class = [skm.roc_auc_score(labels == c, probs[:, c]) for c in (0, 1, 2, 4)]
    assert auroc_macro(probs, labels) == pytest.approx(np.mean(per_class), rel=1e-12)
    assert np.isnan(auroc_macro(probs, np.zeros(400, dtype=int)))  # one class only
    # all scores tied: 0.5, as sklearn
    tied_labels = [0, 1, 0, 1, 1, 0]
    assert auroc_macro(np.full((6, 2), 0.5), tied_labels) == skm.roc_auc_score(tied_labels, np.full(6, 0.5)) == 0.5


@pytest.mark.parametrize("n,k,seed,decimals", CASES)
def test_brier_equals_sklearn(n, k, seed, decimals):
    probs, labels = random_probs(n, k, seed)
    ours = brier_score(probs, labels)
    ref = skm.brier_score_loss(labels, probs, labels=list(range(k)), scale_by_half=False)
    assert ours == pytest.approx(ref, rel=1e-12)
    if k == 2:  # the binary definition is half the sum over both classes
        assert ours == pytest.approx(2 * skm.brier_score_loss(labels, probs[:, 1]), rel=1e-12)
    assert ours == pytest.approx(np.mean(((probs - np.eye(k)[labels]) ** 2).sum(axis=1)), rel=1e-12)


@pytest.mark.parametrize("n,k,seed,decimals", CASES)
@pytest.mark.parametrize("bins", [15, 10, 1])
def test_ece_equals_a_per_row_loop(n, k, seed, decimals, bins):
    probs, labels = random_probs(n, k, seed, decimals=decimals)
    reference = ece_reference(probs, labels, bins)
    assert expected_calibration_error(probs, labels, bins) == pytest.approx(reference, abs=1e-12)


def test_ece_bin_edges_and_edge_cases():
    # confidences exactly on the edges 1/3, 2/3 and 1 fall in the bin they close; 0 in bin 0
    assert calibration_bins([0.0, 1 / 3, 1 / 3 + 1e-12, 2 / 3, 1.0], 3).tolist() == [0, 0, 1, 1, 2]
    assert calibration_bins(np.linspace(0, 1, 16), 15).tolist() == [0] + list(range(15))
    perfect = np.eye(3)[[0, 1, 2, 1]]
    assert expected_calibration_error(perfect, [0, 1, 2, 1]) == 0.0
    assert expected_calibration_error(perfect, [1, 2, 0, 0]) == 1.0
    probs = np.array([[0.9, 0.1], [0.9, 0.1], [0.6, 0.4], [0.3, 0.7]])
    labels = [0, 1, 0, 1]  # bin of 0.9: acc 0.5; 0.6 and 0.7 in one bin each at 15 bins
    assert expected_calibration_error(probs, labels) == pytest.approx((2 * 0.4 + 0.4 + 0.3) / 4)
    table = reliability_table(probs, labels)
    assert table["count"].sum() == 4 and len(table["edges"]) == 16
    assert np.isnan(expected_calibration_error(np.zeros((0, 3)), []))
    with pytest.raises(ValueError):
        expected_calibration_error(probs, [0, 2, 0, 1])


def test_softmax_is_stable_float64():
    logits = np.array([[1000.0, 1000.0, -1000.0], [0.0, np.log(3.0), -np.inf]], dtype=np.float32)
    probs = softmax(logits)
    assert probs.dtype == np.float64
    np.testing.assert_allclose(probs, [[0.5, 0.5, 0.0], [0.25, 0.75, 0.0]], rtol=1e-7)


def test_scores_do_not_depend_on_the_order_of_the_rows():
    probs, labels = random_probs(3000, 6, 21)
    order = np.random.default_rng(22).permutation(3000)
    for metric in (expected_calibration_error, brier_score, auroc_macro, lambda p, y: top_k_accuracy(p, y, 2)):
        assert metric(probs, labels) == metric(probs[order], labels[order])
