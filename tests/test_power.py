"""The power of a paired comparison (issue 52): the rows a difference needs and the minimum
detectable effect, checked against a simulation of McNemar's exact test (the test compare runs)."""
import numpy as np
import pytest
from scipy.stats import binom

from dist_eval.power import minimum_detectable_effect, power_summary, rows_for_effect


def simulated_power(rows: int, effect: float, discordance: float, runs: int = 20000, seed: int = 0) -> float:
    """The share of ``runs`` paired sets of ``rows`` rows (a share ``discordance`` right in one model
    only, B ahead by ``effect``) where McNemar's exact test rejects at 0.05."""
    rng = np.random.default_rng(seed)
    a_only, b_only, _ = rng.multinomial(rows, [(discordance - effect) / 2, (discordance + effect) / 2,
                                               1 - discordance], size=runs).T
    pvalue = np.minimum(1.0, 2 * binom.cdf(np.minimum(a_only, b_only), a_only + b_only, 0.5))
    return float((pvalue < 0.05).mean())


@pytest.mark.parametrize("effect, discordance", [(0.01, 0.05), (0.02, 0.1), (0.05, 0.2), (0.1, 0.3)])
def test_the_rows_for_an_effect_give_80_percent_power(effect, discordance):
    rows = rows_for_effect(effect, discordance)
    # 0.805, 0.801, 0.809, 0.807 (20,000 runs); without the continuity correction 0.76-0.78
    assert 0.795 <= simulated_power(rows, effect, discordance) <= 0.815
    assert simulated_power(int(0.8 * rows), effect, discordance) < 0.75  # fewer rows: less power
    assert rows_for_effect(-effect, discordance) == rows
    assert rows_for_effect(effect, discordance, design_effect=2.0) in (2 * rows - 1, 2 * rows)


@pytest.mark.parametrize("rows, discordance", [(800, 0.1), (200, 0.3), (5000, 0.05)])
def test_the_minimum_detectable_effect_is_detected_80_percent_of_the_time(rows, discordance):
    effect = minimum_detectable_effect(rows, discordance)
    assert 0.795 <= simulated_power(rows, effect, discordance, seed=1) <= 0.815  # 0.810, 0.810, 0.799
    assert rows_for_effect(effect * (1 + 1e-9), discordance) <= rows
    assert minimum_detectable_effect(rows, discordance, design_effect=4.0) == pytest.approx(
        minimum_detectable_effect(rows // 4, discordance))


def test_no_effect_is_detectable_without_discordant_rows_or_with_too_few():
    assert minimum_detectable_effect(100, 0.0) is None and minimum_detectable_effect(3, 0.5) is None
    assert power_summary(0, 0)["minimum_detectable_effect"] is None
    with pytest.raises(ValueError, match="discordance"):
        rows_for_effect(0.2, 0.1)


def test_the_planning_command_prints_the_same_numbers(capsys):
    """python -m dist_eval.power: --effect gives rows_for_effect's rows, --rows the MDE; a bad flag:
    one line, exit 2."""
    from dist_eval.power import main

    assert main(["--effect", "0.01", "--discordance", "0.1"]) == 0
    assert capsys.readouterr().out.startswith(f"dist_eval.power: {rows_for_effect(0.01, 0.1)} rows detect ")
    assert main(["--rows", "800", "--discordance", "0.1", "--design-effect", "2"]) == 0
    assert f"of {minimum_detectable_effect(800, 0.1, design_effect=2.0):.4f} (" in capsys.readouterr().out
    for args, flag in ((["--effect", "0.3", "--discordance", "0.1"], "--effect 0.3"),
                       (["--rows", "8", "--discordance", "1.5"], "--discordance 1.5"),
                       (["--rows", "8", "--discordance", "0.1", "--design-effect", "0.5"], "--design-effect 0.5")):
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"dist_eval.power: error: {flag}: expected ") and "\n" not in err
