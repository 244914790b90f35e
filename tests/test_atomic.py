"""Files dist_eval writes and reads (issue 50, dist_eval/atomic.py): a write never follows a planted
link, leaves no temporary file when it fails, and gives the file the mode a plain open would; a
read takes a regular file of bounded size only and never blocks (a FIFO, a device, a link to one).
"""
import os
import subprocess
import sys
import threading

import pytest
from conftest import REPO

from dist_eval.atomic import atomic_write, read_regular


def test_a_link_planted_under_the_old_temporary_name_is_not_followed(tmp_path):
    """Before: the temporary name was PATH.tmp<pid>, opened plainly: a link planted there made the
    write overwrite the link's target."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    path = tmp_path / "metrics.json"
    os.symlink(victim, f"{path}.tmp{os.getpid()}")
    atomic_write(str(path), "{}\n")
    assert victim.read_text() == "keep me" and path.read_text() == "{}\n"
    assert sorted(os.listdir(tmp_path)) == sorted(["victim", "metrics.json", f"metrics.json.tmp{os.getpid()}"])


def test_a_failed_write_leaves_nothing(tmp_path):
    """Before: the temporary file of a write that failed (a full disk, an error mid-way) stayed."""
    def fails(f):
        f.write("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(str(tmp_path / "predictions.jsonl"), fails)
    assert os.listdir(tmp_path) == []
    atomic_write(str(tmp_path / "a.txt"), "é\n")  # text is UTF-8 whatever the locale
    assert (tmp_path / "a.txt").read_bytes() == "é\n".encode()


def test_the_file_gets_the_mode_of_a_plain_open(tmp_path):
    code = ("import os, sys; os.umask(0o027); from dist_eval.atomic import atomic_write; "
            "atomic_write(sys.argv[1], 'x'); open(sys.argv[2], 'w').close()")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "a"), str(tmp_path / "b")], cwd=REPO, check=True,
                   timeout=60)
    assert os.stat(tmp_path / "a").st_mode & 0o777 == os.stat(tmp_path / "b").st_mode & 0o777 == 0o640


def _read_within(path, seconds=10.0, **keywords):
    """read_regular's result or exception, failing the test if it has not returned in ``seconds``."""
    out = {}

    def read():
        try:
            out["value"] = read_regular(path, **keywords)
        except Exception as e:
            out["error"] = e

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(seconds)
    assert not reader.is_alive(), f"read_regular({path}) still blocked after {seconds} s"
    return out


def test_only_regular_files_of_bounded_size_are_read(tmp_path):
    regular = tmp_path / "rows"
    regular.write_bytes(b"x" * 100)
    assert _read_within(str(regular), max_bytes=100)["value"] == b"x" * 100
    assert "over the bound" in str(_read_within(str(regular), max_bytes=99)["error"])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in str(_read_within(str(fifo), max_bytes=100)["error"])
    zero = tmp_path / "zero"
    os.symlink("/dev/zero", zero)
    assert "not a regular file" in str(_read_within(str(zero), max_bytes=1 << 20)["error"])
    linked = tmp_path / "linked"
    os.symlink(regular, linked)  # a link to a regular file is that file
    assert _read_within(str(linked), max_bytes=100)["value"] == b"x" * 100


def test_a_file_of_another_user_is_refused_when_an_owner_is_asked(tmp_path):
    """Any user: this user's file asked to be another's (no root needed to give it away: the check compares
    the file's owner with the one asked)."""
    mine = tmp_path / "mine"
    mine.write_bytes(b"rows")
    refused = _read_within(str(mine), max_bytes=10, owner=os.geteuid() + 1)["error"]
    assert f"owned by another user (uid {os.geteuid()})" in str(refused)
    assert _read_within(str(mine), max_bytes=10, owner=os.geteuid())["value"] == b"rows"
    assert _read_within(str(mine), max_bytes=10)["value"] == b"rows"
