"""tokenize_rows (dist_eval.data.tokenize): the ids of exactly the rows asked for, in their
order, as the tokenizer gives them for the same texts (and pairs, and a template), on a
real ``datasets.Dataset``, on a ``select()`` view of one (what --limit gives), on formatted
ones and one with a transform."""
import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from dist_eval.data.labels import TaskColumns
from dist_eval.data.tokenize import tokenize_rows


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def _data(n=50):
    rng = np.random.default_rng(0)
    words = ["good", "bad", "film", "plot", "very", "not", "a", "the"]
    return datasets.Dataset.from_dict({
        "text": [" ".join(rng.choice(words, size=int(rng.integers(1, 30)))) for _ in range(n)],
        "other": [" ".join(rng.choice(words, size=3)) for _ in range(n)],
        "label": [int(x) for x in rng.integers(0, 2, size=n)],
        "extra": [[float(i)] * 4 for i in range(n)],  # a column no text is read from
    })


@pytest.mark.parametrize("view", ["whole", "selected"])
@pytest.mark.parametrize("pair", [False, True])
def test_ids_of_the_rows_asked_for_in_their_order(tokenizer, view, pair):
    data = _data()
    if view == "selected":  # an indices mapping, as a --limit sample has
        data = data.select(list(range(49, -1, -2)))
    rows = np.array([7, 0, 3, 24, 11, 5], dtype=np.int64)  # unsorted, not contiguous
    columns = TaskColumns("text", "label", "other" if pair else None)
    ids, truncated = tokenize_rows(tokenizer, data, rows, columns, max_length=512, pad_token_id=-1)
    texts = [data[int(r)]["text"] for r in rows]
    pairs = [data[int(r)]["other"] for r in rows] if pair else None
    assert ids == tokenizer(texts, pairs)["input_ids"]
    assert truncated == 0


def test_template_truncation_and_no_rows(tokenizer):
    data = _data()
    rows = np.array([3, 1], dtype=np.int64)
    columns = TaskColumns("text", "label", "other", template="A: {text} B: {text_pair}")
    ids, truncated = tokenize_rows(tokenizer, data, rows, columns, max_length=4, pad_token_id=-1)
    full = tokenizer([f"A: {data[r]['text']} B: {data[r]['other']}" for r in (3, 1)])["input_ids"]
    assert ids == [x[:4] for x in full]
    assert truncated == sum(len(x) > 4 for x in full) == 2
    assert tokenize_rows(tokenizer, data, np.zeros(0, np.int64), columns, 4, -1) == ([], 0)


@pytest.mark.parametrize("fmt", ["numpy", "pandas", "torch", "transform"])
def test_formatted_datasets_and_a_transform(tokenizer, fmt):
    data = _data()
    if fmt == "transform":  # a transform that reads another column than the text
        data = data.with_transform(lambda b: {"text": [f"{t} {o}" for t, o in zip(b["text"], b["other"])],
                                              "label": b["label"]})
        want_texts = [f"{_data()[r]['text']} {_data()[r]['other']}" for r in (4, 2, 9)]
    else:
        data = data.with_format(fmt)
        want_texts = [_data()[r]["text"] for r in (4, 2, 9)]
    rows = np.array([4, 2, 9], dtype=np.int64)
    for pair in (None, "text"):  # the same column as text and pair
        columns = TaskColumns("text", "label", pair)
        ids, _ = tokenize_rows(tokenizer, data, rows, columns, max_length=512, pad_token_id=-1)
        assert ids == tokenizer(want_texts, want_texts if pair else None)["input_ids"]


@pytest.mark.parametrize("pair", [False, True])
def test_only_the_ids_are_asked_of_the_tokenizer(tokenizer, pair):
    """Issue 29: no attention masks or token type ids are built (they cost more than the
    tokenization of short rows); the ids are those of a default call."""
    calls = []

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return tokenizer(*args, **kwargs)

    data = _data()
    rows = np.arange(50, dtype=np.int64)
    columns = TaskColumns("text", "label", "other" if pair else None)
    ids, _ = tokenize_rows(recording, data, rows, columns, max_length=512, pad_token_id=-1)
    assert calls and all(not c["return_attention_mask"] and not c["return_token_type_ids"] for c in calls)
    assert ids == tokenizer(list(data["text"]), list(data["other"]) if pair else None)["input_ids"]
