"""Bad input (issue 4): each case ends every rank with a usage error, one clear
`dist_eval: error:` line naming the flag, no traceback of ours, and no report written
as if the run had succeeded. The cases already in test_cli.py (missing text column,
label out of range, missing/corrupt data file, random head, checkpoint of another model
size, --pre-seq-len without --tuning-mode, non-positive --batch-size/--max-length,
unwritable --output-dir, unanswered --initial-peers) are not repeated here.

Also the label mapping for text labels (README "Labels"), and read_labels directly."""
import json
import os
import shutil

import pytest
from conftest import read_jsonl, run_ranks
from inprocess_cli import run_cli_in_process
from test_cli import assert_clean_failure, fails_in_process, local_args, no_figures_env

from dist_eval.backends.compat import configs_are_dataclasses


def _write(path, text):
    path.write_text(text)
    return str(path)


def assert_no_report(out):
    for name in ("metrics.json", "predictions.jsonl"):
        assert not (out / name).exists(), f"{name} written by a failed run"


@pytest.fixture(scope="module")
def model_without_tokenizer(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("no_tokenizer")
    for name in os.listdir(tiny_model):
        if "token" not in name:  # tokenizer.json, tokenizer_config.json, special_tokens_map.json
            shutil.copy(os.path.join(tiny_model, name), folder / name)
    return str(folder)


@pytest.fixture(scope="module")
def model_truncated(tiny_model, tmp_path_factory):
    """The tiny model with its safetensors file cut short (issue 29: an internal error on every rank before)."""
    folder = tmp_path_factory.mktemp("truncated")
    for name in os.listdir(tiny_model):
        shutil.copy(os.path.join(tiny_model, name), folder / name)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    return str(folder)


# the model folder's JSON files, each cut in half in a copy of its own: the one error line names the file
# the JSON files of the tiny model's folder (transformers 5.x writes no special_tokens_map.json), config.json last
CUT_SHORT = ("tokenizer.json", "tokenizer_config.json",
             *(() if configs_are_dataclasses() else ("special_tokens_map.json",)), "config.json")


@pytest.fixture(scope="module")
def models_cut_short(tiny_model, tmp_path_factory):
    folders = {}
    for cut in CUT_SHORT:
        folder = tmp_path_factory.mktemp("cut_short")
        for name in os.listdir(tiny_model):
            shutil.copy(os.path.join(tiny_model, name), folder / name)
        whole = (folder / cut).read_bytes()
        (folder / cut).write_bytes(whole[:len(whole) // 2])
        folders[f"MODEL_CUT:{cut}"] = str(folder)
    return folders


_DOES_NOTHING = (r"{}: does nothing unless the run stops early: expected with --stop-at-width or "
                 r"--stop-when-decided\. Add --stop-at-width \(a width\), or --stop-when-decided \(two "
                 r"checkpoints\), or drop it\.$")
CASES = {
    # id: (data file text or None for the default, extra flags, pattern of the error line)
    "device_without_gpu": (None, ["--device", "cuda:1"], r"--device cuda:1: no CUDA device is visible"),
    "nccl_without_gpu": (None, ["--dist-backend", "nccl"], r"--dist-backend nccl: NCCL needs one CUDA device per rank"),
    "missing_label_column": (
        None,
        ["--label-column", "y"],
        r"--label-column y: no such column; the dataset has \['text', 'label'\]",
    ),
    "text_labels_not_num_labels": (
        "text,label\nw1 w2,cat\nw3,dog\nw4,dog\n",
        [],
        r"--label-column label: 2 distinct text labels \['cat', 'dog'\], but the classifier head has 3 classes",
    ),
    "row_without_label": ("text,label\nw1 w2,0\nw3,\nw4,1\n", [], r"--label-column label: .*row 1 has no label"),
    "negative_label": (
        "text,label\nw1 w2,0\nw3,-1\n",
        [],
        r"--label-column label: row 1 has label -1, outside \[0, 3\)",
    ),
    "num_labels_disagrees_with_head": (
        None,
        ["--num-labels", "4"],
        r"--num-labels 4: the classifier head has 3 outputs",
    ),
    # found while tokenizing the lengths for the batch plan (a phase inside a phase):
    # still one line, a usage error
    "row_without_text": (
        "text,label\nw1 w2,0\n,1\nw4 w5,2\n",
        [],
        r"--text-column text: row 1 holds NoneType None, expected text",
    ),
    "empty_split_csv": ("text,label\n", [], r"--data-files .*data\.csv: no rows"),
    "empty_data_file": ("", [], r"--data-files .*data\.csv: no rows"),
    "model_without_tokenizer": (None, ["MODEL_WITHOUT_TOKENIZER"], r"--model .*: no usable tokenizer in the folder"),
    # issue 29: a k that every row meets; a model folder's broken file (exit 2, not an internal error)
    "top_k_at_num_classes": (None, ["--top-k", "3"], r"--top-k 3: expected a k below the number of classes \(3\); "
                                                     r"got 3.* Fix: pass at most 2"),
    "truncated_safetensors": (None, ["MODEL_TRUNCATED"], r"--model .*: a file of the folder cannot be read "
                                                         r"\(SafetensorError: .*\): it is broken"),
    # zero-shot: fewer label words than the data's classes; a template without {text}
    "too_few_label_words": (
        None,
        ["--label-words", "w1", "w2"],
        r"--label-words w1 w2: 2 words given, one per class \(ids 0..1\), but the data does not fit them: "
        r"row 2 has label 2 \(column 'label'\)\. Give one word per class",
    ),
    "template_without_text": (
        None,
        ["--label-words", "w1", "w2", "w3", "--template", "Review: {txt}"],
        r"--template Review: \{txt\}: expected a text with the placeholder \{text\} once",
    ),
    # issue 50: flags that do nothing in this combination
    "stop_rule_without_stopping": (None, ["--stop-rule", "fixed-width"],
                                   _DOES_NOTHING.format("--stop-rule fixed-width")),
    "stop_metric_without_stopping": (None, ["--stop-metric", "brier"], _DOES_NOTHING.format("--stop-metric brier")),
    "stop_round_rows_without_stopping": (None, ["--stop-round-rows", "64"],
                                         _DOES_NOTHING.format("--stop-round-rows 64")),
    "slice_by_missing_column": (None, ["--slice-by", "region"], r"--slice-by region: no column 'region' in the data"),
    "fresh_rows_with_the_store_off": (None, ["--fresh-rows", "--row-store", "off"],
                                      r"--fresh-rows: does nothing with the row store off .*expected with --row-store "
                                      r"auto or a folder\. Drop it, or give --row-store a folder\.$"),
    # issue 69: a JSON file of the model folder cut in half is named, with what was expected and the fix
    **{f"cut_short_{cut}": (None, [f"MODEL_CUT:{cut}"],
                            rf"--model \S+: {cut.replace('.', '[.]')}: expected a whole JSON file \(as "
                            r"save_pretrained\(\) writes it\); it does not parse \(JSONDecodeError: .*\): it is "
                            r"cut short or broken\. Save or copy the model folder again\.$") for cut in CUT_SHORT[:-1]},
    # config.json is read first, by the family check (backends/config_json.py: its own refusal, the file named)
    "cut_short_config.json": (None, ["MODEL_CUT:config.json"], r"--model \S+: .*config[.]json.*\(.*line \d+ column "
                                                               r"\d+.*\).*save_pretrained\(\)"),
}


# run on two ranks under torchrun (every rank exits 2): the process group's own refusal, a failure
# a failure found in a phase inside a phase, one found by rank 0's label reading, and one every rank
# meets alike (a truncated weights file: printed once, by rank 0, on its own line); the others in-process
TWO_RANKS = {"nccl_without_gpu", "row_without_text", "text_labels_not_num_labels", "truncated_safetensors",
             "slice_by_missing_column"}  # issue 50: this one printed a line per rank


def _case_args(case, tiny_model, tiny_checkpoint, folders, tmp_path):
    text, extra, pattern = CASES[case]
    data = _write(tmp_path / "data.csv", text if text is not None else "text,label\nw1 w2,0\nw3,1\nw4 w5,2\n")
    model = tiny_model
    if extra and extra[0] in folders:  # MODEL_WITHOUT_TOKENIZER, MODEL_TRUNCATED, MODEL_CUT:<file>
        model, extra = folders[extra[0]], []
    return local_args(model, tiny_checkpoint, data, tmp_path / "out", *extra), pattern


@pytest.mark.parametrize("case", [c for c in CASES if c not in TWO_RANKS])
def test_bad_input_fails_cleanly(case, tiny_model, tiny_checkpoint, model_without_tokenizer, model_truncated,
                                 models_cut_short, tmp_path, capfd):
    folders = {"MODEL_WITHOUT_TOKENIZER": model_without_tokenizer, "MODEL_TRUNCATED": model_truncated,
               **models_cut_short}
    args, pattern = _case_args(case, tiny_model, tiny_checkpoint, folders, tmp_path)
    fails_in_process(args, capfd, pattern)  # exit code 2, one line, no traceback, no report
    assert_no_report(tmp_path / "out")


@pytest.mark.multiproc
@pytest.mark.parametrize("case", sorted(TWO_RANKS))
def test_bad_input_fails_cleanly_on_every_rank(case, tiny_model, tiny_checkpoint, model_without_tokenizer,
                                              model_truncated, tmp_path, rank_zygote):
    folders = {"MODEL_WITHOUT_TOKENIZER": model_without_tokenizer, "MODEL_TRUNCATED": model_truncated}
    args, pattern = _case_args(case, tiny_model, tiny_checkpoint, folders, tmp_path)
    proc = run_ranks(rank_zygote, args, nproc=2, timeout=240)  # two ranks forked: conftest's run_ranks
    assert_clean_failure(proc, pattern)  # exit code 2 on every rank, one line, no traceback of ours
    assert proc.stderr.count("dist_eval: error:") == 1, proc.stderr[-3000:]  # not once per rank, nor glued
    assert_no_report(tmp_path / "out")


@pytest.mark.multiproc
def test_text_labels_get_sorted_ids(tiny_model, tiny_checkpoint, tmp_path, rank_zygote):
    """Exactly num_labels distinct text labels (and a model without class names): ids in
    sorted order, the texts reported as the class names. No figure is looked at: no matplotlib."""
    data = _write(tmp_path / "data.csv", "text,label\nw1 w2,emu\nw3,cat\nw4 w5,dog\nw6,cat\nw7 w8 w9,emu\n")
    proc = run_ranks(rank_zygote, local_args(tiny_model, tiny_checkpoint, data, tmp_path / "out"), nproc=2,
                     timeout=240, env=no_figures_env(tmp_path / "hidden"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(tmp_path / "out" / "predictions.jsonl")
    assert [r["label"] for r in rows] == [2, 0, 1, 0, 2]  # cat 0, dog 1, emu 2
    metrics = json.load(open(tmp_path / "out" / "metrics.json"))
    assert metrics["label_names"] == ["cat", "dog", "emu"]
    assert [r["label_name"] for r in rows] == ["emu", "cat", "dog", "cat", "emu"]


def test_integer_text_labels_are_integers(tiny_model, tiny_checkpoint, tmp_path):
    data = _write(
        tmp_path / "data.jsonl",
        "".join(
            json.dumps({"text": t, "label": label}) + "\n"
            for t, label in [("w1 w2", "2"), ("w3", "0"), ("w4", "1"), ("w5", "2")]
        ),
    )
    # the labels' mapping, not the launch (nor the figures): one rank, in this process, no matplotlib
    assert run_cli_in_process(local_args(tiny_model, tiny_checkpoint, data, tmp_path / "out"),
                              hide_modules=("matplotlib",)) == 0
    assert [r["label"] for r in read_jsonl(tmp_path / "out" / "predictions.jsonl")] == [2, 0, 1, 2]


# ---- read_labels directly: the model's class names (config.json id2label) win


@pytest.mark.multiproc
def test_a_stop_metric_that_means_nothing_fails_once_on_every_rank(tiny_model, tmp_path, rank_zygote):
    """Issue 50. Before: --stop-metric top_k_accuracy with two classes raised on rank 0 alone, after
    the first round, and the other ranks waited in the next collective until --dist-timeout."""
    from conftest import build_checkpoint

    checkpoint = build_checkpoint(str(tmp_path / "two.pt"), num_labels=2)
    data = _write(tmp_path / "data.csv", "text,label\n" + "".join(f"w{i} w{i + 1},{i % 2}\n" for i in range(40)))
    args = local_args(tiny_model, checkpoint, data, tmp_path / "out", "--stop-at-width", "0.1",
                      "--stop-metric", "top_k_accuracy", "--stop-round-rows", "16", "--dist-timeout", "600")
    proc = run_ranks(rank_zygote, args, nproc=2, timeout=240)  # a hang until --dist-timeout (600 s) fails here
    assert_clean_failure(proc, r"--stop-metric top_k_accuracy: top_k_accuracy with 2 classes means nothing")
    assert_no_report(tmp_path / "out")
