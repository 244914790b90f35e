"""Several sets and checkpoints in one run (dist_eval.plan, dist_eval.pipeline): each (checkpoint, set) pair's
report equals a separate single run of that pair (bitwise logits, N = 1 and 2), the summary
table equals the pairs' metrics.json, the model is loaded once, a run stopped between pairs
re-runs only the unfinished ones, and malformed flags fail in one line naming the flag.

No test here looks at a figure: every run is without matplotlib (hidden; the figures are the same
function of the same metrics, and most of a small pair's report time)."""
import contextlib
import json
import os
import re
from unittest import mock

import pytest
from conftest import REPO, build_checkpoint, read_jsonl, run_ranks, swarm_server_pids, write_csv
from inprocess_cli import one_thread, run_cli_in_process, without_modules

PAIRS = [("c1", "dev"), ("c1", "test"), ("c2", "dev"), ("c2", "test")]
NO_FIGURES = ("matplotlib",)  # run_cli_in_process's hide_modules


def no_figures_env(folder) -> dict:
    """run_cli's env for a launched run without matplotlib (hidden under ``folder``)."""
    hidden = without_modules(folder, "matplotlib")
    return {"PYTHONPATH": os.pathsep.join(p for p in (hidden, REPO, os.environ.get("PYTHONPATH")) if p)}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("jobs")
    dev = write_csv(str(base / "dev.csv"), 13, seed=31)
    test_a, test_b = write_csv(str(base / "test_a.csv"), 9, seed=32), write_csv(str(base / "test_b.csv"), 8, seed=33)
    c1 = build_checkpoint(str(base / "c1.pt"), seed=3)
    c2 = build_checkpoint(str(base / "c2.pt"), seed=4)
    return {"base": base, "sets": {"dev": [dev], "test": [test_a, test_b]}, "checkpoints": {"c1": c1, "c2": c2}}


def common(tiny_model, out):
    return ["--model", tiny_model, "--backend", "local", "--batch-size", "4", "--save-logits",
            "--bootstrap-resamples", "100", "--output-dir", str(out)]


def multi_args(tiny_model, assets, out):
    sets = [f"{name}={','.join(files)}" for name, files in assets["sets"].items()]
    return [*common(tiny_model, out), "--data-files", *sets,
            "--checkpoint", assets["checkpoints"]["c1"], "--checkpoint", assets["checkpoints"]["c2"]]


@pytest.fixture(scope="module")
def singles(tiny_model, assets):
    """Each pair as a separate single run (one process)."""
    out = {}
    for ck, name in PAIRS:
        folder = assets["base"] / f"single_{ck}_{name}"
        args = [*common(tiny_model, folder), "--data-files", *assets["sets"][name],
                "--checkpoint", assets["checkpoints"][ck]]
        with one_thread():
            assert run_cli_in_process(args, hide_modules=NO_FIGURES) == 0
        out[(ck, name)] = folder
    return out


def counting_loads():
    """A patch counting load_model calls (the model load, which also connects to a swarm)."""
    import dist_eval.backends
    from dist_eval.backends.arguments import LoadOptions

    calls = []
    real = dist_eval.backends.load_model

    def load_model(backend, model_dir, options=None, **keywords):
        calls.append(LoadOptions.of(options, keywords).checkpoint)  # the CLI passes its flags as one options object
        return real(backend, model_dir, options, **keywords)

    return mock.patch.object(dist_eval.backends, "load_model", load_model), calls


@pytest.fixture(scope="module")
def multi_n1(tiny_model, assets):
    out = assets["base"] / "multi_n1"
    patch, loads = counting_loads()
    with patch, one_thread():
        assert run_cli_in_process(multi_args(tiny_model, assets, out), hide_modules=NO_FIGURES) == 0
    return out, loads


@pytest.fixture(scope="module")
def multi_n2(tiny_model, assets, rank_zygote):
    out = assets["base"] / "multi_n2"  # two ranks forked (conftest's run_ranks): the runs' results are tested
    proc = run_ranks(rank_zygote, multi_args(tiny_model, assets, out), nproc=2,
                     env=no_figures_env(assets["base"] / "hidden"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def without_run(metrics):
    return {k: v for k, v in metrics.items() if k != "run"}


def assert_pairs_equal_singles(out, singles):
    for ck, name in PAIRS:
        folder = out / ck / name
        assert read_jsonl(folder / "predictions.jsonl") == read_jsonl(singles[(ck, name)] / "predictions.jsonl")
        metrics = json.load(open(folder / "metrics.json"))
        assert without_run(metrics) == without_run(json.load(open(singles[(ck, name)] / "metrics.json")))
        assert metrics["run"]["pair"]["checkpoint"] == ck and metrics["run"]["pair"]["set"] == name
        assert os.path.isfile(folder / "report.html") and not os.path.exists(folder / "partial")


def test_each_pair_equals_its_single_run_n1(multi_n1, singles):
    assert_pairs_equal_singles(multi_n1[0], singles)


@pytest.mark.multiproc
def test_each_pair_equals_its_single_run_n2(multi_n2, singles):
    out, proc = multi_n2
    assert_pairs_equal_singles(out, singles)
    assert proc.stdout.count("one model load") == 1  # rank 0 alone prints
    # the model was loaded once, before the pairs: each pair's own phases do not include it
    for ck, name in PAIRS:
        run = json.load(open(out / ck / name / "metrics.json"))["run"]
        assert "loading the model" in run["pair"]["shared_phase_seconds"]
        assert "loading the model" not in run["phase_seconds"]
        assert run["world_size"] == 2
    assert len(re.findall(r"loading the checkpoint", json.dumps([
        json.load(open(out / ck / name / "metrics.json"))["run"]["phase_seconds"] for ck, name in PAIRS]))) == 1


def test_the_model_is_loaded_once(multi_n1, assets):
    _, loads = multi_n1
    assert loads == [assets["checkpoints"]["c1"]]


def test_summary_equals_the_pairs_metrics(multi_n1):
    out, _ = multi_n1
    summary = json.load(open(out / "summary.json"))["pairs"]
    assert [(p["checkpoint"], p["set"]) for p in summary] == PAIRS
    table = open(out / "summary.md").read()
    for row in summary:
        metrics = json.load(open(out / row["folder"] / "metrics.json"))
        assert row["rows"] == metrics["num_samples"]
        for name in ("accuracy", "f1_macro", "loss"):
            assert row[name] == metrics[name]
            assert row["confidence_intervals"][name] == metrics["confidence_intervals"][name]
            lo, hi = metrics["confidence_intervals"][name]
            assert f"{metrics[name]:.4f} [{lo:.4f}, {hi:.4f}]" in table
    assert len([line for line in table.splitlines() if line.startswith("| c") and "checkpoint" not in line]) == 4


def test_resume_reruns_only_the_unfinished_pairs(tiny_model, assets, singles, tmp_path, capsys):
    """Stopped (as by SIGINT) while writing the 3rd pair's report: the same command again skips
    the 2 finished pairs, resumes the 3rd from its stored batches and runs the 4th."""
    import dist_eval.output.report

    out = tmp_path / "out"
    real, calls = dist_eval.output.report.write_report, []

    def stopped_at_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    with mock.patch.object(dist_eval.output.report, "write_report", stopped_at_the_third), one_thread():
        assert run_cli_in_process(multi_args(tiny_model, assets, out), hide_modules=NO_FIGURES) == 130
    assert os.path.isfile(out / "c1" / "test" / "metrics.json")
    assert not os.path.exists(out / "c2" / "dev" / "metrics.json")
    assert os.path.isdir(out / "c2" / "dev" / "partial") and not os.path.exists(out / "summary.json")
    capsys.readouterr()
    patch, loads = counting_loads()
    with patch, one_thread():
        assert run_cli_in_process(multi_args(tiny_model, assets, out), hide_modules=NO_FIGURES) == 0
    stdout = capsys.readouterr().out
    assert stdout.count("already finished") == 2 and loads == [assets["checkpoints"]["c1"]]
    resumed = {(ck, name): json.load(open(out / ck / name / "metrics.json"))["run"].get("resumed_samples")
               for ck, name in PAIRS[2:]}
    assert resumed[("c2", "dev")] == 13 and not resumed[("c2", "test")]
    assert_pairs_equal_singles(out, singles)
    assert len(json.load(open(out / "summary.json"))["pairs"]) == 4


def test_one_plural_dimension_has_one_folder_level(tiny_model, assets, tmp_path, capsys):
    sets_only = tmp_path / "sets"
    args = [*common(tiny_model, sets_only), "--checkpoint", assets["checkpoints"]["c1"],
            "--data-files", f"dev={assets['sets']['dev'][0]}", f"test={','.join(assets['sets']['test'])}"]
    with one_thread():
        assert run_cli_in_process(args, hide_modules=NO_FIGURES) == 0
    assert sorted(os.listdir(sets_only)) == ["dev", "summary.json", "summary.md", "test"]
    ckpts_only = tmp_path / "ckpts"
    args = [*common(tiny_model, ckpts_only), "--data-files", assets["sets"]["dev"][0],
            "--checkpoint", assets["checkpoints"]["c1"], "--checkpoint", f"second={assets['checkpoints']['c2']}"]
    with one_thread():
        assert run_cli_in_process(args, hide_modules=NO_FIGURES) == 0
    assert sorted(os.listdir(ckpts_only)) == ["c1", "second", "summary.json", "summary.md"]
    summary = json.load(open(ckpts_only / "summary.json"))["pairs"]
    assert [(p["checkpoint"], p["set"], p["folder"]) for p in summary] == [("c1", None, "c1"),
                                                                             ("second", None, "second")]
    assert (json.load(open(ckpts_only / "second" / "metrics.json"))["num_samples"]
            == json.load(open(sets_only / "dev" / "metrics.json"))["num_samples"] == 13)


def test_plan_layouts():
    from dist_eval.plan import parse_plan

    plain = parse_plan(["a.csv", "b.csv"], ["ck.pt"])
    assert not plain.several and [p.folder for p in plain.pairs()] == [""]
    assert plain.pairs()[0].data.files == ("a.csv", "b.csv") and plain.pairs()[0].checkpoint.path == "ck.pt"
    assert not parse_plan(["a.csv"], None).several
    both = parse_plan(["dev=d.csv", "test=t1.csv,t2.csv"], ["x/e1.pt", "best=y/e9.pt"])
    assert [p.folder for p in both.pairs()] == ["e1/dev", "e1/test", "best/dev", "best/test"]
    assert both.sets[1].files == ("t1.csv", "t2.csv") and both.checkpoints[1].path == "y/e9.pt"
    assert [p.folder for p in parse_plan(["dev=d.csv"], None).pairs()] == ["dev"]
    assert [p.folder for p in parse_plan(["d.csv"], ["n=ck.pt"]).pairs()] == ["n"]


def test_several_checkpoints_need_model_and_data():
    from dist_eval.config import EvalConfig
    from dist_eval.errors import UsageError, flag_names

    with pytest.raises(UsageError) as caught:
        EvalConfig(checkpoint=["a.pt", "b.pt"])
    with flag_names():
        assert str(caught.value).startswith("--checkpoint: several or named checkpoints need --model and --data-files")


def test_an_existing_path_with_equals_is_a_path(tmp_path):
    from dist_eval.plan import parse_plan

    folder = tmp_path / "split=test"
    folder.mkdir()
    assert not parse_plan([str(folder)], None).several


@pytest.mark.parametrize("flags, pattern", [
    (["--data-files", "dev={d}", "dev={d}"], r"--data-files dev: the name 'dev' is given twice"),
    (["--data-files", "dev={d}", "test="], r"--data-files test=: expected NAME=FILE\[,FILE...\].*'test' has no FILE"),
    (["--data-files", "dev={d}", "{d}"], r"--data-files .*mixes named sets \(NAME=FILE\) with the plain file"),
    (["--data-files", "a/b={d}"], r"--data-files a/b=.*'a/b' cannot name one"),
    (["--data-files", "{d}", "--checkpoint", "{c1}", "--checkpoint", "x=", "--checkpoint", "{c2}"],
     r"--checkpoint x=: expected NAME=FILE.*'x' has no FILE"),
    (["--data-files", "{d}", "--checkpoint", "{c1}", "--checkpoint", "{c1}"],
     r"--checkpoint c1: the name 'c1' is given twice.*--checkpoint NAME=FILE"),
    (["--data-files", "{d}", "--checkpoint", "{c1}", "--checkpoint", "{p5}"],
     r"--checkpoint .*p5.pt: tuning mode ptune, 5 prompt vector\(s\), 3 classes, but the model is loaded for "
     r"tuning mode ptune, 3 prompt vector\(s\), 3 classes"),
])
def test_bad_flags_fail_in_one_line(tiny_model, assets, tmp_path, capsys, flags, pattern):
    p5 = build_checkpoint(str(tmp_path / "p5.pt"), pre_seq_len=5)
    values = {"d": assets["sets"]["dev"][0], "c1": assets["checkpoints"]["c1"], "c2": assets["checkpoints"]["c2"],
              "p5": p5}
    args = ["--model", tiny_model, "--backend", "local", "--output-dir", str(tmp_path / "out"),
            *[f.format(**values) for f in flags]]
    assert run_cli_in_process(args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dist_eval: error:")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), errors
    assert not os.path.exists(tmp_path / "out" / "summary.json")


def servers_of(model_dir):
    found = []
    for pid in swarm_server_pids():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if model_dir.encode() in f.read().split(b"\0"):
                found.append(pid)
    return found


@pytest.mark.swarm
@pytest.mark.multiproc
def test_on_a_swarm_started_once(tiny_model, assets, tmp_path, rank_zygote):
    """petals, N=2, a local swarm started by the run (once) for 2 deep_ptune checkpoints x 2 sets:
    each pair's logits equal the local backend's single run of that pair, bit for bit."""
    checkpoints = {name: build_checkpoint(str(tmp_path / f"{name}.pt"), tuning_mode="deep_ptune", seed=seed)
                   for name, seed in (("c1", 5), ("c2", 6))}
    sets = [f"{name}={','.join(files)}" for name, files in assets["sets"].items()]
    out = tmp_path / "petals"
    args = ["--model", tiny_model, "--batch-size", "4", "--save-logits", "--bootstrap-resamples", "100",
            "--output-dir", str(out), "--local-servers", "2", "--data-files", *sets,
            "--checkpoint", checkpoints["c1"], "--checkpoint", checkpoints["c2"]]
    before = set(servers_of(tiny_model))  # a swarm the session shares may serve the same model
    proc = run_ranks(rank_zygote, args, nproc=2, timeout=600, env=no_figures_env(tmp_path / "hidden"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("starting a local swarm") == 1 and proc.stdout.count("one model load") == 1
    assert set(servers_of(tiny_model)) <= before  # the run stopped the swarm it started
    for ck, name in PAIRS:
        single = tmp_path / f"local_{ck}_{name}"
        with one_thread():
            assert run_cli_in_process([*common(tiny_model, single), "--data-files", *assets["sets"][name],
                                       "--checkpoint", checkpoints[ck]], hide_modules=NO_FIGURES) == 0
        assert read_jsonl(out / ck / name / "predictions.jsonl") == read_jsonl(single / "predictions.jsonl")
        metrics = json.load(open(out / ck / name / "metrics.json"))
        assert metrics["run"]["backend"] == "petals" and metrics["run"]["swarm"]
        assert without_run(metrics) == without_run(json.load(open(single / "metrics.json")))


def test_the_checkpoints_are_compared_on_each_set_with_holm_over_all(multi_n1):
    """Issue 52: summary.json's comparisons: c1 vs c2 on dev and on test (McNemar on the rows they
    share, as compare computes it), Holm over the 2 comparisons of the run; summary.md shows them."""
    from dist_eval.compare import compare_runs, load_run
    from dist_eval.paired import holm_adjusted

    out, _ = multi_n1
    compared = json.load(open(out / "summary.json"))["comparisons"]
    assert [(r["set"], r["a"], r["b"]) for r in compared["pairs"]] == [("dev", "c1/dev", "c2/dev"),
                                                                      ("test", "c1/test", "c2/test")]
    pvalues = []
    for row in compared["pairs"]:
        paired = compare_runs(load_run(out / row["a"]), load_run(out / row["b"]), resamples=0).paired
        assert row["pvalue"] == paired["mcnemar"]["pvalue"] and row["shared_rows"] == paired["shared_rows"]
        assert row["minimum_detectable_effect"] == paired["power"]["minimum_detectable_effect"]
        pvalues.append(row["pvalue"])
    assert [r["pvalue_holm"] for r in compared["pairs"]] == holm_adjusted(pvalues)
    assert "checkpoints compared on each set: each pair, 2 comparisons" in open(out / "summary.md").read()
