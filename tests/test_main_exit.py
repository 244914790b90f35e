"""``python -m dist_eval``'s exit: the program's own exit work done, the interpreter's teardown skipped."""
import os
import subprocess
import sys

from conftest import REPO

_PROGRAM = """
import atexit, sys, threading, time
from dist_eval.__main__ import exit_without_teardown
marks = sys.argv[1]
atexit.register(lambda: open(marks, "a").write("atexit\\n"))
def late():
    time.sleep(0.5)
    open(marks, "a").write("thread\\n")
threading.Thread(target=late).start()  # not a daemon: Python's exit waits for it, and so must this one
from concurrent.futures import ThreadPoolExecutor
idle = ThreadPoolExecutor(2)  # never shut down: its idle worker must not hang the exit (as with Python's own)
idle.submit(lambda: None).result()
sys.stdout.write("unflushed output")
exit_without_teardown(int(sys.argv[2]))
open(marks, "a").write("after\\n")
"""


def _run(tmp_path, code):
    marks = tmp_path / f"marks-{code}"
    out = subprocess.run([sys.executable, "-c", _PROGRAM, str(marks), str(code)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    return out, marks.read_text().split() if marks.exists() else []


def test_exit_code_threads_atexit_and_output_are_kept(tmp_path):
    for code in (0, 3):
        out, marks = _run(tmp_path, code)
        assert out.returncode == code, out.stderr[-2000:]
        assert out.stdout == "unflushed output"
        assert marks == ["thread", "atexit"]  # the thread first (as Python's own exit), nothing after the call
