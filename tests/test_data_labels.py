"""Labels read as class ids (dist_eval.data.labels), no processes: text labels mapped
through the model's class names, placeholder names ignored, whole floats, missing values."""
import numpy as np
import pytest


def _dataset(labels):
    import datasets

    return datasets.Dataset.from_dict({"text": ["w"] * len(labels), "label": labels})


def test_read_labels_maps_text_through_the_models_class_names():
    from dist_eval.data import read_labels

    names = ["positive", "negative", "neutral"]  # not sorted: the model's ids, not the sorted order
    ids = read_labels(_dataset(["neutral", "positive", "neutral"]), "label", 3, label_names=names)
    assert ids.tolist() == [2, 0, 2]  # a subset of the classes is fine


def test_read_labels_refuses_text_not_among_the_models_class_names():
    from dist_eval.data import read_labels
    from dist_eval.errors import UsageError

    # the Python API names the argument (the CLI names the flag: --label-column label)
    with pytest.raises(
        UsageError, match=r"label_column='label': text labels \['meh'\] are not among the model's class names"
    ):
        read_labels(
            _dataset(["positive", "meh", "negative"]), "label", 3, label_names=["positive", "negative", "neutral"]
        )


def test_read_labels_ignores_placeholder_class_names():
    from dist_eval.data import read_labels

    ids = read_labels(_dataset(["b", "a", "c"]), "label", 3, label_names=["LABEL_0", "LABEL_1", "LABEL_2"])
    assert ids.tolist() == [1, 0, 2]


def test_read_labels_float_whole_numbers_and_nan():
    from dist_eval.data import read_labels
    from dist_eval.errors import UsageError

    assert read_labels(_dataset([0.0, 2.0, 1.0]), "label", 3).dtype == np.int64
    with pytest.raises(UsageError, match=r"row 1 has 1.5 \(1 such rows\)"):
        read_labels(_dataset([0.0, 1.5, 1.0]), "label", 3)
