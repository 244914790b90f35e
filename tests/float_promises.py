"""The two promises a test comparing a model's floats checks (docs/design.md, "Bit for bit, or
within float rounding").

- ``assert_same_bits``: the same batch plan (the same rows in the same batches, the same padded
  shapes) on one machine gives the same bits: any N, swarm or local backend, resumed or not, the
  row store's rows read back. Exact: floats, arrays and tensors (dtype, shape, every bit; NaN
  equals NaN), and whatever else (ints, strings, None) in nested dicts, lists and tuples.
- ``assert_within_rounding``: another batch plan (a slice alone, a ``--limit`` subset, rows served
  from the row store into another run's batches, another batch size or token budget), another
  implementation of the same model (transformers' own, a step-by-step reference) or another
  device rounds the last bits differently: equal within ``ROUNDING``, and ``why`` says what differs.
  Only floats get the tolerance; everything else (counts, predictions, names) is compared exactly.

``FLOAT_PROMISES_LOG=FILE`` appends each within-rounding comparison's largest scaled difference
(``|actual - expected| / (1 + |expected|)``) to FILE, a line each: how close the measured
differences come to ``ROUNDING``.
"""
import math
import os
from typing import Any, List, Optional, Tuple

import numpy as np

# The one tolerance of a comparison across batch plans: |actual - expected| <= ROUNDING * (1 + |expected|),
# i.e. relative for values above 1 and absolute below. The logits are float32 (eps 1.2e-7): another
# summation order (another padded length, another kernel's blocking, another instruction set) moves a
# logit of the tiny test models by a few ulps (measured under default, avx2 and avx512: at most 2.9e-6 in
# logits up to 15, 1.2e-6 scaled as here; benchmarks/RESULTS.md, 2026-11-25), and the float64 metrics
# computed from them (loss, probabilities, ECE, Brier, the bootstrap intervals) by no more. 1e-5 is about
# 80 float32 ulps at 1.0: 8x the largest measured, and far below any real change (a prompt value, a
# weight, a wrong row moves a logit by 1e-3 or more).
ROUNDING = 1e-5
# Another transformers generation than the pinned one (4.57's or 5.x's own classes, PEFT's own forward) computes
# the same model with other kernels and another order of operations: each row's logits within this, absolute
# (every family against transformers 5.23: at most 1.72e-05, benchmarks/RESULTS.md), far below any real change.
ACROSS_GENERATIONS = 1e-4

_FLOAT_KINDS = "fc"


def _describe(path: Tuple) -> str:
    return "".join(f"[{p!r}]" for p in path) or "(the value)"


def _as_array(value) -> Optional[np.ndarray]:
    """A numpy array of an array or tensor (bfloat16 widened to float32); None for anything else."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        import torch

        tensor = value.detach().cpu()
        return (tensor.to(torch.float32) if tensor.dtype == torch.bfloat16 else tensor).numpy()
    return None


def _dtype_name(value) -> str:
    return str(getattr(value, "dtype", type(value).__name__))


def _compare(actual, expected, path: Tuple, close, problems: List[str], scaled: List[float]) -> None:
    """Appends to ``problems`` each place where ``actual`` and ``expected`` differ (``close`` decides floats)."""
    actual, expected = (v.item() if isinstance(v, np.generic) else v for v in (actual, expected))
    if isinstance(expected, dict) or isinstance(actual, dict):
        if not (isinstance(expected, dict) and isinstance(actual, dict)) or actual.keys() != expected.keys():
            problems.append(f"{_describe(path)}: keys {sorted(map(str, getattr(actual, 'keys', list)()))} "
                            f"!= {sorted(map(str, getattr(expected, 'keys', list)()))}")
            return
        for key in expected:
            _compare(actual[key], expected[key], path + (key,), close, problems, scaled)
        return
    got, want = _as_array(actual), _as_array(expected)
    if got is not None or want is not None:
        both = got is not None and want is not None
        got, want = np.asarray(actual if got is None else got), np.asarray(expected if want is None else want)
        if got.shape != want.shape or (close is _same_bits and both and _dtype_name(actual) != _dtype_name(expected)):
            problems.append(f"{_describe(path)}: {_dtype_name(actual)}{list(got.shape)} != "
                            f"{_dtype_name(expected)}{list(want.shape)}")
            return
        _compare_arrays(got, want, path, close, problems, scaled)
        return
    if isinstance(expected, (list, tuple)) or isinstance(actual, (list, tuple)):
        if not (isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple))) or len(actual) != len(
                expected):
            problems.append(f"{_describe(path)}: {actual!r:.200} != {expected!r:.200}")
            return
        for i, (a, e) in enumerate(zip(actual, expected)):
            _compare(a, e, path + (i,), close, problems, scaled)
        return
    if isinstance(expected, float) or isinstance(actual, float):
        if isinstance(actual, (int, float)) and isinstance(expected, (int, float)) and not isinstance(
                actual, bool) and close(float(actual), float(expected), scaled):
            return
    elif actual == expected and type(actual) is type(expected):
        return
    problems.append(f"{_describe(path)}: {actual!r:.200} != {expected!r:.200}")


def _compare_arrays(got: np.ndarray, want: np.ndarray, path, close, problems: List[str], scaled: List[float]):
    if want.dtype.kind not in _FLOAT_KINDS:
        if not np.array_equal(got, want):
            where = np.argwhere(got != want)[0]
            problems.append(f"{_describe(path)}{list(where)}: {got[tuple(where)]!r} != {want[tuple(where)]!r}")
        return
    bad = [i for i, (a, e) in enumerate(zip(got.ravel().tolist(), want.ravel().tolist())) if not close(a, e, scaled)]
    if bad:
        worst = np.abs(got.astype(np.float64) - want.astype(np.float64)).ravel()
        where = list(np.unravel_index(bad[0], want.shape))
        problems.append(f"{_describe(path)}: {len(bad)} of {want.size} differ, the first at {where}: "
                        f"{got.ravel()[bad[0]]!r} != {want.ravel()[bad[0]]!r} (largest difference "
                        f"{np.nanmax(worst) if np.isfinite(worst).any() else worst.max()!r})")


def _same_bits(a: float, e: float, scaled: List[float]) -> bool:
    if math.isnan(a) or math.isnan(e):
        return math.isnan(a) and math.isnan(e)
    return a == e and math.copysign(1.0, a) == math.copysign(1.0, e)


def _within_rounding(a: float, e: float, scaled: List[float]) -> bool:
    if math.isnan(a) or math.isnan(e):
        return math.isnan(a) and math.isnan(e)
    if math.isinf(a) or math.isinf(e):
        return a == e
    scaled.append(abs(a - e) / (1.0 + abs(e)))
    return abs(a - e) <= ROUNDING * (1.0 + abs(e))


def _fail(kind: str, what: str, problems: List[str], why: str = "") -> None:
    shown = "\n  ".join(problems[:10]) + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
    raise AssertionError(f"{what}: not {kind}{f' ({why})' if why else ''}:\n  {shown}")


def assert_same_bits(actual: Any, expected: Any, what: str) -> None:
    """The same batch plan on one machine: ``actual`` is ``expected`` bit for bit (NaN equals NaN).

    ``what`` names the values (e.g. "the logits, N=2 against N=1").
    """
    problems: List[str] = []
    _compare(actual, expected, (), _same_bits, problems, [])
    if problems:
        _fail("the same bits", what, problems)


def assert_within_rounding(actual: Any, expected: Any, what: str, *, why: str) -> None:
    """Another batch plan (or implementation, or device): every float within ``ROUNDING``, the rest exact.

    ``why`` is required: what differs between the two sides, so that the looser promise is
    chosen for a reason (e.g. "the slice alone is planned into batches of its own").
    """
    if not (isinstance(why, str) and why.strip()):
        raise ValueError("assert_within_rounding: why= must say why the two sides are not the same batch plan")
    problems: List[str] = []
    scaled: List[float] = []
    _compare(actual, expected, (), _within_rounding, problems, scaled)
    log = os.environ.get("FLOAT_PROMISES_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{max(scaled, default=0.0):.3e}\t{what}\t{why}\n")
    if problems:
        _fail(f"within float rounding (ROUNDING = {ROUNDING})", what, problems, why)
