"""``--limit N --limit-seed S`` (dist_eval/data/sample.py): a seeded random sample of N rows
without replacement, chosen by the rows' content: the same rows for any order of the data
and any number of ranks, recorded in the report, part of the resume key."""
import json
import random

import numpy as np
import pytest
from conftest import read_jsonl, write_csv
from float_promises import assert_same_bits
from inprocess_cli import run_cli_in_process

from dist_eval.data.sample import row_keys, sample_indices


def columns_of(rows):
    return [[r[0] for r in rows], [r[1] for r in rows]]


def test_sample_is_without_replacement_and_independent_of_row_order():
    rng = random.Random(0)
    rows = [(f"text {i}", i % 3) for i in range(500)]
    chosen = sample_indices(columns_of(rows), 50, seed=7)
    assert len(chosen) == 50 and len(set(chosen.tolist())) == 50  # without replacement
    shuffled = rows[:]
    rng.shuffle(shuffled)
    again = sample_indices(columns_of(shuffled), 50, seed=7)
    # the same rows, in the same order
    assert [rows[i] for i in chosen] == [shuffled[i] for i in again]
    other_seed = sample_indices(columns_of(rows), 50, seed=8)
    assert {rows[i] for i in other_seed} != {rows[i] for i in chosen}
    assert sample_indices(columns_of(rows), 0, seed=7).tolist() == list(range(500))  # 0: every row
    assert sample_indices(columns_of(rows), 900, seed=7).tolist() == list(range(500))


def test_sample_is_uniform_enough():
    """Every row equally likely: over seeds, each of 20 rows is drawn about limit/20 of the time."""
    rows = [(f"row {i}", 0) for i in range(20)]
    counts = np.zeros(20)
    for seed in range(2000):
        counts[sample_indices(columns_of(rows), 5, seed)] += 1
    assert np.all(np.abs(counts / 2000 - 0.25) < 0.05), counts


def test_keys_depend_on_content_and_seed():
    a = row_keys([["x", "y"], [0, 0]], seed=1)
    assert a[0] != a[1] and np.array_equal(a, row_keys([["x", "y"], [0, 0]], seed=1))
    assert not np.array_equal(a, row_keys([["x", "y"], [0, 0]], seed=2))


def local_args(model, checkpoint, data, out, *extra):
    return ["--model", model, "--data-files", data, "--backend", "local", "--checkpoint", checkpoint,
            "--output-dir", str(out), "--batch-size", "4", "--progress", "none", "--save-text",
            "--bootstrap-resamples", "100", *extra]


def test_limit_evaluates_the_same_rows_for_any_order(tiny_model, tiny_checkpoint, tmp_path):
    """The same rows for any order of the file (for any N: tests/test_memory_bounded.py's N=3 --limit run)."""
    data = write_csv(str(tmp_path / "data.csv"), 60, seed=11)
    lines = open(data).read().splitlines()
    body = lines[1:]
    random.Random(1).shuffle(body)
    shuffled = tmp_path / "shuffled.csv"
    shuffled.write_text("\n".join([lines[0], *body]) + "\n")
    limit = ["--limit", "17", "--limit-seed", "3"]
    assert run_cli_in_process(local_args(tiny_model, tiny_checkpoint, data, tmp_path / "a", *limit)) == 0
    assert run_cli_in_process(local_args(tiny_model, tiny_checkpoint, str(shuffled), tmp_path / "b", *limit)) == 0
    runs = [read_jsonl(tmp_path / name / "predictions.jsonl") for name in "ab"]
    assert len(runs[0]) == 17  # the sample in its key order: the same batch plan whatever the file's order
    assert_same_bits(runs[1], runs[0], "predictions.jsonl, the file shuffled against in order")
    texts = {line.rsplit(",", 1)[0] for line in body}
    assert {r["text"] for r in runs[0]} <= texts and len({r["text"] for r in runs[0]}) == 17
    metrics = [json.load(open(tmp_path / name / "metrics.json")) for name in "ab"]
    assert metrics[0]["num_samples"] == 17
    assert metrics[0]["run"]["sample"] == {"limit": 17, "limit_seed": 3, "rows_in_data": 60, "rows": 17}
    strip = [{k: v for k, v in m.items() if k != "run"} for m in metrics]
    assert_same_bits(strip[1], strip[0], "metrics.json, the file shuffled against in order")
    assert "17 of 60 rows, a random sample (--limit 17 --limit-seed 3)" in open(tmp_path / "a" / "report.html").read()
    # --limit 0: every row (the rows the CLI's evaluation draws: draw_rows)
    import datasets

    from dist_eval.config import Settings
    from dist_eval.data.sample import draw_rows

    every = draw_rows(datasets.load_dataset("csv", data_files=data, split="train"), Settings(limit=0))
    assert len(every) == 60 and every.facts()["rows"] == every.facts()["rows_in_data"] == 60


def _reference_keys(columns, seed):
    """The keys as dist_eval first computed them: json.dumps of each row's values, one keyed
    blake2b each (row_keys must keep these bits: a --limit sample is the same rows across versions)."""
    import hashlib

    salt = int(seed).to_bytes(8, "little", signed=False)
    return np.array([int.from_bytes(hashlib.blake2b(json.dumps(values, ensure_ascii=False, default=str).encode(),
                                                    digest_size=8, key=salt).digest(), "little")
                     for values in zip(*columns)], dtype=np.uint64)


@pytest.mark.parametrize("view", ["plain", "selected", "numpy_format", "transform"])
def test_keys_of_a_datasets_columns_are_the_first_versions_bits(view):
    """Issue 29: the columns are read once as lists (not a Column row by row) and the rows hashed
    from one encoder and keyed state; the keys, hence every --limit sample and stopping order,
    are those json.dumps + blake2b per row gave: text with quotes and non-ASCII, None, a
    ClassLabel, floats; a select() view; a formatted dataset and a transform (read as Columns)."""
    import datasets

    from dist_eval.data.sample import column_values, key_order, sample_rows

    rng = np.random.default_rng(5)
    n = 300
    data = datasets.Dataset.from_dict(
        {"text": [f'r\u00e9 "{i}" \\ \u4e2d' if i % 7 else None for i in range(n)],
         "label": [int(x) for x in rng.integers(0, 3, n)],
         "score": [float(x) for x in rng.random(n)]},
        features=datasets.Features({"text": datasets.Value("string"),
                                    "label": datasets.ClassLabel(names=["a", "b", "c"]),
                                    "score": datasets.Value("float64")}))
    if view == "selected":
        data = data.select(rng.permutation(n)[:200].tolist())
    elif view == "numpy_format":
        data = data.with_format("numpy")
    elif view == "transform":
        data = data.with_transform(lambda batch: {"text": [f"<{t}>" for t in batch["text"]], "label": batch["label"],
                                                  "score": batch["score"]})
    names = ["text", "label", "score"]
    columns = column_values(data, names)
    expected = _reference_keys([data[name] for name in names], seed=11)
    assert np.array_equal(row_keys(columns, seed=11), expected)
    assert np.array_equal(key_order(columns, 11), np.lexsort((np.arange(len(expected)), expected)))
    picked = sample_rows(data, 40, 11, names)
    assert [picked[i]["score"] for i in range(40)] == [data[int(r)]["score"] for r in
                                                      np.lexsort((np.arange(len(expected)), expected))[:40]]


def test_content_keys_follow_the_rows_whatever_their_order_or_file():
    """predictions.jsonl's ``key`` (issue 52): a row's key is its content's (text, label, text pair),
    the same in any place of any file; identical rows share it, another label changes it."""
    import datasets

    from dist_eval.config import Settings
    from dist_eval.data.sample import draw_rows

    def content_keys(dataset, settings):
        return draw_rows(dataset, settings).keys

    rows = {"text": ["a", "b", "a", "c"], "label": [0, 1, 0, 2], "pair": ["x", "y", "x", "z"]}
    settings = Settings(text_pair_column="pair")
    keys = content_keys(datasets.Dataset.from_dict(rows), settings)
    assert keys[0] == keys[2] and len(set(keys)) == 3 and all(len(key) == 16 for key in keys)
    order = [3, 1, 0]
    moved = datasets.Dataset.from_dict({name: [values[i] for i in order] for name, values in rows.items()})
    assert content_keys(moved, settings) == [keys[i] for i in order]
    relabelled = datasets.Dataset.from_dict({**rows, "label": [1, 1, 0, 2]})
    assert content_keys(relabelled, settings)[1:] == keys[1:] and content_keys(relabelled, settings)[0] != keys[0]


def _keys_as_first_written(columns, seed: int) -> np.ndarray:
    """row_keys as its first version computed them: json.dumps of each row's values, a hash each."""
    import hashlib

    salt = int(seed).to_bytes(8, "little", signed=False)
    return np.array([int.from_bytes(hashlib.blake2b(json.dumps(list(values), ensure_ascii=False, default=str)
                                                    .encode(), digest_size=8, key=salt).digest(), "little")
                     for values in zip(*columns)], dtype=np.uint64)


@pytest.mark.parametrize("columns", [
    [["a", "two words", "new\nline", "quote \" and \\", "é ü 日本", "", "\u2028\t"], [0, 1, 2, 3, 4, 5, -6]],
    [["x", "y", "z"], [True, False, 1]],  # a bool is true/false: no int fast path for it
    [["x", None, 3.5], [1.0, float("nan"), 2], [[1, "a"], {"k": 1}, object]],  # other values: the encoder's own
    [[], []],
    [["only"]],
])
def test_keys_encoded_a_column_at_a_time_are_those_of_a_row_at_a_time(columns):
    """Issue 74: texts (ints) encoded by one call over a column, every row's bytes encoded at once, give
    each row the key its values' json.dumps gave (strings with newlines, quotes, non-ASCII; bools, floats,
    None, lists and objects through the encoder, as before)."""
    columns = [col if not any(v is object for v in col) else [str if v is object else v for v in col]
               for col in columns]
    assert np.array_equal(row_keys(columns, 7), _keys_as_first_written(columns, 7))


def test_hex_keys_are_formatted_at_once_as_one_at_a_time():
    """HexKeys' texts (iterated, sliced, indexed) and predictions.jsonl's cells (json_cells), made with
    numpy, are f"{key:016x}" and its json.dumps, key by key, across the chunk of lines."""
    from dist_eval.data.sample import HexKeys

    rng = np.random.default_rng(3)
    keys = np.concatenate([[0, 1, 2**64 - 1, 0x0123456789ABCDEF, 2**63], rng.integers(0, 2**63, 40000)])
    keys = keys.astype(np.uint64)
    hex_keys, want = HexKeys(keys), [f"{key:016x}" for key in keys.tolist()]
    assert list(hex_keys) == want and hex_keys[3:9] == want[3:9] and hex_keys[2] == want[2]
    rows = rng.permutation(len(keys))[:5000]
    assert hex_keys.json_cells(rows) == [json.dumps(want[i]) for i in rows.tolist()]
    assert HexKeys(np.zeros(0, np.uint64)).json_cells(np.zeros(0, np.int64)) == []


def test_the_keys_the_ranks_gathered_are_served_for_that_dataset_only(tmp_path):
    """dataset_keys serves the keys remembered for this very dataset, columns and seed (the ranks'
    gathered keys, issue 74), and computes them for any other (another dataset, its select(), other
    columns or seed)."""
    import datasets

    from dist_eval.data import sample

    data = datasets.Dataset.from_dict({"text": ["a", "b", "c"], "label": [0, 1, 0]})
    want = sample.dataset_keys(data, ["text", "label"], 0)
    fake = np.array([7, 8, 9], dtype=np.uint64)
    sample.remember_keys(data, ["text", "label"], 0, fake)
    try:
        assert np.array_equal(sample.dataset_keys(data, ["text", "label"], 0), fake)
        assert np.array_equal(sample.dataset_keys(data.select([0, 1, 2]), ["text", "label"], 0), want)
        assert not np.array_equal(sample.dataset_keys(data, ["text"], 0), fake)
        assert not np.array_equal(sample.dataset_keys(data, ["text", "label"], 1), fake)
    finally:
        sample._keyed = None
