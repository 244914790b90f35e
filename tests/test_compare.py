"""``python -m dist_eval.compare OUT_A OUT_B`` on real output folders: two checkpoints
evaluated on the same data (local backend), and the refusals (exit 2, one line)."""
import json
import re
import runpy
import shutil
import sys
import warnings
from unittest import mock

import numpy as np
import pytest
from conftest import build_checkpoint, read_jsonl, write_csv
from inprocess_cli import run_cli_in_process

from dist_eval.compare import main as compare_main


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """Output folders: a and b (two checkpoints, the same 40 rows), small (other data)."""
    base = tmp_path_factory.mktemp("compare")
    data = write_csv(str(base / "data.csv"), 40, seed=31)
    other_data = write_csv(str(base / "other.csv"), 25, seed=32)
    out = {}
    for name, checkpoint_seed, rows in (("a", 1, data), ("b", 2, data), ("small", 1, other_data)):
        checkpoint = build_checkpoint(str(base / f"ck{checkpoint_seed}.pt"), seed=checkpoint_seed)
        out[name] = base / name
        code = run_cli_in_process(
            [
                "--model",
                tiny_model,
                "--data-files",
                rows,
                "--backend",
                "local",
                "--checkpoint",
                checkpoint,
                "--output-dir",
                str(out[name]),
                "--batch-size",
                "8",
                "--progress",
                "none",
                "--bootstrap-resamples",
                "200",
                "--quiet",
            ]
        )
        assert code == 0, name
    return out


def test_compare_prints_metric_differences_and_changed_rows(runs, capsys):
    assert compare_main([str(runs["a"]), str(runs["b"]), "--max-rows", "5"]) == 0
    out = capsys.readouterr().out
    ma, mb = (json.load(open(runs[k] / "metrics.json")) for k in ("a", "b"))
    for name in ("accuracy", "f1_macro", "f1_weighted", "loss"):
        line = re.search(rf"^  {name} +(\S+) +(\S+) +(\S+)", out, re.M)
        assert line, (name, out)
        a, b, diff = (float(x) for x in line.groups())
        assert (a, b) == (round(ma[name], 4), round(mb[name], 4))
        assert diff == pytest.approx(mb[name] - ma[name], abs=1e-4)
    ci = ma["confidence_intervals"]["accuracy"]
    assert f"[{ci[0]:.4f}, {ci[1]:.4f}]" in out  # A's interval beside the numbers
    # the changed rows: count, breakdown and the first ones listed, from the predictions themselves
    pa, pb = read_jsonl(runs["a"] / "predictions.jsonl"), read_jsonl(runs["b"] / "predictions.jsonl")
    changed = [(x["index"], x["label"], x["pred"], y["pred"]) for x, y in zip(pa, pb) if x["pred"] != y["pred"]]
    assert len(changed) > 5  # the two checkpoints disagree: the list is capped
    fixed = sum(1 for _, label, p, q in changed if p != label and q == label)
    broken = sum(1 for _, label, p, q in changed if p == label and q != label)
    assert f"predictions changed on {len(changed)} of 40 rows: {fixed} now right, {broken} now wrong" in out
    listed = [tuple(int(v) for v in m.groups()) for m in re.finditer(r"^  (\d+) +(\d+) +(\d+) +(\d+)$", out, re.M)]
    assert listed == changed[:5]
    assert f"... {len(changed) - 5} more" in out


def test_a_run_against_itself_changes_nothing(runs, capsys):
    assert compare_main([str(runs["a"]), str(runs["a"])]) == 0
    out = capsys.readouterr().out
    assert "predictions changed on 0 of 40 rows" in out
    assert re.search(r"^  accuracy +(\S+) +\1 +\+0\.0000", out, re.M)


def test_module_entry_point(runs, capsys):
    """``python -m dist_eval.compare A B``: the module run as ``__main__`` (as python -m runs it), here."""
    with mock.patch.object(sys, "argv", ["dist_eval.compare", str(runs["a"]), str(runs["b"])]), \
            pytest.raises(SystemExit) as ended, warnings.catch_warnings():
        # this process imported the module already (runpy warns of it); python -m has not
        warnings.filterwarnings("ignore", "'dist_eval.compare' found in sys.modules", RuntimeWarning)
        runpy.run_module("dist_eval.compare", run_name="__main__")
    out = capsys.readouterr().out
    assert ended.value.code == 0 and out.startswith("dist_eval.compare: A = ") and "predictions changed on" in out


def assert_refused(args, pattern, capsys):
    assert compare_main([str(a) for a in args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dist_eval.compare: error: "), captured.err
    assert re.search(pattern, lines[0]), lines[0]
    assert captured.out == ""


def test_refuses_runs_over_different_data(runs, tmp_path, capsys):
    """Runs that share no row's content; runs without content keys (before issue 52), paired by
    position, of other sizes."""
    assert_refused([runs["a"], runs["small"]], r"have no row in common .*: the runs are over different data", capsys)
    for name in ("a", "small"):
        shutil.copytree(runs[name], tmp_path / name)
        rows = [{k: v for k, v in row.items() if k != "key"}
                for row in read_jsonl(tmp_path / name / "predictions.jsonl")]
        (tmp_path / name / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert_refused([tmp_path / "a", tmp_path / "small"], r"has 40 samples and .* has 25: the runs are over different "
                   "datasets", capsys)


def test_refuses_same_size_but_different_labels(runs, tmp_path, capsys):
    edited = tmp_path / "edited"
    shutil.copytree(runs["a"], edited)
    rows = read_jsonl(edited / "predictions.jsonl")
    rows[3]["label"] = (rows[3]["label"] + 1) % 3
    (edited / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert_refused([runs["a"], edited], r"the labels differ on 1 of 40 rows \(first at index \[3\]\)", capsys)


def test_refuses_a_folder_that_is_not_a_run(runs, tmp_path, capsys):
    assert_refused(
        [runs["a"], tmp_path], r"missing metrics\.json and predictions\.jsonl \(not a finished dist_eval run\)", capsys
    )
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(runs["b"] / "metrics.json", partial / "metrics.json")
    assert_refused([partial, runs["b"]], r"partial.*: missing predictions\.jsonl", capsys)
    assert_refused([runs["a"], tmp_path / "nope"], r"nope: no such folder", capsys)


def test_paired_test_on_the_shared_rows(runs, tmp_path, capsys):
    """McNemar's exact p-value (scipy's binomial test of the discordant rows) and the paired
    bootstrap of B - A, printed and written to --json; the same seed gives the same file."""
    from scipy.stats import binomtest

    path = tmp_path / "paired.json"
    assert compare_main([str(runs["a"]), str(runs["b"]), "--json", str(path), "--bootstrap-resamples", "300"]) == 0
    out = capsys.readouterr().out
    paired = json.load(open(path))
    pa, pb = read_jsonl(runs["a"] / "predictions.jsonl"), read_jsonl(runs["b"] / "predictions.jsonl")
    a_only = sum(1 for x, y in zip(pa, pb) if x["pred"] == x["label"] != y["pred"])
    b_only = sum(1 for x, y in zip(pa, pb) if y["pred"] == y["label"] != x["pred"])
    m = paired["mcnemar"]
    assert (m["a_only"], m["b_only"], paired["shared_rows"]) == (a_only, b_only, 40)
    assert m["pvalue"] == pytest.approx(binomtest(a_only, a_only + b_only, 0.5).pvalue if a_only + b_only else 1.0)
    assert f"McNemar exact test of accuracy: p = {m['pvalue']:.4g}" in out
    ma, mb = (json.load(open(runs[k] / "metrics.json")) for k in ("a", "b"))
    boot = paired["bootstrap"]
    assert boot["resamples"] == 300
    for name in ("accuracy", "f1_macro", "loss"):
        assert boot[name]["difference"] == pytest.approx(mb[name] - ma[name], abs=1e-12)
        lo, hi = boot[name]["interval"]
        assert lo <= boot[name]["difference"] <= hi or lo == hi
        assert f"B-A {name:<12} {boot[name]['difference']:+.4f}   95% CI [{lo:+.4f}, {hi:+.4f}]" in out
    again = tmp_path / "again.json"
    assert compare_main([str(runs["a"]), str(runs["b"]), "--json", str(again), "--bootstrap-resamples", "300"]) == 0
    assert json.load(open(again)) == paired


def test_compare_shows_the_probability_scores(runs, capsys):
    assert compare_main([str(runs["a"]), str(runs["b"])]) == 0
    out = capsys.readouterr().out
    ma = json.load(open(runs["a"] / "metrics.json"))
    for name in ("ece", "brier", "top2_accuracy", "auroc_macro"):
        assert re.search(rf"^  {name} +{ma[name]:.4f} ", out, re.M), (name, out)


def test_compare_gives_the_minimum_detectable_effect_and_the_rows_for_an_effect(runs, tmp_path, capsys):
    """Issue 52: the power of the comparison (the MDE at the rows and discordance observed) printed
    and in --json; --rows-for-effect D: the rows D needs; a D the discordant rows cannot make: one line."""
    from dist_eval.power import minimum_detectable_effect, rows_for_effect

    path = tmp_path / "paired.json"
    assert compare_main([str(runs["a"]), str(runs["b"]), "--json", str(path), "--rows-for-effect", "0.05"]) == 0
    out = capsys.readouterr().out
    power = json.load(open(path))["power"]
    discordant = json.load(open(path))["mcnemar"]["discordant"]
    assert power["rows"] == 40 and power["discordance"] == discordant / 40
    mde = minimum_detectable_effect(40, discordant / 40)
    assert power["minimum_detectable_effect"] == mde and f"a difference in accuracy of {mde:.4f}" in out
    needed = rows_for_effect(0.05, discordant / 40)
    assert f"rows needed to detect a difference in accuracy of 0.05 with 80% power at level 0.05: {needed} " in out
    assert compare_main([str(runs["a"]), str(runs["b"]), "--rows-for-effect", "0.99"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dist_eval.compare: error: --rows-for-effect 0.99: expected a difference") and "\n" not in err


def _edited_copy(run, folder, order, extra=()):
    """A copy of a run's output whose rows are ``order`` of the original's (reindexed), plus ``extra`` rows."""
    folder.mkdir()
    rows = read_jsonl(run / "predictions.jsonl")
    kept = [dict(rows[i], index=place) for place, i in enumerate(order)]
    kept += [dict(row, index=len(kept) + k) for k, row in enumerate(extra)]
    metrics = json.load(open(run / "metrics.json"))
    metrics["num_samples"] = len(kept)
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / "predictions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in kept))
    return folder


def test_compare_pairs_rows_by_content_whatever_their_order(runs, tmp_path, capsys):
    """Issue 52: B's rows shuffled, 3 dropped, 2 of other content added: the 37 rows in both are
    paired by content (the same paired test as on those rows in order), the others counted, named
    in one warning and left out."""
    order = np.random.default_rng(0).permutation(40)
    dropped, kept = order[:3], order[3:]
    foreign = [dict(row, key=f"{k:016x}") for k, row in enumerate(read_jsonl(runs["b"] / "predictions.jsonl")[:2])]
    moved = _edited_copy(runs["b"], tmp_path / "moved", kept, foreign)
    assert compare_main([str(runs["a"]), str(moved), "--json", str(tmp_path / "p.json"), "--max-rows", "3"]) == 0
    said = capsys.readouterr()
    warning = said.err.strip()
    assert warning.startswith(f"dist_eval.compare: warning: 3 row(s) of {runs['a']} not in {moved} (index ")
    assert "2 row(s) of " in warning and "(index 37, 38)" in warning and "\n" not in warning
    paired = json.load(open(tmp_path / "p.json"))
    assert paired["shared_rows"] == 37 and paired["rows_only_in_a"] == {"count": 3, "first": sorted(dropped.tolist())}
    assert paired["rows_only_in_b"] == {"count": 2, "first": [37, 38]}
    in_order = _edited_copy(runs["b"], tmp_path / "in_order", np.sort(kept))
    same_a = _edited_copy(runs["a"], tmp_path / "a_kept", np.sort(kept))
    assert compare_main([str(same_a), str(in_order), "--json", str(tmp_path / "q.json")]) == 0
    expected = json.load(open(tmp_path / "q.json"))
    assert paired["mcnemar"] == expected["mcnemar"] and paired["bootstrap"] == expected["bootstrap"]
    assert "(40 and 39 samples, 37 in both, 3 classes)" in said.out and "index  index B" in said.out
    # the headline table holds each run's own report, on its own rows: no B - A there (it showed a difference of
    # other rows beside the paired one), said in a line
    accuracy = next(line for line in said.out.splitlines() if line.startswith("  accuracy "))
    assert accuracy.split()[3] == "-", accuracy
    assert "(A and B as each run reported them, on its own rows; B - A below is on the 37 rows in both)" in said.out


def test_compare_of_several_runs_with_holm_over_every_pair(runs, tmp_path, capsys):
    """compare A B C: each pair (3) with Holm over the 3; --baseline B: the 2 against B."""
    from dist_eval.paired import holm_adjusted

    c = _edited_copy(runs["a"], tmp_path / "c", np.arange(40)[::-1])  # A's rows reversed: the same as A
    path = tmp_path / "many.json"
    assert compare_main([str(runs["a"]), str(runs["b"]), str(c), "--json", str(path)]) == 0
    result = json.load(open(path))
    pairs = [(r["a"], r["b"]) for r in result["pairs"]]
    assert pairs == [(str(runs["a"]), str(runs["b"])), (str(runs["a"]), str(c)), (str(runs["b"]), str(c))]
    assert [r["pvalue_holm"] for r in result["pairs"]] == holm_adjusted([r["pvalue"] for r in result["pairs"]])
    assert result["pairs"][1]["difference"] == 0 and result["pairs"][1]["pvalue"] == 1.0
    assert "p adjusted by Holm for the 3 comparisons" in capsys.readouterr().out
    assert compare_main([str(runs["a"]), str(runs["b"]), str(c), "--baseline", str(runs["b"]), "--json",
                         str(path)]) == 0
    assert [(r["a"], r["b"]) for r in json.load(open(path))["pairs"]] == [(str(runs["b"]), str(runs["a"])),
                                                                        (str(runs["b"]), str(c))]
    capsys.readouterr()
    assert compare_main([str(runs["a"]), str(runs["b"]), str(c), "--rows-for-effect", "0.1"]) == 2
    assert "--rows-for-effect 0.1: expected two runs" in capsys.readouterr().err


def test_a_runs_summary_says_why_its_checkpoints_are_not_compared(tmp_path):
    """checkpoints_table: reports compare refuses (here: no report) give a line, not a failed run."""
    from types import SimpleNamespace

    from dist_eval.compare import checkpoints_table

    pairs = [SimpleNamespace(data=SimpleNamespace(name=None), folder=name) for name in ("c1", "c2")]
    compared, table = checkpoints_table(str(tmp_path), pairs)
    assert compared is None and table.startswith("  the checkpoints are not compared: ") and "no such folder" in table
