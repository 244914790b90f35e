"""``with phase(name)`` (dist_eval.ranks.phases) in one process: names bound inside are bound
after, a failure becomes a RankFailure (a usage error stays one), a failure agreed on in a
nested phase passes through unchanged. Several ranks: tests/test_cli_bad_input.py, test_cli.py."""
import pytest

from dist_eval import ranks
from dist_eval.errors import UsageError


@pytest.mark.parametrize("main_first", [False, True])
def test_names_bound_in_a_phase_are_bound_after_it(main_first):
    with ranks.phase("computing", main_first=main_first):
        value = 41 + 1
    assert value == 42


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
