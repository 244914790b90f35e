"""``python -m dist_eval.rescore OUT``: every metric recomputed from predictions.jsonl
(+ logits) alone equals the run's metrics.json."""
import json

import pytest
from conftest import write_csv
from inprocess_cli import run_cli_in_process

from dist_eval.rescore import RESCORED, rescore
from dist_eval.rescore import main as rescore_main


def run(tiny_model, tiny_checkpoint, data, out, *extra):
    args = ["--model", tiny_model, "--data-files", data, "--backend", "local", "--checkpoint", tiny_checkpoint,
            "--output-dir", str(out), "--batch-size", "4", "--progress", "none", "--quiet",
            "--bootstrap-resamples", "200", "--bootstrap-seed", "5", *extra]
    assert run_cli_in_process(args) == 0


@pytest.fixture(scope="module")
def outputs(tiny_model, tiny_checkpoint, tmp_path_factory):
    base = tmp_path_factory.mktemp("rescore")
    data = write_csv(str(base / "data.csv"), 37, seed=21)
    run(tiny_model, tiny_checkpoint, data, base / "logits", "--save-logits", "--top-k", "1")
    run(tiny_model, tiny_checkpoint, data, base / "plain")
    return base


def test_rescore_equals_the_run_with_logits(outputs, tmp_path, capsys):
    path = tmp_path / "rescored.json"
    assert rescore_main([str(outputs / "logits"), "--json", str(path)]) == 0
    assert "recomputed metrics equal metrics.json" in capsys.readouterr().out
    stored = json.load(open(outputs / "logits" / "metrics.json"))
    rescored = json.load(open(path))
    for key in (*RESCORED, "top1_accuracy"):
        assert key in rescored, key
        assert rescored[key] == stored[key], key


def test_rescore_without_logits_leaves_out_the_probability_scores(outputs, capsys):
    assert rescore_main([str(outputs / "plain")]) == 0
    assert "run with --save-logits" in capsys.readouterr().out
    rescored = rescore(str(outputs / "plain"))
    stored = json.load(open(outputs / "plain" / "metrics.json"))
    assert "ece" not in rescored and rescored["loss"] == stored["loss"]
    assert rescored["confidence_intervals"] == {k: v for k, v in stored["confidence_intervals"].items()
                                                if k in rescored["confidence_intervals"]}


def test_rescore_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert rescore_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("dist_eval.rescore: error: ")
