"""``with phase(name)`` (dist_eval.ranks.phases) in one process: names bound inside are bound
after, a failure becomes a RankFailure (a usage error stays one), a failure agreed on in a
nested phase passes through unchanged. Several ranks: tests/test_cli_bad_input.py, test_cli.py,
and the failure flag of a stop_early phase below (tests/stop_early_worker.py)."""
import json
import os
import signal

import pytest
from conftest import REPO, run_ranks

from dist_eval import ranks
from dist_eval.errors import UsageError


@pytest.mark.parametrize("main_first", [False, True])
def test_the_body_runs_once_and_is_timed(main_first):
    """In one process the body runs once, here (main_first or not: this is rank 0), gets no
    failure flag unless asked, and its wall time is recorded under its name."""
    ranks.phase_seconds.clear()
    runs = []
    with ranks.phase("computing", main_first=main_first) as flag:
        runs.append(ranks.get_rank())
    assert runs == [0] and flag is None
    assert list(ranks.phase_seconds) == ["computing"] and ranks.phase_seconds["computing"] >= 0
    with ranks.phase("checking", stop_early=True) as flag:
        flag.check()  # no other rank failed: returns
    assert type(flag).__name__ == "FailureFlag"


def test_a_usage_error_fails_the_phase_as_a_usage_failure():
    with pytest.raises(ranks.RankFailure) as caught, ranks.phase("checking"):
        raise UsageError("expected a positive integer.", param="batch_size", value=0)
    assert caught.value.usage and str(caught.value) == "batch_size=0: expected a positive integer."


def test_an_internal_error_names_the_phase():
    with pytest.raises(ranks.RankFailure) as caught, ranks.phase("merging the results"):
        raise RuntimeError("boom")
    assert not caught.value.usage and str(caught.value) == "merging the results failed: RuntimeError: boom"


def test_a_failure_agreed_on_in_a_nested_phase_passes_through():
    with pytest.raises(ranks.RankFailure) as caught, ranks.phase("outer"), ranks.phase("inner"):
        raise UsageError("bad row")
    assert caught.value.phase == "inner" and caught.value.usage and str(caught.value) == "bad row"


def test_each_phase_records_its_wall_seconds():
    import time

    ranks.phase_seconds.clear()
    with ranks.phase("sleeping"):
        time.sleep(0.05)
    with pytest.raises(ranks.RankFailure), ranks.phase("failing"):
        raise ValueError("boom")
    assert list(ranks.phase_seconds) == ["sleeping", "failing"]
    assert 0.05 <= ranks.phase_seconds["sleeping"] < 5


@pytest.mark.multiproc
def test_a_failure_stops_the_other_ranks_with_few_store_reads(tmp_path, rank_zygote):
    """2 real ranks (gloo; forked by conftest's run_ranks: the phases are tested, not the launch):
    rank 0 checks the phase's failure flag once per "batch" in a fast loop while rank 1 fails after
    a second. Rank 0 stops, and the checks asked the c10d store at most once per CHECK_INTERVAL,
    not once per call."""
    from dist_eval.ranks.phases import FailureFlag

    out = tmp_path / "facts.json"
    proc = run_ranks(rank_zygote, [str(out)], nproc=2, timeout=120,
                     script=os.path.join(REPO, "tests", "stop_early_worker.py"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(out.read_text())
    assert "never_stopped" not in facts
    assert facts["failure"] == "rank 1: the forward passes failed: ValueError: rank 1 broke"
    assert facts["stopped_after_s"] >= 1.0  # it ran until rank 1 failed ...
    assert facts["calls"] > 10 * facts["reads"]  # ... checking far more often than it asked the store
    # at most one read per interval (the first at once)
    assert facts["reads"] <= facts["elapsed_s"] / FailureFlag.CHECK_INTERVAL + 1


def test_a_failure_every_rank_met_alike_is_shared():
    """Issue 29: a broken model folder failed both ranks with one message; both printed it,
    glued on one line. Shared: the CLI prints it from rank 0 alone."""
    from dist_eval.ranks.phases import RankFailure

    same = [(0, "internal", "loading failed: X"), (1, "internal", "loading failed: X")]
    assert RankFailure("p", same, 2).shared and str(RankFailure("p", same, 2)) == "loading failed: X"
    assert not RankFailure("p", same[:1], 2).shared  # rank 1 alone knows nothing of it
    assert not RankFailure("p", [same[0], (1, "internal", "other")], 2).shared


def test_the_cli_prints_a_shared_failure_from_rank_0_alone(monkeypatch, capfd):
    from dist_eval import cli
    from dist_eval.ranks.phases import RankFailure

    failure = RankFailure("p", [(0, "internal", "loading failed: X"), (1, "internal", "loading failed: X")], 2)

    def fail(config):
        raise failure

    monkeypatch.setattr("dist_eval.pipeline.run", fail)
    monkeypatch.setattr(cli.ranks, "get_rank", lambda: 1)
    args = cli.build_parser().parse_args([])
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert cli._main(args) == cli.EXIT_FAILURE
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "loading failed" not in capfd.readouterr().err
