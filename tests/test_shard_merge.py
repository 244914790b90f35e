"""Separately launched shards (``--shard I/K``) merged into one run (``dist_eval.shard_merge``,
issue 53): on the built-in demo (a --limit sample, clustered by label), K = 1, 3 and 7 shards merge
into the report of one run over every row, bit for bit (metrics, intervals clustered and not, slices,
predictions.jsonl, per_class.csv, slices.csv), by ``python -m dist_eval.shard_merge``, ``python -m
dist_eval merge`` and ``python -m dist_eval.merge``; a shard on 2 ranks is the same shard on 1; the
merge's refusals name the shard; --partial counts what is missing; a killed shard resumes bit for
bit, and its rows in the row store are not evaluated again; the shard of a SLURM array task; early
stopping refused. The demo runs in the test process
(matplotlib hidden: the figures are the same function of the same metrics, and the most of a
small run's time), one shard under torchrun.
"""
import contextlib
import json
import os
import runpy
import shutil
import subprocess
import sys
import threading
import warnings
from unittest import mock

import numpy as np
import pytest
from conftest import REPO, run_ranks, write_csv
from float_promises import assert_same_bits, assert_within_rounding
from inprocess_cli import run_cli_in_process, without_modules
from thread_ranks import ThreadRanks

from dist_eval.config import EvalConfig, Options, settings_from, shard_from_slurm
from dist_eval.errors import UsageError, flag_names
from dist_eval.output.shard_files import MANIFEST, read_rows
from dist_eval.shard_merge import main as merge_main

# the demo's seeded sample of 400 of its 800 rows (half the forwards): the rows every shard draws alike
ROWS = 400
# clustered by label (the demo's one column beside its text: 4 clusters, one a label slice): every interval
# resamples clusters, as the merge's must too (issue 52)
FLAGS = ["--backend", "local", "--progress", "none", "--quiet", "--slice-by", "--bootstrap-resamples", "100",
         "--save-logits", "--save-text", "--limit", str(ROWS), "--cluster-by", "label"]
SAME_FILES = ("predictions.jsonl", "per_class.csv", "per_class.md", "slices.csv")


def demo(out, *extra) -> None:
    assert run_cli_in_process([*FLAGS, *extra, "--output-dir", str(out)], hide_modules=("matplotlib",)) == 0


def merge(folders, out, *extra, command="dist_eval.shard_merge") -> int:
    """The merge in this process, without matplotlib (as the runs: the same report, no figures), as
    ``python -m dist_eval.shard_merge``, or its documented forms ``python -m dist_eval merge`` and
    ``python -m dist_eval.merge`` (``command``: run as ``__main__``, as python -m runs them)."""
    argv = [*map(str, folders), "--output-dir", str(out), *extra]
    with mock.patch.dict(sys.modules, {"matplotlib": None}):
        if command == "dist_eval.shard_merge":
            return merge_main(argv)
        module, argv = ("dist_eval", ["merge", *argv]) if command == "dist_eval merge" else (command, argv)
        with mock.patch.object(sys, "argv", [module, *argv]), pytest.raises(SystemExit) as ended, \
                warnings.catch_warnings():
            # this process imported the modules already (runpy warns of it); python -m has not
            warnings.filterwarnings("ignore", "'dist_eval.*' found in sys.modules", RuntimeWarning)
            runpy.run_module(module, run_name="__main__")
        return ended.value.code


def assert_same_report(merged, whole, files=SAME_FILES) -> None:
    """Every metric, interval and slice of metrics.json bit for bit (not ``run``: times, ranks,
    the shards), and the rows' and tables' files byte for byte."""
    got, want = (json.loads((folder / "metrics.json").read_text()) for folder in (merged, whole))
    assert_same_bits({k: v for k, v in got.items() if k != "run"}, {k: v for k, v in want.items() if k != "run"},
                     "the merged shards' metrics against one run's (the same batches of one plan)")
    for name in files:
        assert (merged / name).read_bytes() == (whole / name).read_bytes(), name


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_cache):
    """The demo over every row, and its shards for K = 1, 3, 7 on one rank each (but shard 1/3:
    on two, by its test; on one in ``1of3-one-rank``); the module's tests run with the demo's cache."""
    with mock.patch.dict(os.environ, {"DIST_EVAL_CACHE": demo_cache}):
        base = tmp_path_factory.mktemp("shards")
        demo(base / "whole")
        shards = {}
        for count in (1, 3, 7):
            shards[count] = [base / f"{index}of{count}" for index in range(count)]
            for index, folder in enumerate(shards[count]):
                demo(folder if (index, count) != (1, 3) else base / "1of3-one-rank", "--shard", f"{index}/{count}")
        yield base, shards


def _merged_equals_the_whole_run(base, folders, out, command="dist_eval.shard_merge") -> None:
    rows = [read_rows(folder)["indices"] for folder in folders]
    assert sum(map(len, rows)) == ROWS and len(np.unique(np.concatenate(rows))) == ROWS  # each row in one shard
    assert merge(reversed(folders), out, command=command) == 0  # any order of the folders
    assert_same_report(out, base / "whole")
    clustering = json.loads((out / "metrics.json").read_text())["clustering"]
    assert clustering["clusters"] == 4 and clustering["unclustered_intervals"]["method"] == "bootstrap-percentile"
    run = json.loads((out / "metrics.json").read_text())["run"]
    assert [s["shard"] for s in run["shards"]] == [f"{i}/{len(folders)}" for i in range(len(folders))]
    assert run["per_rank_samples"] == [n for folder in folders for n in json.loads(
        (folder / "metrics.json").read_text())["run"]["per_rank_samples"]]


@pytest.mark.parametrize("count,command", [(1, "dist_eval merge"), (7, "dist_eval.merge")])
def test_the_shards_merge_into_one_run_of_the_whole_set(runs, count, command, tmp_path):
    """K = 1 and 7, merged by the issue's two commands, ``python -m dist_eval merge`` and
    ``python -m dist_eval.merge`` (the ranks' merge module, as a program: the shards' merge)."""
    base, shards = runs
    _merged_equals_the_whole_run(base, shards[count], tmp_path / "merged", command)


@pytest.mark.multiproc
def test_shards_on_one_and_two_ranks_merge_into_one_run(runs, tmp_path, demo_cache, rank_zygote):
    """N varies between shards: shard 1/3 on 2 ranks (forked: conftest's run_ranks; matplotlib hidden by a stub
    that fails to import) is its run on 1 rank, bit for bit (its clustered intervals too: issue
    52's exactness for any N); with 0/3 and 2/3 on one each, merged: the one run's report."""
    base, shards = runs
    path = os.pathsep.join([without_modules(tmp_path / "stub", "matplotlib"), REPO])
    proc = run_ranks(rank_zygote, [*FLAGS, "--shard", "1/3", "--output-dir", str(shards[3][1])], nproc=2,
                   env={"DIST_EVAL_CACHE": demo_cache, "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((shards[3][1] / "metrics.json").read_text())["run"]["world_size"] == 2
    assert_same_report(shards[3][1], base / "1of3-one-rank")
    assert_same_bits(read_rows(shards[3][1]), read_rows(base / "1of3-one-rank"), "shard 1/3 on 2 ranks and on 1")
    _merged_equals_the_whole_run(base, shards[3], tmp_path / "merged")


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("dist_eval: error: ") and "\n" not in err, err
    return err


def test_the_merge_refuses_in_one_line_naming_the_shard(runs, tmp_path, capsys):
    _, shards = runs
    seven = shards[7]
    assert merge(seven[:2] + seven[3:], tmp_path / "out") == 2
    assert "shard 2/7 missing" in _one_line_error(capsys)
    assert merge([*seven, seven[4]], tmp_path / "out") == 2
    assert f"shard 4/7 given twice: {seven[4]} and {seven[4]}" in _one_line_error(capsys)
    assert merge([*seven[:6], shards[1][0]], tmp_path / "out") == 2
    assert f"shard 0/1 ({shards[1][0]}): a shard of 1" in _one_line_error(capsys)
    other = tmp_path / "other"
    shutil.copytree(seven[6], other)
    manifest = json.loads((other / MANIFEST).read_text())
    manifest["report"]["bootstrap_resamples"] = 7
    (other / MANIFEST).write_text(json.dumps(manifest))
    assert merge([*seven[:6], other], tmp_path / "out") == 2
    assert f"shard 6/7 ({other}): another run than shard 0/7" in (err := _one_line_error(capsys))
    assert "bootstrap_resamples 7, not 100" in err
    manifest["report"]["bootstrap_resamples"] = 100
    manifest["named"]["settings"]["batch_size"], manifest["run_key"] = 7, "1" * 16  # another run key: named
    (other / MANIFEST).write_text(json.dumps(manifest))
    assert merge([*seven[:6], other], tmp_path / "out") == 2
    assert "batch_size 7, not 64" in _one_line_error(capsys)
    manifest["named"]["settings"]["batch_size"] = 64
    manifest["named"]["device"] = "cuda"  # a shard run on a GPU: its floats round otherwise
    (other / MANIFEST).write_text(json.dumps(manifest))
    assert merge([*seven[:6], other], tmp_path / "out") == 2
    assert "device 'cuda', not 'cpu'" in _one_line_error(capsys)
    manifest["named"]["device"] = "cpu"
    manifest["run_key"] = "0" * 16
    (other / MANIFEST).write_text(json.dumps(manifest))
    assert merge([*seven[:6], other], tmp_path / "out") == 2
    assert "run key 0000000000000000" in _one_line_error(capsys)
    manifest["rows_key"] = "0" * 16  # the files in another order, no --limit sample: the rows in another order
    (other / MANIFEST).write_text(json.dumps(manifest))
    assert merge([*seven[:6], other], tmp_path / "out") == 2
    assert "other rows, or the same in another order" in _one_line_error(capsys)
    shutil.rmtree(other)  # a shard run under another torch: the same run key, other floats maybe
    shutil.copytree(seven[6], other)
    metrics = json.loads((other / "metrics.json").read_text())
    installed, metrics["run"]["versions"]["torch"] = metrics["run"]["versions"]["torch"], "0.0"
    (other / "metrics.json").write_text(json.dumps(metrics))
    assert merge([*seven[:6], other], tmp_path / "out") == 2
    assert f"shard 6/7 ({other}): another run than shard 0/7" in (err := _one_line_error(capsys))
    assert f"torch 0.0, not {installed}" in err
    # a shard run by other dist_eval code (the same version number: the version carries the code's digest)
    from dist_eval.backends.provenance import dist_eval_version

    assert metrics["run"]["versions"]["dist_eval"] == dist_eval_version()
    metrics["run"]["versions"]["torch"] = installed
    metrics["run"]["versions"]["dist_eval"] = dist_eval_version().split("+")[0] + "+src.000000000000"
    (other / "metrics.json").write_text(json.dumps(metrics))
    assert merge([*seven[:6], other], tmp_path / "out") == 2
    assert f"dist_eval {dist_eval_version().split('+')[0]}+src.000000000000, not {dist_eval_version()}" in \
        _one_line_error(capsys)
    for damage in ("shard.npz cut", "shard.npz", "metrics.json"):  # copied in part: one line, nothing written
        shutil.rmtree(other)
        shutil.copytree(seven[6], other)
        if damage == "shard.npz cut":
            data = (other / "shard.npz").read_bytes()
            (other / "shard.npz").write_bytes(data[: len(data) // 2])
        else:
            (other / damage).unlink()
        assert merge([*seven[:6], other], tmp_path / "damaged") == 2, damage
        assert f"{other}: shard 6/7's files cannot be read" in _one_line_error(capsys), damage
        assert not (tmp_path / "damaged").exists(), damage
    (other / MANIFEST).unlink()  # killed before its end: no shard.json
    assert merge([*seven[:6], other], tmp_path / "out") == 2
    assert f"{other}: unfinished shard" in _one_line_error(capsys)
    assert not (tmp_path / "out" / "metrics.json").exists()
    assert merge(seven, seven[0]) == 2  # into a shard's own folder
    assert f"--output-dir {seven[0]}: {seven[0]} holds a shard" in _one_line_error(capsys)
    assert (seven[0] / MANIFEST).exists()


def test_a_shard_from_before_a_fact_was_recorded_is_named_by_what_differs():
    """The review's finding: a manifest written before the device was recorded, beside one with it and other
    settings, was refused for its 'device None'. A name one shard lacks is not compared; the versions are compared
    between the shards that record them, the first of those against each later one."""
    from types import SimpleNamespace

    from dist_eval.errors import UsageError
    from dist_eval.shard_merge import _differs, check_versions

    named = {"model": "m", "checkpoint": None, "head": None, "data_files": ["d"], "split": None, "backend": "local",
             "settings": {"batch_size": 64}}
    old = {"rows_key": "r", "run_key": "a", "report": {}, "named": named}
    new = {**old, "run_key": "b", "named": {**named, "settings": {"batch_size": 7}, "device": "cpu"}}
    assert _differs(old, new) == "batch_size 7, not 64" and _differs(new, old) == "batch_size 64, not 7"
    shards = [SimpleNamespace(index=i, count=3, folder=f"s{i}") for i in range(3)]
    runs = [{"run": {"versions": {"torch": torch}}} for torch in (None, "2.13.0", "2.12.0")]
    with pytest.raises(UsageError) as refused:
        check_versions(shards, runs)
    assert "shard 2/3 (s2): another run than shard 1/3 (s1): torch 2.12.0, not 2.13.0" in str(refused.value)
    check_versions(shards, runs[:2] + [{"run": {}}])  # a shard that records none: not compared
    tokenized = [{"run": {"versions": {"torch": "2.13.0", "tokenizers": tokenizers}}} for tokenizers in ("0.22.1",) * 2
                 + ("0.21.0",)]  # the resume key's libraries, which the shards' key leaves to this check
    with pytest.raises(UsageError, match=r"shard 2/3 \(s2\): another run than shard 0/3 \(s0\): tokenizers 0\.21\.0"):
        check_versions(shards, tokenized)


def test_shards_given_the_files_in_another_order_merge_into_one_run(tiny_model, tiny_checkpoint, tmp_path):
    """A --limit sample is in the rows' content order, whatever the files' order: shard 1/2 given the
    files the other way round still merges with shard 0/2 into one run's report (the tiny model),
    clustered intervals too (--cluster-by: the same for any order of the files)."""
    first, second = (write_csv(str(tmp_path / f"{name}.csv"), 30, seed=seed) for name, seed in (("a", 1), ("b", 2)))
    flags = ["--model", tiny_model, "--checkpoint", tiny_checkpoint, "--backend", "local", "--progress", "none",
             "--quiet", "--bootstrap-resamples", "50", "--save-logits", "--batch-size", "4", "--limit", "59",
             "--cluster-by", "label"]
    for out, files, shard in (("whole", (first, second), []), ("s0", (first, second), ["--shard", "0/2"]),
                              ("s1", (second, first), ["--shard", "1/2"])):
        assert run_cli_in_process([*flags, "--data-files", *files, *shard, "--output-dir", str(tmp_path / out)],
                                  hide_modules=("matplotlib",)) == 0
    assert merge([tmp_path / "s0", tmp_path / "s1"], tmp_path / "merged") == 0
    assert_same_report(tmp_path / "merged", tmp_path / "whole", files=("predictions.jsonl", "per_class.csv"))
    assert json.loads((tmp_path / "merged" / "metrics.json").read_text())["clustering"]["clusters"] == 3


def test_shards_of_files_whose_cluster_or_slice_column_differs_are_refused(tiny_model, tiny_checkpoint, tmp_path,
                                                                           capsys):
    """The same rows (text and label) in two files whose --cluster-by / --slice-by column differs: the rows' content
    key is the same, and the merge took shard 0/2 of one and 1/2 of the other, a report of neither (its intervals
    from clusters of both): refused in one line naming the columns. The same rows and names from a CSV (integers)
    and a JSON lines file (texts) merge: the slices and clusters are the same."""
    base = write_csv(str(tmp_path / "base.csv"), 24, seed=3)
    lines = open(base).read().splitlines()
    for name, groups in (("a", 3), ("b", 5)):
        with open(tmp_path / f"{name}.csv", "w") as f:
            f.write("\n".join([lines[0] + ",topic", *(f"{line},{i % groups}" for i, line in enumerate(lines[1:]))]))
    with open(tmp_path / "a.jsonl", "w") as f:
        for i, line in enumerate(lines[1:]):
            text, label = line.rsplit(",", 1)
            f.write(json.dumps({"text": text, "label": int(label), "topic": str(i % 3)}) + "\n")
    flags = ["--model", tiny_model, "--checkpoint", tiny_checkpoint, "--backend", "local", "--progress", "none",
             "--quiet", "--bootstrap-resamples", "20", "--batch-size", "4", "--cluster-by", "topic", "--slice-by",
             "topic"]
    for out, data, shard in (("a0", "a.csv", "0/2"), ("a1", "a.jsonl", "1/2"), ("b1", "b.csv", "1/2")):
        assert run_cli_in_process([*flags, "--data-files", str(tmp_path / data), "--shard", shard,
                                   "--output-dir", str(tmp_path / out)], hide_modules=("matplotlib",)) == 0
    capsys.readouterr()
    assert merge([tmp_path / "a0", tmp_path / "b1"], tmp_path / "mixed") == 2
    assert "other values in the --slice-by / --cluster-by columns" in _one_line_error(capsys)
    assert merge([tmp_path / "a0", tmp_path / "a1"], tmp_path / "merged") == 0, capsys.readouterr().err


def test_partial_reports_what_it_has_and_counts_what_is_missing(runs, tmp_path, capsys):
    _, shards = runs
    seven = shards[7]
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    assert merge([*seven[:2], unfinished, *seven[3:]], tmp_path / "out", "--partial") == 0
    out = capsys.readouterr()
    missing = len(read_rows(seven[2])["indices"])
    assert f"PARTIAL report: {ROWS - missing} of {ROWS} rows ({missing} missing; shards missing: 2/7)" in out.out
    assert "left out" in out.err
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["partial"] == {"rows": ROWS - missing, "rows_in_set": ROWS, "missing_rows": missing,
                                  "missing_shards": ["2/7"]}
    assert metrics["num_samples"] == ROWS - missing
    assert len((tmp_path / "out" / "predictions.jsonl").read_text().splitlines()) == ROWS - missing


def _killed_after(monkeypatch, batches: int) -> None:
    """The shard's loop fails after ``batches`` batches (its finished ones stored, as a kill leaves them)."""
    from dist_eval.known import KnownLogits

    took, done = KnownLogits.took, []

    def failing(self, *args):
        took(self, *args)
        done.append(1)
        if len(done) == batches:
            raise RuntimeError("killed (test)")

    monkeypatch.setattr(KnownLogits, "took", failing)


def test_a_killed_shard_resumes_and_pays_no_stored_row_again(runs, tmp_path, monkeypatch):
    """Shard 0/3 killed after its first batch: rerun, it resumes from its partial results (the same
    bits as its uninterrupted run); with the row store, the rows it finished come from the store
    and only the others are evaluated."""
    _, shards = runs
    done = read_rows(shards[3][0])
    for store in ("off", str(tmp_path / "rows")):
        out = tmp_path / f"store-{os.path.basename(store)}"
        flags = [*FLAGS, "--shard", "0/3", "--save-interval", "0", "--in-flight", "1", "--row-store", store,
                 "--output-dir", str(out)]
        with monkeypatch.context() as patch:
            _killed_after(patch, 1)
            assert run_cli_in_process(flags, hide_modules=("matplotlib",)) == 1
        assert not (out / MANIFEST).exists()
        assert run_cli_in_process(flags, hide_modules=("matplotlib",)) == 0
        run = json.loads((out / "metrics.json").read_text())["run"]
        if store == "off":
            assert 0 < run["resumed_samples"] < len(done["indices"])
            assert_same_bits(read_rows(out), done, "a resumed shard against its uninterrupted run")
        else:
            reused = run["row_store"]["rows_from_store"]
            evaluated = run["row_store"]["rows_evaluated"]
            assert reused > 0 and evaluated > 0 and reused + evaluated == len(done["indices"])
            assert run["resumed_samples"] == 0  # the store serves them: the plan of the others is another
            assert_within_rounding(read_rows(out), done, "the shard with stored rows against its run",
                                   why="the rows the store did not hold are planned into batches of their own")


def test_the_shard_of_a_slurm_array_task_and_the_refusals():
    env = {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_COUNT": "3"}
    assert shard_from_slurm(env) == "1/3"  # --array=4-6: ids need not start at 0
    assert shard_from_slurm({**env, "SLURM_ARRAY_TASK_ID": "8", "SLURM_ARRAY_TASK_STEP": "2"}) == "2/3"
    assert shard_from_slurm({}) is None
    with flag_names(), pytest.raises(UsageError, match=r"--shard: cannot tell .*SLURM_ARRAY_TASK_ID=9.* Pass --shard"):
        shard_from_slurm({**env, "SLURM_ARRAY_TASK_ID": "9"})  # --array=4,5,9: not one range
    assert Options(shard=(2, 7)).shard == "2/7" and Options(shard="0/1").shard_part == (0, 1)
    for bad in ("3/3", "1", "a/b", "-1/2", 3):
        with flag_names(), pytest.raises(UsageError, match=r"--shard .*expected I/K"):
            EvalConfig(shard=bad)
    with flag_names(), pytest.raises(UsageError, match=r"--shard 0/2: a run that stops early .* Drop --stop-at-width"):
        EvalConfig(shard="0/2", stop_at_width=0.1)
    with pytest.raises(UsageError, match=r"shard='0/2'.*stop_at_width"):
        settings_from({"shard": "0/2", "stop_when_decided": False, "stop_at_width": 0.1})
    import torch

    from dist_eval import evaluate, ranks

    loader = torch.utils.data.DataLoader([{"input_ids": torch.tensor([1, 2]), "labels": torch.tensor(0)}])
    with pytest.raises(ranks.RankFailure, match=r"shard='0/2': a shard is a part of a Dataset's batch plan"):
        evaluate(lambda ids: torch.zeros(len(ids), 2), loader, num_labels=2, shard="0/2")  # before any forward


def test_a_shard_without_rows_is_refused_before_any_forward(demo_cache, tmp_path, monkeypatch, capsys):
    """40 rows are 2 batches: shards 2 to 6 of 7 would be empty (their metrics undefined), and the split could never
    merge: every shard of it, 0/7 too (it ran, and the array's other tasks with it), refused in one line, exit 2."""
    monkeypatch.setenv("DIST_EVAL_CACHE", demo_cache)
    for shard in ("6/7", "0/7"):
        flags = ["--backend", "local", "--progress", "none", "--quiet", "--limit", "40", "--shard", shard]
        assert run_cli_in_process([*flags, "--output-dir", str(tmp_path)], hide_modules=("matplotlib",)) == 2
        assert _one_line_error(capsys) == (
            f"dist_eval: error: --shard {shard}: the set's batch plan has 2 batch(es), so shards 2 to 6 of 7 would "
            "hold no row: expected at most 2 shards. Split it into fewer (K <= 2).")


def test_dist_eval_merge_is_the_shards_merge(monkeypatch):
    """``dist-eval merge ARGS`` hands this process to ``python -m dist_eval.shard_merge ARGS``."""
    from dist_eval import launcher

    class Exec(Exception):
        pass

    def execv(path, argv):
        raise Exec(path, argv)

    monkeypatch.setattr(os, "execv", execv)
    with pytest.raises(Exec) as handed:
        launcher.main(["merge", "s0", "s1", "--output-dir", "out"])
    assert handed.value.args == (sys.executable, [sys.executable, "-m", "dist_eval.shard_merge", "s0", "s1",
                                                  "--output-dir", "out"])


def test_the_array_and_merge_scripts_refuse_in_one_line(tmp_path):
    """launch/slurm_array.sbatch outside an array, or given --output-dir; launch/slurm_merge.sbatch
    without a shard: exit 2 and one line (the array on a real SLURM: tests/test_slurm.py)."""
    def script(name, *args, **env):
        proc = subprocess.run(["bash", os.path.join(REPO, "launch", name), *args], capture_output=True, text=True,
                              env={"PATH": os.environ["PATH"], "DIST_EVAL_ROOT": REPO, **env}, timeout=30)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        return proc.stderr

    assert "expected an array task with OUT set" in script("slurm_array.sbatch", OUT=str(tmp_path))
    assert "--output-dir is OUT/shard-<task id>" in script("slurm_array.sbatch", "--output-dir", "x",
                                                           OUT=str(tmp_path), SLURM_ARRAY_TASK_ID="3")
    assert f"no shard folder in {tmp_path}" in script("slurm_merge.sbatch", OUT=str(tmp_path))


def test_a_long_tailed_set_splits_the_same_for_any_ranks_in_a_shard(tmp_path, monkeypatch):
    """2,000 long-tailed rows (the GPU benchmark's data, some truncated), a token budget: for K = 1, 3, 7
    the shards' batches partition the whole plan's, each with its id, rows and token ids, on 1 rank
    or on 2 (threads); the truncated rows are counted once, by the shard that holds them."""
    import datasets
    from transformers import AutoTokenizer

    from dist_eval import ranks
    from dist_eval.config import Settings
    from dist_eval.data.shard import dataset_batches

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import bench_gpu

    data = bench_gpu.make_data(str(tmp_path / "data"), 2000, 17)
    bench_gpu.save_tokenizer(str(tmp_path / "model"), data["vocab"])
    tokenizer, dataset = AutoTokenizer.from_pretrained(str(tmp_path / "model")), datasets.load_from_disk(
        str(tmp_path / "data"))
    labels, settings = np.array(dataset["label"]), Settings(batch_size=32, max_batch_tokens=2048, max_length=96)

    def batches(shard=None):
        found, truncated, _ = dataset_batches(dataset, tokenizer, labels, settings, pad_token_id=0, prefix_tokens=8,
                                              shard=shard)
        return {b: (rows.tolist(), padded.tolist()) for b, rows, padded, _ in found}, truncated

    whole, truncated_whole = batches()
    assert truncated_whole > 0
    two = ThreadRanks(2)
    for count in (1, 3, 7):
        parts = [batches((index, count)) for index in range(count)]
        assert {b: batch for part, _ in parts for b, batch in part.items()} == whole
        assert sum(len(part) for part, _ in parts) == len(whole)
        assert sum(truncated for _, truncated in parts) == truncated_whole
        with monkeypatch.context() as patch:
            for name in ("all_gather_object", "exchange_objects"):
                patch.setattr(ranks, name, getattr(two, name))
            patch.setattr(ranks, "get_rank", two.rank)
            patch.setattr(ranks, "get_world_size", lambda: 2)
            patch.setattr(ranks, "phase", lambda name: contextlib.nullcontext())
            index, results = count // 2, [None, None]

            def run(rank, shard, results):
                two.local.rank = rank
                results[rank] = batches(shard)

            threads = [threading.Thread(target=run, args=(rank, (index, count), results)) for rank in (0, 1)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
        assert all(results), "a rank failed"
        (first, truncated0), (second, truncated1) = results
        assert not set(first) & set(second) and {**first, **second} == parts[index][0]
        assert truncated0 + truncated1 == parts[index][1]


def test_a_requeued_slurm_job_takes_over_its_earlier_runs_lock_on_any_node(tmp_path, monkeypatch, capsys):
    """A requeued array task may land on another node: the lock its earlier run left (the same job id,
    fewer restarts) is taken over; another job's lock on another host is not."""
    from dist_eval.output.files import LOCK_NAME, hold_output_dir, release_output_dirs

    lock = tmp_path / LOCK_NAME
    lock.write_text(json.dumps({"host": "another-node", "pid": 1, "since": "then", "slurm_job": "77",
                                "restarts": None}))
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(UsageError, match="in use by another run \\(host another-node"):
        hold_output_dir(str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    try:
        hold_output_dir(str(tmp_path))
        assert json.loads(lock.read_text())["restarts"] == "1"
    finally:
        release_output_dirs()
    assert "taking over the lock of a run that died" in capsys.readouterr().err
