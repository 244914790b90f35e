"""The suite's own hygiene: a pytest run stopped by SIGTERM stops what its tests started (tests/process_leaks.py)."""
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

CONFTEST = """
import os, subprocess, pytest, process_leaks

def pytest_configure(config):
    if {install}:
        process_leaks.stop_on_sigterm(config)

@pytest.fixture
def daemon(tmp_path_factory):
    # a process in a session of its own, as a test's swarm started as a user does: no signal of the test's reaches it
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    with open({pids!r}, "a") as f:
        f.write(f"{{proc.pid}} {{os.getpid()}}\\n")  # the daemon, the worker
    yield proc
    proc.kill()
    proc.wait()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _as_a_background_job() -> None:
    """SIGINT ignored, as a shell's ``&`` or a batch script starts a command: then xdist's workers cannot be
    interrupted when their controller is gone (execnet interrupts a worker's main thread with SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _left_after_sigterm(tmp_path, install: bool) -> list:
    folder = tmp_path / ("with" if install else "without")
    folder.mkdir()
    pids = folder / "pids"
    (folder / "conftest.py").write_text(CONFTEST.format(install=install, pids=str(pids)))
    (folder / "test_long.py").write_text("import time\n\ndef test_long(daemon):\n    time.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": HERE}
    with open(folder / "pytest.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "1", "-q", "-c",
                                 os.devnull, "--rootdir", str(folder), str(folder)], cwd=folder, env=env, stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=_as_a_background_job)
    started = []
    try:
        deadline = time.monotonic() + 120
        while not (pids.exists() and pids.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pids.exists(), (folder / "pytest.log").read_text()
        started = [int(pid) for pid in pids.read_text().split()]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 10  # the test it stopped sleeps for 120 s: its teardown is the signal's
        while _alive(started[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [pid for pid in started[:1] if _alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in started:  # the daemon, and the worker a stopped controller leaves
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_run_stopped_by_sigterm_tears_its_fixtures_down(tmp_path):
    """SIGTERM to pytest's controller (xdist, one worker; started as a background job) while a test runs: the
    daemon its fixture started is stopped by the fixture's teardown, as at Ctrl-C; without the suite's handler
    it is left serving on (the controller dies at once, and its worker goes on with the test)."""
    assert _left_after_sigterm(tmp_path, install=True) == []
    assert len(_left_after_sigterm(tmp_path, install=False)) == 1  # the handler is what stops it
