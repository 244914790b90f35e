"""Where the docs and the code disagreed and the code was wrong (issue 24): ``rescore``
compares every metric the run wrote, ``top{K}_accuracy`` included; a run's start-up time is
its own, not that of the shell which ``exec``ed torchrun."""
import json
import shutil
import sys
import time

import pytest
from conftest import free_port, run_in_own_group, write_csv
from inprocess_cli import run_cli_in_process
from test_cli import no_figures_env

from dist_eval.rescore import main as rescore_main


@pytest.fixture(scope="module")
def top2_run(tiny_model, tiny_checkpoint, tmp_path_factory):
    """A finished run of a 3-class model with logits, so with top2_accuracy in metrics.json."""
    base = tmp_path_factory.mktemp("rescore_topk")
    data = write_csv(str(base / "data.csv"), 29, seed=4)
    args = ["--model", tiny_model, "--data-files", data, "--backend", "local", "--checkpoint", tiny_checkpoint,
            "--output-dir", str(base / "out"), "--batch-size", "4", "--progress", "none", "--quiet",
            "--bootstrap-resamples", "50", "--save-logits"]
    assert run_cli_in_process(args) == 0
    return base / "out"


def test_rescore_fails_when_only_top_k_accuracy_differs(top2_run, tmp_path, capsys):
    assert rescore_main([str(top2_run)]) == 0
    capsys.readouterr()
    doctored = tmp_path / "doctored"
    shutil.copytree(top2_run, doctored)
    metrics = json.load(open(doctored / "metrics.json"))
    assert metrics["top_k"] == 2 and "top2_accuracy" in metrics
    metrics["top2_accuracy"] = 1.0 - metrics["top2_accuracy"] / 2  # any other value
    json.dump(metrics, open(doctored / "metrics.json", "w"))
    assert rescore_main([str(doctored)]) == 1
    assert "differs from metrics.json: top2_accuracy" in capsys.readouterr().out


def test_rescore_fails_when_the_run_wrote_a_top_k_it_cannot_have(top2_run, tmp_path, capsys):
    doctored = tmp_path / "doctored"
    shutil.copytree(top2_run, doctored)
    metrics = json.load(open(doctored / "metrics.json"))
    metrics["top3_accuracy"] = 1.0  # a top-k the run's k does not give: rescore computes none
    json.dump(metrics, open(doctored / "metrics.json", "w"))
    assert rescore_main([str(doctored)]) == 1
    assert "top3_accuracy" in capsys.readouterr().out


SLEEP = 6.0


@pytest.mark.multiproc
def test_startup_is_the_runs_own_not_the_shell_before_torchrun(tiny_model, tiny_checkpoint, tmp_path):
    """``bash -c 'sleep S; exec torchrun ...'``: torchrun inherits the shell's start time in
    /proc; the run's start-up and total must not count the S seconds before it. (No figures:
    matplotlib hidden.)
    """
    data = write_csv(str(tmp_path / "data.csv"), 9, seed=2)
    torchrun = (f"{sys.executable} -m torch.distributed.run --nproc_per_node 1 --master_port {free_port()} "
                f"-m dist_eval --model {tiny_model} --data-files {data} --checkpoint {tiny_checkpoint} "
                f"--backend local --output-dir {tmp_path / 'out'} --progress none --bootstrap-resamples 0")
    began = time.monotonic()
    proc = run_in_own_group(["bash", "-c", f"sleep {SLEEP} && exec {torchrun}"], timeout=300,
                            env={**_env(), **no_figures_env(tmp_path / "hidden")})
    elapsed = time.monotonic() - began
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.load(open(tmp_path / "out" / "metrics.json"))["run"]
    assert 0 < run["startup_seconds"] < elapsed - SLEEP
    # the whole run, as the user reads it ("done in X s"), is what came after the sleep
    assert run["total_seconds"] <= elapsed - SLEEP + 0.5, (run["total_seconds"], elapsed)


def _env():
    import os

    from conftest import REPO

    pythonpath = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": pythonpath}
