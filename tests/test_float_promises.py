"""tests/float_promises.py: the same bits means every bit; within rounding means ROUNDING on floats only."""
import math

import numpy as np
import pytest
import torch
from float_promises import ROUNDING, assert_same_bits, assert_within_rounding

WHY = "a test of the helper"


def test_the_same_bits_are_every_bit():
    logits = np.array([[1.5, -2.25, 0.1]], np.float32)
    nested = {"loss": 0.25, "auroc_macro": float("nan"), "cm": [[3, 1], [0, 2]], "label_names": ["a", "b"],
              "interval": (0.1, None)}
    assert_same_bits(logits.copy(), logits, "an array")
    assert_same_bits(torch.from_numpy(logits), torch.from_numpy(logits.copy()), "a tensor")
    assert_same_bits(dict(nested), nested, "a dict with NaN")  # NaN equals NaN
    one_ulp = np.nextafter(logits, np.float32(np.inf))
    for actual, expected in ((one_ulp, logits), (logits.astype(np.float64), logits), (logits[:, :2], logits),
                             (nested | {"loss": math.nextafter(0.25, 1)}, nested), (-0.0, 0.0),
                             (nested | {"cm": [[3, 1], [1, 2]]}, nested), ({"loss": 0.25}, nested), (True, 1)):
        with pytest.raises(AssertionError, match="what: not the same bits"):
            assert_same_bits(actual, expected, "what")


def test_within_rounding_tolerates_floats_only_and_asks_why():
    logits = np.array([[5.0, -0.5, 0.0]], np.float32)
    assert_within_rounding(logits + np.float32(4e-6), logits, "a few ulps", why=WHY)
    assert_within_rounding({"loss": 4.633695609190301, "n": 3, "interval": [0.5, None]},
                           {"loss": 4.633695805291762, "n": 3, "interval": [0.5, None]}, "issue 46's loss", why=WHY)
    assert_within_rounding(float("nan"), float("nan"), "NaN", why=WHY)
    for actual in (logits + np.float32(2 * ROUNDING), logits * np.float32(1 + 2 * ROUNDING)):
        with pytest.raises(AssertionError, match=r"what: not within float rounding \(ROUNDING = 1e-05\) \(why\)"):
            assert_within_rounding(actual, logits, "what", why="why")
    for actual, expected in (({"n": 4}, {"n": 3}), (np.array([1, 2]), np.array([1, 3])), ([1.0], [1.0, 2.0])):
        with pytest.raises(AssertionError):
            assert_within_rounding(actual, expected, "exact", why=WHY)
    for why in ("", " ", None):
        with pytest.raises(ValueError, match="why= must say why"):
            assert_within_rounding(1.0, 1.0, "what", why=why)
