"""One run at a time per output folder, and a run removes only what it wrote (issue 50,
dist_eval/output/files.py, dist_eval/resume.py): a second run into a folder in use is refused in
one line naming the other run; a lock left by a dead run is taken over with a warning; report
files of an earlier run that this run does not write are removed; a folder of the user's under
``partial/`` is left alone. In-process CLI runs of the tiny Llama (local backend)."""
import json
import os
import socket
import subprocess
import time

import pytest
from conftest import write_csv
from inprocess_cli import run_cli_in_process

from dist_eval.output.files import LOCK_NAME, _process_start


def _args(tiny_model, tiny_checkpoint, data, out, *extra):
    return ["--model", tiny_model, "--data-files", data, "--backend", "local", "--checkpoint", tiny_checkpoint,
            "--output-dir", str(out), "--batch-size", "4", "--quiet", "--row-store", "off", *extra]


def _plant_lock(out, pid):
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": pid,
                                             "started": _process_start(pid), "since": "2026-11-26 01:02:03"}))


def test_a_folder_in_use_is_refused_and_a_dead_runs_lock_taken_over(tiny_model, tiny_checkpoint, tmp_path, capfd):
    """Before: two runs in one folder removed each other's partial results and wrote their
    reports one file at a time, one model's predictions beside another's metrics."""
    data, out = write_csv(str(tmp_path / "data.csv"), 12), tmp_path / "out"
    other = subprocess.Popen(["sleep", "120"])  # a live run of this host holds the folder
    try:
        _plant_lock(out, other.pid)
        capfd.readouterr()
        assert run_cli_in_process(_args(tiny_model, tiny_checkpoint, data, out)) == 2
        lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1, lines
        assert f"--output-dir {out}: in use by another run (host {socket.gethostname()}, pid {other.pid}, " \
               f"since 2026-11-26 01:02:03)" in lines[0], lines
        assert not (out / "metrics.json").exists()
    finally:
        other.kill()
        other.wait()
    capfd.readouterr()
    assert run_cli_in_process(_args(tiny_model, tiny_checkpoint, data, out)) == 0  # its pid is dead now
    err = capfd.readouterr().err
    assert f"taking over the lock of a run that died (pid {other.pid}" in err, err
    assert (out / "metrics.json").exists() and not (out / LOCK_NAME).exists()  # released at the end


def test_a_reused_pid_does_not_keep_a_dead_runs_lock(tiny_model, tiny_checkpoint, tmp_path, capfd):
    """A lock naming a live pid that started at another time is a dead run's (the pid was reused)."""
    data, out = write_csv(str(tmp_path / "data.csv"), 12), tmp_path / "out"
    _plant_lock(out, os.getpid())
    lock = json.loads((out / LOCK_NAME).read_text())
    (out / LOCK_NAME).write_text(json.dumps({**lock, "started": lock["started"] - 1}))
    assert run_cli_in_process(_args(tiny_model, tiny_checkpoint, data, out)) == 0
    assert "taking over the lock" in capfd.readouterr().err


def test_a_rerun_removes_the_report_files_it_does_not_write_and_keeps_the_users_folders(tiny_model, tiny_checkpoint,
                                                                                         tmp_path):
    """Before: a rerun without --slice-by left the earlier slices.csv looking current, and a run
    removed every folder under OUT/partial/ but its own, a folder of the user's included."""
    data = write_csv(str(tmp_path / "data.csv"), 12)
    out = tmp_path / "out"
    assert run_cli_in_process(_args(tiny_model, tiny_checkpoint, data, out, "--slice-by", "label")) == 0
    assert (out / "slices.csv").exists()
    mine = out / "partial" / "my-notes"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    stale = out / "partial" / "0123456789abcdef"  # another run key's leftovers: dist_eval's own
    stale.mkdir()
    (stale / "rank0-17-000000.npz").write_bytes(b"")
    time.sleep(0.01)
    assert run_cli_in_process(_args(tiny_model, tiny_checkpoint, data, out)) == 0
    assert not (out / "slices.csv").exists()
    assert (out / "report.html").exists() and (out / "per_class.csv").exists()
    assert (mine / "notes.txt").read_text() == "mine" and not stale.exists()


def test_each_pairs_folder_is_made_ready_before_any_work(tmp_path):
    """The run's start (job.prepare) makes every pair's folder: writable, an earlier shard's files
    removed (not this run's); a folder that cannot be written is refused before any work."""
    from dist_eval.errors import UsageError
    from dist_eval.output.files import prepare_pair_folders
    from dist_eval.output.shard_files import ARRAYS, MANIFEST

    out = tmp_path / "out"
    (out / "c1" / "dev").mkdir(parents=True)
    for name in (MANIFEST, ARRAYS, "metrics.json"):
        (out / "c1" / "dev" / name).write_text("an earlier run's")
    prepare_pair_folders(str(out), ["c1/dev", "c2/dev"])
    assert os.listdir(out / "c1" / "dev") == ["metrics.json"] and os.listdir(out / "c2" / "dev") == []
    (out / "taken").write_text("a file where a pair's folder goes")
    with pytest.raises(UsageError, match="not writable"):
        prepare_pair_folders(str(out), ["taken"])
