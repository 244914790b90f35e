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


def test_column_values_reads_what_datasets_reads_and_slices_arrow_only_where_that_is_the_same():
    """labels._arrow_values (a run of rows read as a slice of the Arrow column, without datasets' row-by-row
    gather) gives each column's values as ``dataset[rows]`` does; it steps aside (None) for rows picked one
    by one, rows behind an indices mapping, a decoded feature and a row out of range, where datasets' own
    read answers, the same values."""
    import datasets
    import numpy as np

    from dist_eval.data.labels import _arrow_values, column_values

    rng = np.random.default_rng(3)
    features = datasets.Features({"text": datasets.Value("string"), "score": datasets.Value("float64"),
                                  "label": datasets.ClassLabel(names=["a", "b", "c"]),
                                  "tags": datasets.Sequence(datasets.Value("string"))})
    data = datasets.Dataset.from_dict({"text": [f"row {i} é" for i in range(500)], "score": rng.random(500).tolist(),
                                       "label": rng.integers(0, 3, 500).tolist(),
                                       "tags": [["x"] * (i % 3) for i in range(500)]}, features=features)
    data = datasets.concatenate_datasets([data.select(range(0, 200)).flatten_indices(),
                                          data.select(range(200, 500)).flatten_indices()])  # two record batches
    picked = rng.permutation(500)[:321]
    cases = ((np.arange(150, 420), True), (slice(7, 400), True), (slice(None), True), (None, True),
             (np.array([499]), True), (picked, False), (np.arange(0, 500, 2), False), (slice(7, 400, 3), False))
    for rows, run in cases:
        expected = data.select_columns(["text", "score", "label"])[
            rows.tolist() if isinstance(rows, np.ndarray) else rows if rows is not None else slice(None)]
        got = column_values(data, ["text", "score", "label", "text"], rows)
        assert got == [expected["text"], expected["score"], expected["label"], expected["text"]]
        index = rows if rows is not None else slice(None)
        assert (_arrow_values(data, ["text", "score", "label"], index) is not None) == run
    shuffled = data.shuffle(seed=1)  # an indices mapping: datasets' own read
    assert _arrow_values(shuffled, ["text"], np.arange(10, 90)) is None
    assert column_values(shuffled, ["text"], np.arange(10, 90)) == [shuffled.select_columns(["text"])[10:90]["text"]]
    assert _arrow_values(data, ["tags"], np.arange(10, 90)) is None  # not a plain column
    assert column_values(data, ["tags"], np.arange(10, 90)) == [data[10:90]["tags"]]
    assert _arrow_values(data, ["text"], np.array([499, 500])) is None  # out of range: datasets names it
