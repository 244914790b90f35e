"""Progress: the rendering modes in one process, and a real CLI run in log mode whose
progress lines (stderr) reach the total while stdout keeps the summary."""
import io
import re
import time

import pytest
from conftest import write_csv
from inprocess_cli import run_cli_in_process

from dist_eval.progress import GlobalProgress, format_duration, resolve_mode

LINE = re.compile(
    r"^dist_eval: progress (\d+)/(\d+) samples \((\d+)%\), [\d.]+ samples/s, elapsed [\d:]+, "
    r"(ETA [\d:?]+|done|stopped)$"
)


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def progress_lines(text):
    return [LINE.match(line) for line in text.splitlines() if line.startswith("dist_eval: progress")]


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    """Wait until ``condition()`` (the progress thread's turn comes when it comes), failing only
    if it never does."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.005)


def test_log_mode_reaches_the_total():
    out = io.StringIO()
    # a line per 10% of the rows (the time-based lines, every log_every_s, kept out of the way)
    with GlobalProgress(100, "log", stream=out, refresh_s=0.01, log_every_s=3600) as progress:
        for step in range(1, 10):
            progress.update(10)
            # the rows so far are shown while running, whenever the thread gets the core
            wait_for(lambda step=step: f"progress {10 * step}/100 " in out.getvalue(), f"a line for {10 * step} rows")
        progress.update(10)
    matches = progress_lines(out.getvalue())
    assert all(matches), out.getvalue()
    done = [int(m.group(1)) for m in matches]
    assert done == sorted(done) and len(set(done)) == len(done)  # no repeated line
    assert done == list(range(10, 101, 10))  # a line for each 10% while running, then the final one
    assert matches[-1].group(1, 2, 4) == ("100", "100", "done")


def test_bar_mode_redraws_one_line():
    out = FakeTerminal()
    with GlobalProgress(40, "auto", stream=out, refresh_s=0.01) as progress:  # a terminal: auto = bar
        for _ in range(4):
            progress.update(10)
            time.sleep(0.03)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # redrawn in place, one final newline
    final = text.rstrip("\n").split("\r")[-1]
    assert re.match(r"dist_eval \[#{30}\] 40/40 100%  [\d.]+ samples/s  [\d:]+ elapsed", final), final


def test_a_failed_run_says_stopped():
    out = io.StringIO()
    progress = GlobalProgress(50, "log", stream=out, refresh_s=10)
    progress.start()
    progress.update(20)
    progress.close(completed=False)
    progress.close()  # a second close (the CLI's cleanup) writes nothing more
    matches = progress_lines(out.getvalue())
    assert [m.group(1, 4) for m in matches] == [("20", "stopped")]


@pytest.mark.parametrize(
    "mode,quiet,tty,expected",
    [
        ("auto", False, True, "bar"),
        ("auto", False, False, "log"),
        ("auto", True, True, "none"),
        ("log", True, False, "log"),
        ("none", False, True, "none"),
        ("bar", False, False, "bar"),
    ],
)
def test_mode_resolution(mode, quiet, tty, expected):
    assert resolve_mode(mode, quiet, FakeTerminal() if tty else io.StringIO()) == expected


def test_none_writes_nothing():
    out = io.StringIO()
    with GlobalProgress(10, "none", stream=out) as progress:
        progress.update(10)
    assert out.getvalue() == ""
    with pytest.raises(ValueError, match="expected one of auto, bar, log, none"):
        resolve_mode("fancy", False, out)


def test_durations():
    assert [format_duration(s) for s in (0, 61.4, 3725, None)] == ["0:00", "1:01", "1:02:05", "?"]


def test_cli_log_mode_prints_progress_to_stderr(tiny_model, tiny_checkpoint, tmp_path, capfd):
    data = write_csv(str(tmp_path / "data.csv"), 37, seed=11)
    code = run_cli_in_process(
        [
            "--model",
            tiny_model,
            "--data-files",
            data,
            "--backend",
            "local",
            "--checkpoint",
            tiny_checkpoint,
            "--output-dir",
            str(tmp_path / "out"),
            "--batch-size",
            "4",
            "--progress",
            "log",
            "--bootstrap-resamples",
            "200",
        ]
    )
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    matches = progress_lines(err)
    assert matches and all(matches), err[-3000:]
    assert matches[-1].group(1, 2, 4) == ("37", "37", "done")
    assert all(int(m.group(2)) == 37 for m in matches)
    assert "progress" not in out  # stdout holds the summary only
    assert re.search(r"^  accuracy \d\.\d{4}", out, re.M)


def test_cli_quiet_shows_no_progress(tiny_model, tiny_checkpoint, tmp_path, capfd):
    data = write_csv(str(tmp_path / "data.csv"), 9, seed=12)
    code = run_cli_in_process(
        [
            "--model",
            tiny_model,
            "--data-files",
            data,
            "--backend",
            "local",
            "--checkpoint",
            tiny_checkpoint,
            "--output-dir",
            str(tmp_path / "out"),
            "--quiet",
        ]
    )
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert "progress" not in err and "progress" not in out
    assert re.fullmatch(r"dist_eval: accuracy \d\.\d{4} on 9 samples -> .*metrics\.json\n", out)
