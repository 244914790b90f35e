"""Stopping early (``stop_at_width``, dist_eval/stopping.py): a run evaluates the demo set in
rounds of rows in the --limit order and stops where the confidence sequence computed on the
whole set's rows (dist_eval/sequential.py) says it may; its rows, logits and metrics are
those of an ordinary evaluate() of the same rows. The real demo model, local backend.
The CLI runs here draw no figures (matplotlib hidden): none is looked at.
"""
import glob
import json
import os
import re

import numpy as np
import pytest
import torch
from conftest import REPO, read_jsonl, run_ranks
from float_promises import assert_same_bits, assert_within_rounding
from inprocess_cli import one_thread, run_cli_in_process, without_modules

from dist_eval import evaluate, ranks
from dist_eval.config import STOP_METRIC_NAMES, STOP_RULE_NAMES, Settings
from dist_eval.data.sample import key_order
from dist_eval.errors import UsageError
from dist_eval.sequential import RULES, STOP_METRICS, stop_report

ROUND = 100
IN_ROUNDS = "a run in rounds plans each round's rows into batches of their own"


def no_figures_env(folder) -> dict:
    """run_cli's env for a launched run without matplotlib (hidden under ``folder``)."""
    hidden = without_modules(folder, "matplotlib")
    return {"PYTHONPATH": os.pathsep.join(p for p in (hidden, REPO, os.environ.get("PYTHONPATH")) if p)}


@pytest.fixture(scope="module")
def demo(demo_build):
    from transformers import AutoTokenizer

    from dist_eval.backends import load_model
    from dist_eval.data.load import load_split

    assets = demo_build[2][0]
    with one_thread():
        model = load_model("local", assets.model_dir, checkpoint=assets.checkpoint)
        tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
        dataset = load_split([assets.data_dir], assets.split)
        full = evaluate(model, dataset, tokenizer=tokenizer, return_logits=True, bootstrap_resamples=0)
    yield model, tokenizer, dataset, full
    model.close()


def _stopped(demo, **keywords):
    model, tokenizer, dataset, _ = demo
    with one_thread():
        return evaluate(model, dataset, tokenizer=tokenizer, return_logits=True, stop_round_rows=ROUND, **keywords)


def test_the_stop_metrics_and_rules_are_the_flags_choices():
    assert set(STOP_METRIC_NAMES) == set(STOP_METRICS) and STOP_RULE_NAMES == RULES
    for bad in ({"stop_rule": "fixed-width", "stop_at_width": 0.1, "stop_when_decided": True},
                {"stop_rule": "peek"}):
        with pytest.raises(UsageError) as e:
            Settings(**bad)
        assert e.value.param == "stop_rule"


def test_the_fixed_width_rule_stops_where_its_interval_is_narrow_enough_and_says_what_it_guarantees(demo):
    """``stop_rule="fixed-width"``: the stop of sequential.stop_report's fixed-width rule on the
    rows used; fewer rows than the time-uniform rule; metrics.json's words say which rule stopped
    and that its interval holds at this stop only."""
    _, _, dataset, _ = demo
    fixed = _stopped(demo, stop_at_width=0.05, stop_rule="fixed-width", bootstrap_resamples=0)
    tuned = _stopped(demo, stop_at_width=0.05, bootstrap_resamples=0)
    stop = fixed.metrics["stopping"]
    order = key_order([dataset["text"], dataset["label"]], 0)
    position = np.searchsorted(fixed.predictions.indices, order[: stop["rows_used"]])
    correct = (fixed.predictions.preds == fixed.predictions.labels).astype(float)[position]
    expected = stop_report(correct, len(dataset), ROUND, width=0.05, rule="fixed-width")
    assert (stop["rule"], stop["reason"], stop["rows_used"]) == ("fixed-width", "width", expected["rows_used"])
    assert (stop["interval"]["low"], stop["interval"]["high"]) == (expected["interval"]["low"],
                                                                   expected["interval"]["high"])
    assert stop["interval"]["time_uniform"] is False and "this stopping rule only" in stop["interval"]["guarantee"]
    assert stop["rows_used"] < tuned.metrics["stopping"]["rows_used"]
    assert tuned.metrics["stopping"]["rule"] == "time-uniform"
    assert tuned.metrics["stopping"]["interval"]["tuned_to_width"] == 0.05


@pytest.mark.parametrize("width", [0.05, 0.1])
def test_stops_where_the_sequence_over_the_whole_set_says(demo, width):
    """The stopping round and interval are those of sequential.stop_report over the rows used,
    in the --limit order, out of the whole set; the rows used are the first of that order.
    A row's logits depend on the batch it ran in (its padding, the kernels' shapes), so they
    equal the whole set's run to float rounding, not bit for bit: the predictions are equal."""
    model, tokenizer, dataset, full = demo
    result = _stopped(demo, stop_at_width=width)
    stop = result.metrics["stopping"]

    order = key_order([dataset["text"], dataset["label"]], 0)
    used = order[: stop["rows_used"]]
    assert np.array_equal(result.predictions.indices, np.sort(used))
    position = np.searchsorted(result.predictions.indices, used)  # the rows used, in the order seen
    correct = (result.predictions.preds == result.predictions.labels).astype(float)[position]
    expected = stop_report(correct, len(dataset), ROUND, width=width)
    assert stop["reason"] == expected["reason"] == "width"
    assert stop["rows_used"] == expected["rows_used"] < len(dataset)
    assert stop["rounds"] == expected["rounds"] and stop["rows_saved"] == len(dataset) - stop["rows_used"]
    assert stop["interval"]["low"] == expected["interval"]["low"]
    assert stop["interval"]["high"] == expected["interval"]["high"]
    assert stop["interval"]["width"] <= width and stop["interval"]["time_uniform"] is True
    assert stop["rows_in_set"] == len(dataset) and stop["metric"] == "accuracy"
    # one round fewer would not have been narrow enough
    if stop["rounds"] > 1:
        earlier = stop_report(correct[: stop["rows_used"] - ROUND], len(dataset), ROUND, width=width)
        assert earlier["reason"] == "end" and earlier["interval"]["width"] > width

    rows = np.sort(used)
    assert np.array_equal(result.predictions.preds, full.predictions.preds[rows])
    assert_within_rounding(result.predictions.logits, full.predictions.logits[rows],
                           "the logits, against the whole set's", why=IN_ROUNDS)
    with one_thread():
        same_rows = evaluate(model, dataset.select(rows.tolist()), tokenizer=tokenizer)
    names = ("accuracy", "f1_macro", "confusion_matrix", "num_samples", "label_names", "loss")
    assert_within_rounding({name: result.metrics[name] for name in names},
                           {name: same_rows.metrics[name] for name in names}, "the metrics, against the same rows'",
                           why=IN_ROUNDS)
    assert result.metrics["num_samples"] == stop["rows_used"] == sum(result.metrics["run"]["per_rank_samples"])
    assert set(result.metrics["confidence_intervals"]) >= {"accuracy", "ece", "auroc_macro"}


def test_a_set_seen_to_its_end_gives_its_exact_value(demo):
    _, _, dataset, full = demo
    result = _stopped(demo, stop_at_width=1e-9)
    stop = result.metrics["stopping"]
    assert stop["reason"] == "end" and stop["rows_used"] == len(dataset) and stop["rows_saved"] == 0
    assert stop["rounds"] == -(-len(dataset) // ROUND)
    assert stop["interval"]["low"] == stop["interval"]["high"] == result.metrics["accuracy"]
    assert_within_rounding([result.metrics[name] for name in ("accuracy", "confusion_matrix")],
                           [full.metrics[name] for name in ("accuracy", "confusion_matrix")],
                           "the accuracy and confusion matrix, against the whole set's", why=IN_ROUNDS)


def test_the_brier_score_and_a_bounded_sample_metric_can_decide(demo):
    result = _stopped(demo, stop_at_width=0.1, stop_metric="brier", bootstrap_resamples=0)
    assert result.metrics["stopping"]["metric"] == "brier" and result.metrics["stopping"]["interval"]["width"] <= 0.1

    def confident(logits, labels):  # the top probability: a per-row value in [0, 1]
        return torch.softmax(torch.as_tensor(logits, dtype=torch.float64), dim=1).max(dim=1).values.numpy()

    result = _stopped(demo, stop_at_width=0.1, stop_metric="confident", sample_metrics={"confident": confident},
                      bootstrap_resamples=0)
    stop = result.metrics["stopping"]
    assert stop["metric"] == "confident" and stop["interval"]["low"] <= result.metrics["confident"]

    # values outside [0, 1], found in the run (after a round): a RankFailure on every rank whose usage is
    # true and whose cause is the UsageError (docs/python-api.md), as every problem found during a run
    with pytest.raises(ranks.RankFailure) as e:
        _stopped(demo, stop_at_width=0.1, stop_metric="twice", bootstrap_resamples=0,
                 sample_metrics={"twice": lambda logits, labels: 2 * confident(logits, labels)})
    assert e.value.usage and e.value.__cause__.param == "stop_metric" and "[0, 1]" in str(e.value)


def test_what_cannot_stop_is_refused_naming_the_setting(demo):
    model, tokenizer, dataset, _ = demo
    for bad in ({"stop_at_width": 0}, {"stop_at_width": 3.0}, {"stop_at_width": "0.1"}, {"stop_round_rows": 0}):
        with pytest.raises(UsageError) as e:
            Settings(**bad)
        assert e.value.param == next(iter(bad))
    with pytest.raises(UsageError) as e:
        _stopped(demo, stop_at_width=0.1, stop_metric="f1_macro")
    assert e.value.param == "stop_metric" and "accuracy" in str(e.value)
    loader = torch.utils.data.DataLoader([{"input_ids": torch.ones(3, dtype=torch.long), "labels": 0}])
    with pytest.raises(UsageError) as e:
        evaluate(model, loader, stop_at_width=0.1)
    assert e.value.param == "stop_at_width" and "Dataset" in str(e.value)


@pytest.mark.multiproc
def test_the_cli_stops_on_the_same_rows_with_the_same_numbers_for_one_and_two_ranks(demo_cache, tmp_path, capfd,
                                                                                      monkeypatch, rank_zygote):
    """One process (in this one: one thread, as a launched process has) and two ranks (forked:
    conftest's run_ranks)."""
    common = ["--backend", "local", "--stop-at-width", "0.06", "--stop-round-rows", "64", "--save-logits", "--quiet"]
    env = {"DIST_EVAL_CACHE": demo_cache, **no_figures_env(tmp_path / "hidden")}
    runs = {}
    for nproc in (0, 2):
        out = tmp_path / f"n{nproc}"
        if nproc == 0:
            monkeypatch.setenv("DIST_EVAL_CACHE", demo_cache)
            capfd.readouterr()
            code = run_cli_in_process([*common, "--output-dir", str(out)], hide_modules=("matplotlib",))
            stdout, stderr = capfd.readouterr()
        else:
            proc = run_ranks(rank_zygote, [*common, "--output-dir", str(out)], nproc=nproc, env=env)
            code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        assert code == 0, stderr[-3000:]
        metrics = json.loads((out / "metrics.json").read_text())
        runs[nproc] = metrics, read_jsonl(out / "predictions.jsonl")
        assert not (out / "partial").exists()  # the rounds' partial results are removed with the rest
        assert "stopped after" in (out / "report.html").read_text()
        assert re.search(r"accuracy \d\.\d{4} on \d+ samples \(stopped after \d+ of 800 rows: width, 95% time-uniform "
                         r"interval \[0\.\d{4}, [01]\.\d{4}\]\) -> ", stdout), stdout  # --quiet's one line
    (one, one_rows), (two, two_rows) = runs[0], runs[2]
    timing = ("seconds", "seconds_saved_estimate")
    assert {k: v for k, v in one["stopping"].items() if k not in timing} == \
        {k: v for k, v in two["stopping"].items() if k not in timing}
    assert one["stopping"]["reason"] == "width" and one["stopping"]["rows_saved"] > 0
    assert_same_bits(two_rows, one_rows, "predictions.jsonl, 2 ranks against 1")
    assert len(one_rows) == one["stopping"]["rows_used"]
    # its report rescored and verified from its rows (a random sample of the set, in its order: both refused it as
    # "not one row per index 0..n-1", verify with a DIFFERS line)
    from dist_eval import rescore, verify

    assert rescore.main([str(tmp_path / "n0")]) == 0
    capfd.readouterr()
    assert verify.main([str(tmp_path / "n2")]) == 0, capfd.readouterr()
    for name in ("accuracy", "loss", "confusion_matrix", "confidence_intervals", "auroc_macro"):
        assert_same_bits(two[name], one[name], f"{name}, 2 ranks against 1")
    assert two["run"]["world_size"] == 2 and sum(two["run"]["per_rank_samples"]) == len(two_rows)


@pytest.fixture(scope="module")
def worse_checkpoint(demo_build, tmp_path_factory):
    """The demo's checkpoint with two classes' head rows swapped: about half as accurate (the
    demo's margins are wide: noise on the head hardly changes a prediction)."""
    assets = demo_build[2][0]
    saved = torch.load(assets.checkpoint, weights_only=True)
    head = saved["state_dict"]["score.weight"].clone()
    saved["state_dict"]["score.weight"] = head[[1, 0, 2, 3]]
    path = str(tmp_path_factory.mktemp("worse") / "worse.pt")
    torch.save(saved, path)
    return path


def _paired_values(result_first, result_second, order, rows_used):
    used = order[:rows_used]
    values = []
    for result in (result_first, result_second):
        assert np.array_equal(result.predictions.indices, np.sort(used))
        position = np.searchsorted(result.predictions.indices, used)
        values.append((result.predictions.preds == result.predictions.labels).astype(float)[position])
    return values


def test_two_models_on_the_same_rows_stop_once_the_difference_excludes_zero(demo, demo_build, worse_checkpoint):
    from dist_eval import evaluate_pair
    from dist_eval.backends import load_model

    model, tokenizer, dataset, full = demo
    with one_thread():
        worse = load_model("local", demo_build[2][0].model_dir, checkpoint=worse_checkpoint)
        try:
            first, second = evaluate_pair(model, worse, dataset, tokenizer=tokenizer, return_logits=True,
                                          stop_when_decided=True, stop_round_rows=ROUND, bootstrap_resamples=0)
            worse_full = evaluate(worse, dataset, tokenizer=tokenizer, bootstrap_resamples=0)
        finally:
            worse.close()
    stop = first.metrics["stopping"]
    assert stop == second.metrics["stopping"] | {k: stop[k] for k in ("seconds", "seconds_saved_estimate")}
    assert worse_full.metrics["accuracy"] < full.metrics["accuracy"]  # what the run should find
    assert stop["reason"] == "decided" and stop["better"] == "first" and stop["interval"]["high"] < 0
    assert stop["rows_used"] < len(dataset)

    order = key_order([dataset["text"], dataset["label"]], 0)
    a, b = _paired_values(first, second, order, stop["rows_used"])
    expected = stop_report(b, len(dataset), ROUND, decide=True, paired_with=a)
    assert (stop["rows_used"], stop["rounds"], stop["reason"]) == (expected["rows_used"], expected["rounds"], "decided")
    assert (stop["interval"]["low"], stop["interval"]["high"]) == (expected["interval"]["low"],
                                                                   expected["interval"]["high"])
    with pytest.raises(UsageError) as e:  # one model cannot be compared
        _stopped(demo, stop_when_decided=True)
    assert e.value.param == "stop_when_decided"


@pytest.mark.multiproc
def test_the_cli_compares_two_checkpoints_with_one_model_load_as_the_api_does(demo, demo_build, worse_checkpoint,
                                                                             tmp_path, rank_zygote):
    from dist_eval import evaluate_pair
    from dist_eval.backends import load_model

    assets = demo_build[2][0]
    out = tmp_path / "out"
    proc = run_ranks(rank_zygote, ["--model", assets.model_dir, "--data-files", assets.data_dir, "--split",
                                   assets.split, "--checkpoint", f"A={assets.checkpoint}", "--checkpoint",
                                   f"B={worse_checkpoint}", "--backend", "local", "--stop-when-decided",
                                   "--stop-round-rows", str(ROUND), "--bootstrap-resamples", "0", "--save-logits",
                                   "--output-dir", str(out), "--progress", "none", "--slice-by", "label"],
                     nproc=2, env=no_figures_env(tmp_path / "hidden"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the first checkpoint is better" in proc.stdout
    model, tokenizer, dataset, _ = demo
    with one_thread():
        worse = load_model("local", assets.model_dir, checkpoint=worse_checkpoint)
        try:
            api = evaluate_pair(model, worse, dataset, tokenizer=tokenizer, stop_when_decided=True,
                                stop_round_rows=ROUND, bootstrap_resamples=0, slice_by=["label"])
        finally:
            worse.close()
    timing = ("seconds", "seconds_saved_estimate")
    for name, result in zip("AB", api):
        metrics = json.loads((out / name / "metrics.json").read_text())
        assert {k: v for k, v in metrics["stopping"].items() if k not in timing} == \
            {k: v for k, v in result.metrics["stopping"].items() if k not in timing}
        for key in ("accuracy", "loss", "confusion_matrix", "ece", "auroc_macro"):
            assert_same_bits(metrics[key], result.metrics[key], f"{name}: {key}, the CLI on 2 ranks against the API")
        # issue 47: the slices attach once, after the rounds, for evaluate_pair as for evaluate
        assert metrics["slices"]["by"]["label"] and metrics["slices"]["rows"] == metrics["stopping"]["rows_used"]
        assert_same_bits(json.loads(json.dumps(result.metrics["slices"])), metrics["slices"], f"{name}: slices")
        assert len(read_jsonl(out / name / "predictions.jsonl")) == metrics["stopping"]["rows_used"]
    assert metrics["stopping"]["reason"] == "decided"
    # issue 52: the summary compares the two on the rows they used (paired by content, not by place)
    compared = json.loads((out / "summary.json").read_text())["comparisons"]["pairs"]
    assert [(r["a"], r["b"], r["shared_rows"]) for r in compared] == [("A", "B", metrics["stopping"]["rows_used"])]


def test_a_comparison_is_skipped_on_resume_only_when_both_reports_are_finished(demo_build, worse_checkpoint,
                                                                              tmp_path, capfd, monkeypatch):
    """--resume of --stop-when-decided: a run interrupted between the two reports (A's written, B's rounds
    stored) resumes with A evaluated again beside B, B from its stored rounds, and says so once (before, it
    said "already finished ... skipped" for A and evaluated it anyway); the reports are the uninterrupted
    run's. With both finished, both are skipped: nothing evaluated; but only when each report names the
    other's run (``run.pair.compared_with_run_key``): a report of A against another checkpoint is not."""
    from dist_eval import pipeline

    assets = demo_build[2][0]
    args = ["--model", assets.model_dir, "--data-files", assets.data_dir, "--split", assets.split,
            "--checkpoint", f"A={assets.checkpoint}", "--backend", "local", "--stop-when-decided",
            "--stop-round-rows", str(ROUND), "--bootstrap-resamples", "0", "--progress", "none"]

    def run(out, expected_code=0, b=worse_checkpoint) -> str:
        capfd.readouterr()
        code = run_cli_in_process([*args, "--checkpoint", f"B={b}", "--output-dir", str(out)],
                                  hide_modules=("matplotlib",))
        printed = "".join(capfd.readouterr())
        assert code == expected_code, printed[-3000:]
        return printed

    run(tmp_path / "whole")
    whole = {side: json.loads((tmp_path / "whole" / side / "metrics.json").read_text()) for side in "AB"}
    for side, other in ("AB", "BA"):  # each report names the run it was compared with
        assert whole[side]["run"]["pair"]["compared_with_run_key"] == whole[other]["run"]["run_key"]
    out = tmp_path / "out"
    report_pair = pipeline.report_pair

    def interrupted_before_b(session, pair, *rest):
        if pair.folder == "B":
            raise KeyboardInterrupt  # as a SIGINT there: A's report written, B's rounds stored
        return report_pair(session, pair, *rest)

    monkeypatch.setattr(pipeline, "report_pair", interrupted_before_b)
    run(out, expected_code=130)
    monkeypatch.setattr(pipeline, "report_pair", report_pair)
    assert (out / "A" / "metrics.json").is_file() and not (out / "A" / "partial").exists()
    assert not (out / "B" / "metrics.json").exists() and glob.glob(str(out / "B" / "partial" / "*" / "round-*"))
    printed = run(out)
    assert "already finished" not in printed
    assert printed.count("is finished, but the checkpoint it is compared with is not") == 1
    assert f"the report in {out / 'A'} is finished, but the checkpoint it is compared with is not: it is " \
           "evaluated again beside it, on the same rows" in printed
    assert f"reusing the stored results in {out / 'B' / 'partial'}" in printed
    for side in "AB":
        again = json.loads((out / side / "metrics.json").read_text())
        assert again["stopping"]["rows_used"] == whole[side]["stopping"]["rows_used"]
        for key in ("accuracy", "loss", "confusion_matrix"):
            assert_same_bits(again[key], whole[side][key], f"{side}: {key}, resumed against uninterrupted")
        assert not (out / side / "partial").exists()
    assert json.loads((out / "B" / "metrics.json").read_text())["run"]["resumed_samples"] > 0
    assert json.loads((out / "A" / "metrics.json").read_text())["run"]["resumed_samples"] == 0
    printed = run(out)
    assert [line for line in printed.splitlines() if "already finished" in line] == [
        f"dist_eval: already finished (the report in {out / side} is of this checkpoint, data and settings): "
        "skipped" for side in "AB"]
    assert "comparing A and B" not in printed
    # A compared with a third checkpoint in B's place, interrupted before that B's report: A's report is of A
    # against the third, B's still of B against A. Back to B: A's report does not name B's run, so the two
    # are not skipped as finished (before: both skipped, A's stop decided against another checkpoint)
    third = tmp_path / "third.pt"
    saved = torch.load(worse_checkpoint, weights_only=True)
    saved["state_dict"]["score.weight"] = saved["state_dict"]["score.weight"][[0, 1, 3, 2]].clone()
    torch.save(saved, third)
    monkeypatch.setattr(pipeline, "report_pair", interrupted_before_b)
    run(out, expected_code=130, b=third)
    monkeypatch.setattr(pipeline, "report_pair", report_pair)
    printed = run(out)
    assert "already finished" not in printed
    assert f"the report in {out / 'B'} is finished, but the checkpoint it is compared with is not" in printed
    for side in "AB":
        again = json.loads((out / side / "metrics.json").read_text())
        assert again["run"]["pair"]["compared_with_run_key"] == whole[side]["run"]["pair"]["compared_with_run_key"]
        assert again["stopping"]["rows_used"] == whole[side]["stopping"]["rows_used"]
        assert_same_bits(again["accuracy"], whole[side]["accuracy"], f"{side}: accuracy, against B again")


def test_every_run_goes_through_the_one_loop_of_rounds(demo, monkeypatch):
    """Issue 47: a run that does not stop early is one round of every row (stopping.WholeRun) of the loop
    that a run that stops early takes in rounds (stopping.InRounds); the numbers are the whole run's."""
    from dist_eval import stopping

    handed = []
    for schedule in (stopping.WholeRun, stopping.InRounds):
        def counted(self, _next=schedule.next_round, _name=schedule.__name__):
            handed.append(_name)
            return _next(self)
        monkeypatch.setattr(schedule, "next_round", counted)
    model, tokenizer, dataset, full = demo
    with one_thread():
        whole = evaluate(model, dataset, tokenizer=tokenizer, return_logits=True, bootstrap_resamples=0)
    assert handed == ["WholeRun"]
    assert_same_bits(whole.predictions.logits, full.predictions.logits, "a whole run, through the one loop")
    stopped = _stopped(demo, stop_at_width=0.1, bootstrap_resamples=0)
    assert handed == ["WholeRun"] + ["InRounds"] * stopped.metrics["stopping"]["rounds"]


def test_the_worked_example_in_the_docs_is_what_the_demo_gives(demo):
    """docs/running.md's table of the rows the demo needs: each row again, in process (the
    same rounds, rows and numbers as the CLI's, for any number of ranks)."""
    import os
    import re

    from conftest import REPO

    text = open(os.path.join(REPO, "docs", "running.md")).read()
    rows = re.findall(r"^\| ([0-9.]+) \| (\d+) \| (\d+) \| \[([0-9.]+), ([0-9.]+)\] \| \d+ \|$", text, re.M)
    assert len(rows) == 4, rows
    fixed_width = re.search(r"^With `--stop-rule fixed-width`: (\d+), (\d+), (\d+) and (\d+) rows\.$", text, re.M)
    assert fixed_width, "running.md's line of the fixed-width rule's rows"
    model, tokenizer, dataset, _ = demo
    for (width, round_rows, used, low, high), fixed_used in zip(rows, fixed_width.groups()):
        with one_thread():
            result = evaluate(model, dataset, tokenizer=tokenizer, stop_at_width=float(width),
                              stop_round_rows=int(round_rows), bootstrap_resamples=0)
            fixed = evaluate(model, dataset, tokenizer=tokenizer, stop_at_width=float(width),
                             stop_round_rows=int(round_rows), bootstrap_resamples=0, stop_rule="fixed-width")
        stop = result.metrics["stopping"]
        assert stop["rows_used"] == int(used), (width, round_rows)
        assert (f"{stop['interval']['low']:.4f}", f"{stop['interval']['high']:.4f}") == (low, high)
        assert fixed.metrics["stopping"]["rows_used"] == int(fixed_used), (width, round_rows, "fixed-width")


def test_a_limit_sample_is_the_set_and_two_equal_models_stop_on_width(demo):
    """With --limit the set is the sample (its rows first in the same order); two models that
    never differ cannot decide, so the pair stops when the difference's interval is narrow."""
    from dist_eval import evaluate_pair

    model, tokenizer, dataset, _ = demo
    result = _stopped(demo, stop_at_width=0.08, limit=300, bootstrap_resamples=0)
    stop = result.metrics["stopping"]
    assert stop["rows_in_set"] == 300 and stop["rows_used"] < 300
    from dist_eval.data.sample import sample_rows

    sample = sample_rows(dataset, 300, 0, ["text", "label"])  # indices are the sample's, as with any --limit
    order = key_order([dataset["text"], dataset["label"]], 0)
    used = sorted(zip(sample.select(result.predictions.indices.tolist())["text"],
                      sample.select(result.predictions.indices.tolist())["label"]))
    first_of_order = dataset.select(order[: stop["rows_used"]].tolist())
    assert used == sorted(zip(first_of_order["text"], first_of_order["label"]))
    with one_thread():
        first, second = evaluate_pair(model, model, dataset, tokenizer=tokenizer, stop_at_width=0.1,
                                      stop_when_decided=True, stop_round_rows=ROUND, bootstrap_resamples=0)
    stop = first.metrics["stopping"]
    assert stop["reason"] == "width" and stop["better"] is None
    assert stop["interval"]["low"] < 0 < stop["interval"]["high"]
    assert_same_bits(first.metrics["accuracy"], second.metrics["accuracy"], "one model twice, the same rounds")


def test_the_cli_refuses_a_comparison_without_two_checkpoints_in_one_line():
    from dist_eval.config import EvalConfig

    for checkpoints in (["a.pt"], ["A=a.pt", "B=b.pt", "C=c.pt"]):
        with pytest.raises(UsageError) as e:
            EvalConfig(model=".", data_files=["x.csv"], checkpoint=checkpoints, stop_when_decided=True)
        assert e.value.param == "stop_when_decided" and "--checkpoint twice" in str(e.value)


def test_a_stopped_run_never_calls_evaluate_back(demo, monkeypatch):
    """One way in: each round is one exact evaluation (evaluation.evaluate_once), not a call back
    into the public evaluate() (which would dispatch to the rounds again)."""
    import dist_eval.evaluation as evaluation

    calls = []
    original = evaluation.evaluate
    monkeypatch.setattr(evaluation, "evaluate", lambda *a, **k: calls.append(1) or original(*a, **k))
    result = _stopped(demo, stop_at_width=0.1, bootstrap_resamples=0)
    assert result.metrics["stopping"]["rounds"] >= 1 and calls == []


def test_each_round_names_its_text_labels_as_the_whole_set_does(demo):
    """Text labels and a model without class names (a callable): every round's labels get the ids the
    whole set's sorted texts give them, also a round that holds only some of the texts (rounds of 2 rows,
    3 classes), so the rounds' rows and names are those of an evaluation of every row."""
    import datasets

    _, tokenizer, _, _ = demo
    texts = ["b", "c", "a", "c", "c", "b", "a", "c", "b", "c", "a", "b"]
    data = datasets.Dataset.from_dict({"text": [f"row {i} {t}" for i, t in enumerate(texts)], "label": texts})

    def model(input_ids):  # a fixed function of the tokens, three classes
        return torch.stack([input_ids.sum(1) % 3, input_ids.sum(1) % 5, input_ids.sum(1) % 7], 1).float()

    keywords = dict(tokenizer=tokenizer, num_labels=3, pad_token_id=tokenizer.pad_token_id, return_logits=True,
                    bootstrap_resamples=0)
    with one_thread():
        whole = evaluate(model, data, **keywords)
        rounds = evaluate(model, data, stop_at_width=1e-6, stop_round_rows=2, **keywords)
    assert rounds.metrics["stopping"]["rows_used"] == len(texts)
    assert rounds.metrics["label_names"] == whole.metrics["label_names"] == ["a", "b", "c"]
    np.testing.assert_array_equal(rounds.predictions.indices, whole.predictions.indices)
    np.testing.assert_array_equal(rounds.predictions.labels, [["a", "b", "c"].index(t) for t in texts])
