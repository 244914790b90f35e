"""The suite's own hygiene: a pytest run stopped by SIGTERM stops what its tests started (tests/process_leaks.py)."""
import os
import signal
import subprocess
import sys
import time

import pytest
from process_leaks import alive

HERE = os.path.dirname(os.path.abspath(__file__))

CONFTEST = """
import os, subprocess, time, pytest, process_leaks

def pytest_configure(config):
    if {install}:
        config.pluginmanager.register(process_leaks)
        process_leaks.stop_on_sigterm(config)

@pytest.fixture
def daemon():
    # a process in a session of its own, as a test's swarm started as a user does: no signal of the test's reaches it
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    with open({pids!r}, "a") as f:
        f.write(f"{{proc.pid}} {{os.getpid()}}\\n")  # the daemon, the worker
    yield proc
    time.sleep({teardown_s})  # a teardown that takes its time (a swarm's drain)
    proc.kill()
    proc.wait()
    open({torn_down!r}, "w").close()
"""


def _as_a_background_job() -> None:
    """SIGINT ignored, as a shell's ``&`` or a batch script starts a command: then xdist's workers cannot be
    interrupted when their controller is gone (execnet interrupts a worker's main thread with SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _left_after_sigterm(folder, install: bool, teardown_s: float, signals: int = 1) -> tuple:
    """(the daemon of a test's fixture if alive 5 s after its pytest run (xdist, one worker, a background job)
    ended on a SIGTERM to its controller mid-test, whether the fixture's teardown ran to its end); ``signals=2``:
    a second SIGTERM to the worker a second into its teardown."""
    folder.mkdir()
    pids, torn_down = folder / "pids", folder / "torn_down"
    (folder / "conftest.py").write_text(CONFTEST.format(install=install, pids=str(pids), teardown_s=teardown_s,
                                                        torn_down=str(torn_down)))
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
        if signals == 2:
            time.sleep(1.0)
            os.kill(started[1], signal.SIGTERM)  # as a group's kill or `timeout` reaches every process
        proc.wait(timeout=90)
        deadline = time.monotonic() + 5  # the test it stopped sleeps for 120 s: the daemon's end is the signal's
        while alive(started[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [pid for pid in started[:1] if alive(pid)], torn_down.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in started:  # the daemon, and the worker a stopped controller leaves
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("teardown_s, signals", [(0, 1), (3, 2), (15, 1)])
def test_a_run_stopped_by_sigterm_stops_what_its_tests_started(tmp_path, teardown_s, signals):
    """SIGTERM to pytest's controller (xdist, one worker; started as a background job) while a test runs: the
    daemon its fixture started is stopped by the fixture's teardown, which a second SIGTERM a second into it does
    not cut short; where the teardown outlasts xdist's 10 s for a worker to end, by the run's last step."""
    left, torn_down = _left_after_sigterm(tmp_path / "with", True, teardown_s, signals)
    assert left == []
    assert torn_down == (teardown_s < 10)


def test_without_the_handler_a_run_stopped_by_sigterm_leaves_its_processes(tmp_path):
    """pytest's default: the controller dies at once, its worker goes on with the test, the daemon lives on."""
    left, torn_down = _left_after_sigterm(tmp_path / "without", False, 0)
    assert len(left) == 1 and not torn_down
