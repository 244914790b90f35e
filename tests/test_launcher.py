"""dist-eval: torchrun's launcher in-process, ending on the run's own error line. (Its 2-rank run to the end is
test_cli.py's test_a_run_on_two_ranks: that file's N=2 launch, issue 69.)"""
import os
import sys

import pytest
from conftest import REPO, run_in_own_group

from dist_eval.launcher import main, split_argv


def launch(args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return run_in_own_group([sys.executable, "-m", "dist_eval.launcher", *args], timeout=timeout, env=env)


def test_split_at_the_first_double_dash():
    assert split_argv(["--nproc-per-node", "2", "--", "--model", "m", "--", "x"]) == (
        ["--nproc-per-node", "2"], ["--model", "m", "--", "x"])
    assert split_argv(["--nproc-per-node", "2"]) == (["--nproc-per-node", "2"], [])
    assert split_argv(["--", "--batch-size", "4"]) == ([], ["--batch-size", "4"])


def test_flags_before_the_double_dash_are_refused_in_one_line(capsys):
    assert main(["model_dir"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dist-eval: error: 'model_dir': expected torchrun options before '--'")


def test_console_script_is_declared():
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        assert 'dist-eval = "dist_eval.launcher:main"' in f.read()


@pytest.mark.multiproc
def test_a_failed_run_ends_on_its_one_error_line():
    proc = launch(["--nproc-per-node", "2", "--", "--batch-size", "0"])
    assert proc.returncode == 2
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines == ["dist_eval: error: --batch-size 0: expected a positive integer."], proc.stderr[-3000:]


def test_a_signal_after_the_ranks_ended_keeps_their_code():
    """srun --kill-on-bad-exit sends SIGTERM to the other nodes' launchers while their ranks
    exit with the code every rank agreed on: that code stands; a run stopped by the signal
    (its ranks' 130, or killed) is 128 + the signal."""
    from dist_eval.launcher import _code_after_signal

    assert _code_after_signal(15, {0: 2, 1: 2}) == 2
    assert _code_after_signal(15, {0: 0, 1: 1}) == 1
    assert _code_after_signal(15, {0: 0, 1: 0}) == 0
    assert _code_after_signal(15, {0: 130, 1: 130}) == 143  # the ranks were interrupted: scancel
    assert _code_after_signal(15, {0: 2, 1: -15}) == 143
    assert _code_after_signal(15, {0: None}) == 143 and _code_after_signal(2, {}) == 130
