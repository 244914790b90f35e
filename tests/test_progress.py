"""Progress: the rendering modes in one process, and a real CLI run in log mode whose
progress lines (stderr) reach the total while stdout keeps the summary."""
import io
import re
import time

import numpy as np
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


BAR_FINAL = re.compile(
    r"^dist_eval: 100%\|#+\| (\S+)/(\S+) \[[\d:]+<[\d:]+, [\d.]+k? (rows|tok)/s, (\d+)/(\d+) rows, [\d.]+ samples/s\]$"
)


@pytest.fixture
def no_tqdm_disable(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)


def test_bar_mode_is_a_tqdm_bar_redrawn_on_one_line(no_tqdm_disable):
    from tqdm import tqdm

    out = FakeTerminal()
    with GlobalProgress(40, "auto", stream=out, refresh_s=0.01) as progress:  # a terminal: auto = bar
        assert isinstance(progress._bar, tqdm)
        for _ in range(4):
            progress.update(10)
            time.sleep(0.03)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # redrawn in place, one final newline
    final = BAR_FINAL.match(text.rstrip("\n").split("\r")[-1])
    assert final and final.groups() == ("40", "40", "rows", "40", "40"), text.split("\r")[-1]


def test_the_bar_counts_the_plans_work_with_the_rows_in_its_postfix(no_tqdm_disable):
    out = FakeTerminal()
    progress = GlobalProgress(1000, "bar", stream=out, refresh_s=3600)  # drawn here, by _render
    progress.set_plan([10, 10, 980], [100, 100, 19600])
    progress.start()
    progress.update(20)
    progress._render(final=False)
    line = out.getvalue().split("\r")[-1]
    assert (progress._bar.n, progress._bar.total) == pytest.approx((200, 19800))  # padded tokens, not rows
    assert "| 200/19.8k [" in line and "<?, " in line and ", 20/1000 rows, " in line, line  # 1% of the work: no ETA
    progress.update(500)  # 10,000 of 19,800 tokens
    time.sleep(0.05)
    progress._render(final=False)
    line = out.getvalue().split("\r")[-1]
    assert progress._bar.n == pytest.approx(200 + 19600 * 500 / 980) and ", 520/1000 rows, " in line, line
    assert "<?" not in line and re.search(r"<\d\d:\d\d, ", line), line  # tqdm's remaining time = eta_seconds
    progress.update(480)
    progress.close()
    final = BAR_FINAL.match(out.getvalue().rstrip("\n").split("\r")[-1])
    assert final and final.groups() == ("19.8k", "19.8k", "tok", "1000", "1000"), out.getvalue()[-300:]
    assert progress._bar is None and out.getvalue().endswith("\n")


def test_the_bar_is_tqdm_auto_s(no_tqdm_disable, monkeypatch):
    """tqdm.auto's class draws it: a widget in a notebook, where ``auto`` picks the bar."""
    import sys
    import types

    import tqdm.auto

    made = []

    class Recorded(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            made.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)
    kernel = types.SimpleNamespace(config={"IPKernelApp": {}})
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: kernel))
    notebook_stream = io.StringIO()  # a kernel's stderr is no terminal
    assert resolve_mode("auto", False, notebook_stream) == "bar"
    with GlobalProgress(10, "auto", stream=notebook_stream) as progress:
        progress.update(10)
    assert len(made) == 1 and made[0]["desc"] == "dist_eval"


def test_tqdm_disable_silences_the_bar_not_an_explicit_log(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    for mode in ("auto", "bar"):
        out = FakeTerminal()
        with GlobalProgress(10, mode, stream=out, refresh_s=0.01) as progress:
            progress.update(10)
        assert out.getvalue() == "" and not progress.enabled, mode
    out = io.StringIO()
    with GlobalProgress(10, "log", stream=out, refresh_s=0.01) as progress:
        progress.update(10)
    assert [m.group(1, 4) for m in progress_lines(out.getvalue())] == [("10", "done")]


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
        ("log", False, True, "log"),
    ],
)
def test_mode_resolution(mode, quiet, tty, expected, no_tqdm_disable):
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
    assert "\r" not in err  # plain lines in a file (stderr is one here), not a bar redrawn
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


@pytest.mark.parametrize("how", ["TQDM_DISABLE", "--progress none"])
def test_cli_silenced_shows_no_progress(how, tiny_model, tiny_checkpoint, tmp_path, capfd, monkeypatch):
    data = write_csv(str(tmp_path / "data.csv"), 9, seed=12)
    args = ["--model", tiny_model, "--data-files", data, "--backend", "local", "--checkpoint", tiny_checkpoint,
            "--output-dir", str(tmp_path / "out"), "--bootstrap-resamples", "20"]
    if how == "TQDM_DISABLE":
        monkeypatch.setenv("TQDM_DISABLE", "1")
    else:
        args += ["--progress", "none"]
    code = run_cli_in_process(args)
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert "progress" not in err and "\r" not in err and "rows/s" not in err, err[-3000:]
    assert re.search(r"^  accuracy \d\.\d{4}", out, re.M)


# ---- the ETA counts work (issue 29: at 2% a long-tailed run said "ETA 12:12" and ended 75 s later)


def _recorded_trace(world: int = 2, num_rows: int = 20000, seed: int = 0):
    """A recorded run without a wall clock: a long-tailed set's batch plan (longest first),
    each rank running its shard in order, a batch taking time per padded token plus a fixed
    overhead worth 250 of them (the plan's cost, padded tokens, does not count it).
    Returns (the plan as (rows, padded tokens) per batch, times, rows done over every rank
    after each batch)."""
    import numpy as np

    from dist_eval.data import plan_batches, shard_batch_ids

    rng = np.random.default_rng(seed)
    lengths = np.minimum(8 + (rng.pareto(1.5, num_rows) * 20).astype(np.int64), 512)
    planned = plan_batches(num_rows, 32, lengths, 4096)
    costs = [len(b) * int(lengths[b].max()) for b in planned]
    events = []
    for rank in range(world):
        clock = 0.0
        for b in shard_batch_ids(len(planned), rank, world):
            clock += 0.005 + 2e-5 * costs[b]
            events.append((clock, len(planned[b])))
    events.sort()
    times = np.array([t for t, _ in events])
    done = np.cumsum([n for _, n in events])
    return ([len(b) for b in planned], costs), times, done


def test_the_eta_at_10_percent_is_within_25_percent_of_the_remaining_time():
    from dist_eval.progress import WorkPlan, eta_seconds

    (rows, costs), times, done = _recorded_trace()
    total = int(done[-1])
    at = int(np.searchsorted(done, total // 10))  # the first update at 10% of the rows: the log line's
    eta = eta_seconds(times[at], int(done[at]), total, WorkPlan(rows, costs))
    remaining = times[-1] - times[at]
    assert abs(eta - remaining) <= 0.25 * remaining, (eta, remaining)
    # counted in rows, the same trace is far off (the first rows are the longest)
    assert abs(eta_seconds(times[at], int(done[at]), total) - remaining) > 0.25 * remaining


def test_no_eta_before_the_rate_means_anything():
    from dist_eval.progress import ETA_AFTER_WORK, WorkPlan, eta_seconds

    plan = WorkPlan([10, 10, 980], [100, 100, 19600])
    assert eta_seconds(0.1, 0, 1000, plan) is None
    assert eta_seconds(0.3, 1, 1000, plan) is None  # 0.05% of the work (before: 0.1% of the rows gave an ETA)
    assert plan.fraction(20) < ETA_AFTER_WORK <= plan.fraction(40)
    assert eta_seconds(5.0, 40, 1000, plan) == pytest.approx(5.0 * (19800 - 600) / 600)  # 200 + 400
    progress = GlobalProgress(1000, "log", stream=io.StringIO())
    progress.set_plan([10, 10, 980], [100, 100, 19600])
    progress.start()
    progress.update(1)
    progress._render(final=False)
    assert "ETA ?" in progress.stream.getvalue()
    progress.close()


def test_the_cli_gives_the_progress_its_plan(tiny_model, tiny_checkpoint, tmp_path, monkeypatch):
    plans = []
    monkeypatch.setattr(GlobalProgress, "set_plan", lambda self, rows, costs: plans.append((list(rows), list(costs))))
    data = write_csv(str(tmp_path / "data.csv"), 20, seed=1)
    args = ["--model", tiny_model, "--data-files", data, "--backend", "local", "--checkpoint", tiny_checkpoint,
            "--output-dir", str(tmp_path / "out"), "--batch-size", "4", "--progress", "none", "--quiet"]
    assert run_cli_in_process(args) == 0
    (rows, costs), = plans
    assert sum(rows) == 20 and len(costs) == len(rows) == 5 and costs == sorted(costs, reverse=True)
