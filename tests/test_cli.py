"""The CLI under real torchrun with the local backend: outputs, exactness across N,
and the error cases (one clear line, non-zero exit on every rank, no hang)."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
from conftest import REPO, build_checkpoint, read_jsonl, run_env, run_in_own_group, run_ranks, write_csv
from float_promises import assert_same_bits
from inprocess_cli import run_cli_in_process, without_modules


@pytest.fixture(scope="module")
def data_csv(tmp_path_factory):
    return write_csv(str(tmp_path_factory.mktemp("cli") / "data.csv"), 23, seed=5)


def no_figures_env(folder) -> dict:
    """run_cli's env for a run whose figures nobody looks at: matplotlib hidden under ``folder``
    (the figures are the same function of the same metrics, and most of a small run's report)."""
    hidden = without_modules(folder, "matplotlib")
    return {"PYTHONPATH": os.pathsep.join(p for p in (hidden, REPO, os.environ.get("PYTHONPATH")) if p)}


def local_args(model, checkpoint, data, out, *extra):
    return ["--model", model, "--data-files", data, "--backend", "local", "--checkpoint", checkpoint,
            "--output-dir", str(out), "--batch-size", "4", *extra]


@pytest.fixture(scope="module")
def cli_runs(tiny_model, tiny_checkpoint, data_csv, tmp_path_factory, rank_zygote):
    """The same run on 2 ranks under dist-eval (dist_eval.launcher: torchrun's launcher in-process, as
    the README runs it), on 3 ranks forked (conftest's run_ranks: the launch is N=2's, whose outputs,
    output and launch-time accounting test_outputs_are_complete and test_a_run_on_two_ranks read); the
    one-rank reference in this process (one thread: a torchrun rank's bits; its output is not what is
    checked). {N: (folder, proc)}
    Only N=2's figures are looked at (test_outputs_are_complete): the others run without matplotlib."""
    out = {}
    for nproc in (1, 2, 3):
        folder = tmp_path_factory.mktemp(f"cli_n{nproc}")
        args = local_args(tiny_model, tiny_checkpoint, data_csv, folder, "--save-logits", "--save-text")
        if nproc == 1:
            assert run_cli_in_process(args, hide_modules=("matplotlib",)) == 0
            out[nproc] = (folder, None)
            continue
        if nproc == 3:
            proc = run_ranks(rank_zygote, args, nproc=nproc, env=no_figures_env(tmp_path_factory.mktemp("hidden")))
        else:
            proc = run_in_own_group([sys.executable, "-m", "dist_eval.launcher", "--nproc-per-node", "2", "--",
                                     *args], timeout=300, env=run_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[nproc] = (folder, proc)
    return out


@pytest.mark.multiproc
def test_outputs_are_complete(cli_runs):
    folder, proc = cli_runs[2]
    metrics = json.load(open(folder / "metrics.json"))
    for key in ("num_samples", "accuracy", "precision_macro", "recall_macro", "f1_macro", "f1_micro",
                "f1_weighted", "loss", "confusion_matrix", "per_class", "num_truncated"):
        assert key in metrics, key
    assert metrics["num_samples"] == 23
    assert len(metrics["confusion_matrix"]) == 3 and all(len(r) == 3 for r in metrics["confusion_matrix"])
    assert sum(map(sum, metrics["confusion_matrix"])) == 23
    assert set(metrics["per_class"]["0"]) >= {"precision", "recall", "f1", "support"}
    run = metrics["run"]
    assert run["world_size"] == 2 and sum(run["per_rank_samples"]) == 23
    for key in ("model", "data_files", "wall_seconds", "samples_per_second", "versions", "backend"):
        assert key in run, key
    assert run["versions"]["torch"] and run["versions"]["transformers"]
    # where the wall time went: the start-up (launch + imports) and each phase, in order
    assert run["startup_seconds"] > 0
    assert list(run["phase_seconds"])[:3] == ["preparing the run", "loading the data", "loading the model"]
    assert {"loading the model", "the forward passes", "merging the results"} <= set(run["phase_seconds"])
    # ... and, once every process had stopped, the report's and the shutdown's times and the total
    assert list(run["phase_seconds"])[-2:] == ["writing the report", "shutting down"]
    assert run["total_seconds"] >= run["startup_seconds"] + run["wall_seconds"]
    assert sum(run["phase_seconds"].values()) <= run["total_seconds"] - run["startup_seconds"] + 1.0
    assert "  time: launch and imports " in proc.stdout
    assert f"dist_eval: done in {run['total_seconds']:.1f} s from the launch" in proc.stdout
    rows = read_jsonl(folder / "predictions.jsonl")
    assert [r["index"] for r in rows] == list(range(23))
    assert all(len(r["logits"]) == 3 and r["pred"] == max(range(3), key=lambda k: r["logits"][k]) for r in rows)
    # the labels are the file's labels, row by row
    with open(run["data_files"][0]) as f:
        file_labels = [int(line.rsplit(",", 1)[1]) for line in f.read().splitlines()[1:]]
    assert [r["label"] for r in rows] == file_labels
    # each row's probability of its prediction, loss and text (issue 14)
    import numpy as np
    from scipy.special import softmax

    logits = np.array([r["logits"] for r in rows], dtype=np.float64)
    probs = softmax(logits, axis=1)
    labels, preds = np.array(file_labels), np.array([r["pred"] for r in rows])
    assert np.allclose([r["prob"] for r in rows], probs[np.arange(23), preds], rtol=1e-12)
    assert np.allclose([r["loss"] for r in rows], -np.log(probs[np.arange(23), labels]), rtol=1e-6)
    with open(run["data_files"][0]) as f:
        file_texts = [line.rsplit(",", 1)[0] for line in f.read().splitlines()[1:]]
    assert [r["text"] for r in rows] == file_texts
    for key in ("ece", "brier", "top2_accuracy", "auroc_macro", "reliability"):
        assert key in metrics, key
    assert "ece " in proc.stdout and "top2_accuracy " in proc.stdout
    assert os.path.isfile(folder / "reliability_diagram.png")
    assert "Reliability diagram" in open(folder / "report.html").read()
    assert "accuracy" in proc.stdout and "confusion matrix" in proc.stdout  # rank 0's summary
    assert len(re.findall(r"(?<!\w)accuracy \d", proc.stdout)) == 1  # printed once, by rank 0 only


@pytest.mark.multiproc
def test_a_run_on_two_ranks(cli_runs):
    """dist-eval (torchrun's launcher in-process) runs 2 ranks to the end: exit 0, every row, both ranks
    in the run's group, and its stdout is the run's own from its first line to its last. (Moved from
    test_launcher.py, issue 69: a 2-rank launch of its own of 23 rows; cli_runs' N=2 is that launch.)"""
    folder, proc = cli_runs[2]
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.load(open(folder / "metrics.json"))
    assert metrics["num_samples"] == 23 and metrics["run"]["world_size"] == 2
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "dist_eval: evaluating 23 rows on 2 rank(s) with the local backend ...", proc.stdout[-3000:]
    assert lines[-1].startswith("dist_eval: done in "), proc.stdout[-3000:]


@pytest.mark.multiproc
@pytest.mark.parametrize("nproc", [2, 3])
def test_predictions_identical_for_any_nproc(cli_runs, nproc):
    single = read_jsonl(cli_runs[1][0] / "predictions.jsonl")
    multi = read_jsonl(cli_runs[nproc][0] / "predictions.jsonl")
    assert_same_bits(multi, single, f"predictions.jsonl (labels, preds, logits), N={nproc} against 1")
    m1 = json.load(open(cli_runs[1][0] / "metrics.json"))
    mn = json.load(open(cli_runs[nproc][0] / "metrics.json"))
    assert_same_bits({k: v for k, v in mn.items() if k != "run"}, {k: v for k, v in m1.items() if k != "run"},
                     f"metrics.json, N={nproc} against 1")


def fails_in_process(args, capfd, pattern):
    """``args`` run in this process (one rank, the CLI's own code path: where the launcher is not
    what is tested) end with exit code 2, one error line matching ``pattern``, no traceback and
    no report. (Two-rank runs of such cases, every rank exiting 2: the multiproc tests here.)"""
    capfd.readouterr()
    code = run_cli_in_process(args)
    _, err = capfd.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("dist_eval: error:")]
    assert code == 2 and len(errors) == 1, err[-3000:]
    assert re.search(pattern, errors[0]), errors[0]
    assert "Traceback" not in err, err[-3000:]
    out = args[args.index("--output-dir") + 1]
    for name in ("metrics.json", "predictions.jsonl"):
        assert not os.path.exists(os.path.join(out, name)), f"{name} written by a failed run"


def assert_clean_failure(proc, pattern, nproc=2, max_seconds=None, started=None):
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dist_eval: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert re.search(pattern, errors[0]), errors[0]
    assert "Traceback" not in proc.stderr.split("dist_eval: error:")[0]  # none of ours before it
    if nproc > 1:
        # every rank exited non-zero: with the usage code, or torchrun's SIGTERM (-15) when
        # another rank's exit reached torchrun first (it then stops the rest of the group); forked
        # ranks (conftest's run_ranks) have their codes from their launcher, which does the same
        codes = getattr(proc, "rank_codes", None)
        if codes is None:  # torchrun's: its summary of the failed ranks
            codes = [int(code) for code in re.findall(r"exitcode\s*: (-?\d+) ", proc.stderr)]
        assert len(codes) == nproc and set(codes) <= {2, -15} and 2 in codes, (codes, proc.stderr[-3000:])
    if max_seconds is not None:
        assert time.monotonic() - started < max_seconds
    # nothing written as if the run had succeeded
    args = list(proc.args)
    if "--output-dir" in args:
        out = args[args.index("--output-dir") + 1]
        for name in ("metrics.json", "predictions.jsonl"):
            assert not os.path.exists(os.path.join(out, name)), f"{name} written by a failed run"


def test_missing_column(tiny_model, tiny_checkpoint, data_csv, tmp_path, capfd):
    fails_in_process(local_args(tiny_model, tiny_checkpoint, data_csv, tmp_path, "--text-column", "sentence"), capfd,
                     r"--text-column sentence: no such column; the dataset has \['text', 'label'\]")


def test_label_out_of_range(tiny_model, tiny_checkpoint, tmp_path, capfd):
    """One rank in this process. The two-rank path of this refusal (read_labels, in a phase: every
    rank exits 2, rank 0 says why) is test_cli_bad_input.py's text_labels_not_num_labels: the same
    function, the same phase, another of its checks."""
    data = tmp_path / "bad.csv"
    data.write_text("text,label\nw1 w2,0\nw3,1\nw4 w5,7\n")
    fails_in_process(local_args(tiny_model, tiny_checkpoint, str(data), tmp_path / "out"), capfd,
                     r"--label-column label: row 2 has label 7, outside \[0, 3\)")


def test_missing_data_file(tiny_model, tiny_checkpoint, tmp_path, capfd):
    fails_in_process(local_args(tiny_model, tiny_checkpoint, str(tmp_path / "nope.csv"), tmp_path / "out"), capfd,
                     r"--data-files: no such file .*nope\.csv")


def test_corrupt_data_file(tiny_model, tiny_checkpoint, tmp_path, capfd):
    data = tmp_path / "broken.parquet"
    data.write_bytes(b"PAR1 this is not parquet at all" * 10)
    fails_in_process(local_args(tiny_model, tiny_checkpoint, str(data), tmp_path / "out"), capfd,
                     r"--data-files .*broken\.parquet: cannot be read as parquet")


@pytest.mark.multiproc
def test_unanswered_initial_peers_fail_fast(tiny_model, tiny_checkpoint, data_csv, tmp_path, rank_zygote):
    started = time.monotonic()
    proc = run_ranks(rank_zygote, ["--model", tiny_model, "--data-files", data_csv, "--checkpoint", tiny_checkpoint,
                    "--output-dir", str(tmp_path), "--initial-peers",
                    "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDA7N9X7VLQrcdrk2ozrFjzVngzs7LggiY8c5nUnNMpeR",
                    "--dht-prefix", "nobody"], nproc=2, timeout=120)
    assert_clean_failure(proc, r"--initial-peers .*: no swarm answered", max_seconds=60, started=started)


def test_refuses_a_random_head(tiny_model, data_csv, tmp_path, capfd):
    fails_in_process(["--model", tiny_model, "--data-files", data_csv, "--backend", "local", "--output-dir",
                      str(tmp_path)], capfd, r"no classifier head .* initialised at random")


def test_refuses_a_checkpoint_for_another_model(tiny_model, data_csv, tmp_path, capfd):
    other = build_checkpoint(str(tmp_path / "big.pt"), hidden=48)
    fails_in_process(local_args(tiny_model, other, data_csv, tmp_path / "out"), capfd,
                     r"shape \[3, 48\], expected \[3, 32\]")


@pytest.mark.parametrize(
    "flags,pattern",
    [
        (["--pre-seq-len", "4"], r"--pre-seq-len 4: needs --tuning-mode"),
        (["--batch-size", "0"], r"--batch-size 0: expected a positive integer"),
        (["--max-length", "-3"], r"--max-length -3: expected a positive integer"),
    ],
)
def test_bad_flags(tiny_model, tiny_checkpoint, data_csv, tmp_path, flags, pattern, capfd):
    fails_in_process(local_args(tiny_model, tiny_checkpoint, data_csv, tmp_path, *flags), capfd, pattern)


@pytest.mark.multiproc
def test_a_bad_flag_ends_every_rank(tiny_model, tiny_checkpoint, data_csv, tmp_path, rank_zygote):
    """Checked before the first phase, agreed on by every rank: each exits 2, rank 0 says why."""
    proc = run_ranks(rank_zygote, local_args(tiny_model, tiny_checkpoint, data_csv, tmp_path, "--batch-size", "0"),
                     nproc=2)
    assert_clean_failure(proc, r"--batch-size 0: expected a positive integer")


def test_unwritable_output_dir(tiny_model, tiny_checkpoint, data_csv, tmp_path, capfd):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    fails_in_process(local_args(tiny_model, tiny_checkpoint, data_csv, blocker / "out"), capfd,
                     r"--output-dir .*: not writable")


def test_truncation_is_counted(tiny_model, tiny_checkpoint, data_csv, tmp_path, capfd):
    capfd.readouterr()
    code = run_cli_in_process(local_args(tiny_model, tiny_checkpoint, data_csv, tmp_path, "--max-length", "5"),
                              hide_modules=("matplotlib",))  # no figure looked at
    stdout, stderr = capfd.readouterr()
    assert code == 0, stderr[-2000:]
    with open(data_csv) as f:
        expected = sum(len(line.rsplit(",", 1)[0].split()) > 5 for line in f.read().splitlines()[1:])
    assert expected > 0
    assert json.load(open(tmp_path / "metrics.json"))["num_truncated"] == expected
    assert "truncated" in stdout  # the summary says so too


FORKED_CHILD_SIGTERM = """
import os, signal
from dist_eval import cli

signal.signal(signal.SIGTERM, cli._raise_interrupt)
cli._reset_signals_in_forked_children()
pid = os.fork()
if pid == 0:  # the child: exit 0 only with the default handler
    os._exit(0 if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL else 1)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), signal.getsignal(signal.SIGTERM) == cli._raise_interrupt)
"""


def test_forked_helpers_get_the_default_sigterm_back():
    """The rank's SIGTERM handler must not run in processes it forks (hivemind's DHT). In an interpreter of its
    own: the suite's processes reset SIGTERM in their forks themselves (tests/process_leaks.py), which would hide
    the CLI's own reset."""
    out = subprocess.run([sys.executable, "-c", FORKED_CHILD_SIGTERM], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["0", "True"], out.stdout  # the child's default; the parent keeps its handler


@pytest.mark.multiproc
def test_label_words_n2_equals_n1(tiny_model, data_csv, tmp_path, capfd, rank_zygote):
    """Zero-shot (--label-words, --template, no checkpoint) on two ranks: N=2 equals N=1
    (predictions, logits, metrics), the words given as a file on one run; accuracy is
    scikit-learn's on the predictions; metrics.json records the words and the template. N=1
    runs in this process (one thread: a torchrun rank's bits); neither run warns."""
    from sklearn.metrics import accuracy_score

    (tmp_path / "words.txt").write_text("w1\nw2 w5\nw3\n")
    template = "w40 {text} w41"
    outs = {}
    for nproc, words in ((1, ["w1", "w2 w5", "w3"]), (2, ["@" + str(tmp_path / "words.txt")])):
        out = tmp_path / f"n{nproc}"
        args = ["--model", tiny_model, "--data-files", data_csv, "--backend", "local", "--label-words", *words,
                "--template", template, "--output-dir", str(out), "--batch-size", "4", "--save-logits"]
        if nproc == 1:
            capfd.readouterr()
            code = run_cli_in_process(args)
            stderr = capfd.readouterr()[1]
        else:
            proc = run_ranks(rank_zygote, args, nproc=nproc)
            code, stderr = proc.returncode, proc.stderr
        assert code == 0, stderr[-3000:]
        assert "warning" not in stderr, stderr[-3000:]
        outs[nproc] = (read_jsonl(out / "predictions.jsonl"), json.load(open(out / "metrics.json")))
    (rows, metrics), (rows2, metrics2) = outs[1], outs[2]
    assert_same_bits(rows2, rows, "predictions.jsonl, N=2 against 1")
    assert [r["index"] for r in rows] == list(range(23))
    assert_same_bits({k: v for k, v in metrics2.items() if k != "run"},
                     {k: v for k, v in metrics.items() if k != "run"}, "metrics.json, N=2 against 1")
    preds = [max(range(3), key=lambda k: r["logits"][k]) for r in rows]
    assert [r["pred"] for r in rows] == preds
    assert metrics["accuracy"] == pytest.approx(accuracy_score([r["label"] for r in rows], preds), abs=1e-12)
    for m in (metrics, metrics2):
        assert m["run"]["label_words"] == ["w1", "w2 w5", "w3"] and m["run"]["template"] == template
        assert m["run"]["checkpoint"] is None
