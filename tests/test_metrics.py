"""Metric math against scikit-learn on the same labels and predictions."""
import numpy as np
import pytest
from sklearn import metrics as skm

from dist_eval.metrics import confusion_matrix, mean_of, metrics_from_confusion, per_sample_cross_entropy


def sklearn_reference(labels, preds, k):
    kw = dict(labels=list(range(k)), zero_division=0)
    p, r, f, s = skm.precision_recall_fscore_support(labels, preds, **kw)
    return {
        "accuracy": skm.accuracy_score(labels, preds),
        "precision_macro": skm.precision_score(labels, preds, average="macro", **kw),
        "recall_macro": skm.recall_score(labels, preds, average="macro", **kw),
        "f1_macro": skm.f1_score(labels, preds, average="macro", **kw),
        "f1_micro": skm.f1_score(labels, preds, average="micro", **kw),
        "f1_weighted": skm.f1_score(labels, preds, average="weighted", **kw),
        "precision_weighted": skm.precision_score(labels, preds, average="weighted", **kw),
        "recall_weighted": skm.recall_score(labels, preds, average="weighted", **kw),
        "per_class": (p, r, f, s),
        "cm": skm.confusion_matrix(labels, preds, labels=list(range(k))),
    }


CASES = [
    # (labels, preds, K): plain, a class absent from labels, a class absent from both, all wrong, size 1
    ([0, 1, 2, 2, 1, 0, 0], [0, 2, 2, 1, 1, 0, 1], 3),
    ([0, 0, 1, 1], [0, 2, 1, 2], 3),
    ([0, 1, 1, 0], [1, 1, 0, 0], 5),
    ([1, 1, 1], [0, 0, 0], 2),
    ([2], [2], 4),
]


@pytest.mark.parametrize("labels,preds,k", CASES)
def test_metrics_equal_sklearn(labels, preds, k):
    ours = metrics_from_confusion(confusion_matrix(labels, preds, k))
    ref = sklearn_reference(labels, preds, k)
    for key in ("accuracy", "precision_macro", "recall_macro", "f1_macro", "f1_micro", "f1_weighted",
                "precision_weighted", "recall_weighted"):
        assert ours[key] == pytest.approx(ref[key], abs=1e-12), key
    assert np.array_equal(np.array(ours["confusion_matrix"]), ref["cm"])
    assert np.array(ours["confusion_matrix"]).shape == (k, k)  # absent classes keep their row and column
    p, r, f, s = ref["per_class"]
    for c in range(k):
        row = ours["per_class"][str(c)]
        assert (row["precision"], row["recall"], row["f1"], row["support"]) == pytest.approx((p[c], r[c], f[c], s[c]))


def test_metrics_equal_sklearn_random():
    rng = np.random.default_rng(0)
    for trial in range(200):
        k = int(rng.integers(2, 7))
        n = int(rng.integers(1, 60))
        labels = rng.integers(0, k, n)
        # predictions skewed so that some classes are never predicted
        preds = np.where(rng.random(n) < 0.6, labels, rng.integers(0, max(1, k - 2), n))
        ours = metrics_from_confusion(confusion_matrix(labels, preds, k))
        ref = sklearn_reference(labels, preds, k)
        for key in ("accuracy", "precision_macro", "recall_macro", "f1_macro", "f1_micro", "f1_weighted"):
            assert ours[key] == pytest.approx(ref[key], abs=1e-12), (trial, key)


def test_class_names_label_the_per_class_table():
    out = metrics_from_confusion(confusion_matrix([0, 1], [0, 0], 3), ["neg", "neu", "pos"])
    assert list(out["per_class"]) == ["neg", "neu", "pos"]
    assert out["per_class"]["pos"]["support"] == 0


def test_confusion_matrix_rejects_out_of_range():
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        confusion_matrix([0, 2], [0, 1], 2)


def test_cross_entropy_matches_torch():
    import torch

    rng = np.random.default_rng(1)
    logits = rng.normal(size=(50, 4)).astype(np.float32) * 10
    labels = rng.integers(0, 4, 50)
    ref = torch.nn.functional.cross_entropy(
        torch.from_numpy(logits).double(), torch.from_numpy(labels), reduction="none"
    )
    assert np.allclose(per_sample_cross_entropy(logits, labels), ref.numpy(), rtol=1e-12, atol=1e-12)
    # sklearn clips probabilities at machine epsilon, so compare it on moderate logits
    moderate = logits / 10
    probs = torch.softmax(torch.from_numpy(moderate).double(), 1).numpy()
    assert skm.log_loss(labels, probs, labels=range(4)) == pytest.approx(
        mean_of(per_sample_cross_entropy(moderate, labels)), rel=1e-9
    )


def test_mean_is_order_independent():
    values = np.random.default_rng(2).normal(size=10001) * 1e6
    assert mean_of(values) == mean_of(values[::-1]) == mean_of(np.random.default_rng(3).permutation(values))
