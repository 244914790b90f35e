"""Issue 74: rank 0's report of a big set writes half of predictions.jsonl and draws its figures in forked children
beside it (dist_eval/aside.py): the same bytes as written in one process, whatever the child does (raises, dies,
hangs: the parent does the work itself); no child left, also when the parent is killed; no scratch file left."""
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import REPO

from dist_eval.aside import Aside, AsideFailed
from dist_eval.results import MergedResults

NAMES = ["World", "Sports", "Business", "Sci/Tech"]


def merged_rows(n: int, seed: int = 0) -> MergedResults:
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((n, 4)).astype(np.float32)
    losses = rng.random(n)
    losses[3] = float("nan")  # a non-finite loss: its own spelling in both halves' code
    return MergedResults(np.arange(n), rng.integers(0, 4, n), logits.argmax(1), losses, logits)


def my_children() -> list:
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        return [int(pid) for pid in f.read().split()]


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_the_result_or_the_named_error_of_the_work_and_no_child_left():
    children, started = set(my_children()), []

    def aside(work):
        child = Aside(work)
        started.append(child.pid)
        return child

    assert aside(lambda: {"png": b"\x89PNG" * 50_000}).result() == {"png": b"\x89PNG" * 50_000}  # > a pipe's buffer
    with pytest.raises(AsideFailed, match=r"^ZeroDivisionError: division by zero$"):
        aside(lambda: 1 / 0).result()
    with pytest.raises(AsideFailed, match=r"^the child gave no result \(0 bytes read"):
        aside(lambda: os._exit(3)).result()
    began = time.monotonic()
    with pytest.raises(AsideFailed, match=r"^no result in time$"):
        aside(lambda: time.sleep(60)).result(timeout=0.5)  # killed and reaped, not waited for
    assert time.monotonic() - began < 10
    assert all(gone(pid) for pid in started) and set(my_children()) <= children


def test_no_child_to_be_had_is_said_and_leaves_no_descriptor(monkeypatch):
    """A fork refused (EAGAIN: a cgroup's process limit; ENOMEM): AsideFailed, the pipe's two ends closed."""
    import errno

    def refused():
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", refused)
    descriptors = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(AsideFailed, match=r"^no child started: \[Errno 11\]"):
        Aside(lambda: 1)
    assert sorted(os.listdir("/proc/self/fd")) == descriptors


def test_a_child_dies_with_its_parent():
    """The parent SIGKILLed (no cleanup of its runs): its child, in the middle of its work, is gone too."""
    script = textwrap.dedent("""
        import sys, time
        sys.path.insert(0, sys.argv[1])
        from dist_eval.aside import Aside
        child = Aside(lambda: time.sleep(120))
        print(child.pid, flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script, REPO], stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        assert not gone(child)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(child), f"the child {child} outlived its parent"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("child", ["works", "dies at once", "dies after its work", "is not to be had"])
def test_predictions_jsonl_written_in_two_processes_is_the_same_bytes(tmp_path, monkeypatch, child):
    """5,000 rows (logits saved, a non-finite loss), lines made 700 at a time: written with the second half in a
    forked child (the aside from 1 row on) equals the file written in one process, the child's half copied in
    once; a child that dies before its work, or after it but before its result (its scratch file whole: never
    read), or none to be had (no fork), leaves its rows to the parent: the same bytes. No scratch file left."""
    import shutil

    import dist_eval.aside
    from dist_eval.output.files import write_predictions

    merged = merged_rows(5000)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    monkeypatch.setenv("DIST_EVAL_CHUNK_ROWS", "lines=700,aside=100000000")
    one = write_predictions(str(tmp_path / "one"), merged, NAMES, True)
    if child == "dies at once":
        monkeypatch.setattr(dist_eval.aside, "_run_child", lambda *args: os._exit(1))
    elif child == "dies after its work":
        monkeypatch.setattr(dist_eval.aside, "_run_child", lambda work, *args: (work(), os._exit(1)))
    elif child == "is not to be had":
        monkeypatch.setattr(os, "fork", lambda: (_ for _ in ()).throw(OSError(12, "Cannot allocate memory")))
    copied, copy = [], shutil.copyfileobj
    monkeypatch.setattr(shutil, "copyfileobj", lambda *args: copied.append(copy(*args)))
    monkeypatch.setenv("DIST_EVAL_CHUNK_ROWS", "lines=700,aside=1")
    children = set(my_children())
    two = write_predictions(str(tmp_path / "two"), merged, NAMES, True)
    assert open(two, "rb").read() == open(one, "rb").read()
    assert len(copied) == (child == "works")
    assert sorted(os.listdir(tmp_path / "two")) == ["predictions.jsonl"]
    assert set(my_children()) <= children
