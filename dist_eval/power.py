"""The power of a paired comparison of accuracies (issue 52): how small a difference a run of
n rows can detect, and how many rows a difference needs.

Pure functions of counts (scipy's normal quantiles only). The test is McNemar's on paired
rows: of the n rows, a share ``discordance`` (psi) is right in one model only; a difference
in accuracy delta = (B only - A only) / n. The rows needed at level alpha (two-sided) and power
1 - beta are Connor's (1987, Biometrics 43: 207-211), continuity-corrected as Fleiss, Levin
and Paik's (2003) are, for the exact test is conservative (its power at Connor's n is 0.76-0.79):

    n0 = (z_{1 - alpha/2} sqrt(psi) + z_{1 - beta} sqrt(psi - delta^2))^2 / delta^2
    n = n0 / 4 (1 + sqrt(1 + 4 / (n0 delta)))^2

(the n where sqrt(n) delta - 1 / sqrt(n) = z_{1 - alpha/2} sqrt(psi) + z_{1 - beta} sqrt(psi - delta^2)),
and the minimum detectable effect (MDE) of n rows is the delta that solves the same equation. Clustered rows
(``design_effect`` D > 1, :mod:`dist_eval.clusters`) need D times the rows; their MDE is that
of n / D rows. ``tests/test_power.py`` checks both against a simulation of the exact test.
``python -m dist_eval.power`` prints them, to plan a comparison before any run.
"""
from __future__ import annotations

import math
from typing import Optional

ALPHA = 0.05
POWER = 0.8


def _z(alpha: float, power: float) -> tuple:
    from scipy.stats import norm

    if not 0.0 < alpha < 1.0 or not 0.0 < power < 1.0:
        raise ValueError(f"alpha and power must lie in (0, 1); got {alpha}, {power}")
    return float(norm.ppf(1.0 - alpha / 2.0)), float(norm.ppf(power))


def rows_for_effect(effect: float, discordance: float, alpha: float = ALPHA, power: float = POWER,
                    design_effect: float = 1.0) -> int:
    """Rows a paired comparison needs to detect a difference in accuracy of ``effect`` (either
    sign) with probability ``power`` at level ``alpha``, when a share ``discordance`` of the rows
    is right in one model only (at least ``|effect|``: the difference is made of those rows).
    """
    effect = abs(float(effect))
    if not 0.0 < effect <= discordance <= 1.0:
        raise ValueError(f"expected 0 < |effect| <= discordance <= 1 (the difference is made of the discordant "
                         f"rows); got effect {effect}, discordance {discordance}")
    if not design_effect >= 1.0:
        raise ValueError(f"design_effect must be >= 1; got {design_effect}")
    z_alpha, z_power = _z(alpha, power)
    spread = z_alpha * math.sqrt(discordance) + z_power * math.sqrt(discordance - effect ** 2)
    rows = spread ** 2 / effect ** 2
    corrected = rows / 4 * (1 + math.sqrt(1 + 4 / (rows * effect))) ** 2  # the continuity correction
    return int(math.ceil(corrected * design_effect - 1e-9))


def minimum_detectable_effect(rows: int, discordance: float, alpha: float = ALPHA, power: float = POWER,
                              design_effect: float = 1.0) -> Optional[float]:
    """The smallest difference in accuracy that ``rows`` paired rows with this ``discordance``
    detect with probability ``power`` at level ``alpha`` (Connor's n solved for delta); None
    when no difference can be (no discordant rows, or too few rows even for delta = discordance).
    """
    if rows <= 0 or not 0.0 < discordance <= 1.0:
        return None
    z_alpha, z_power = _z(alpha, power)
    effective = rows / max(1.0, float(design_effect))

    def excess(delta: float) -> float:  # > 0: delta is detected with more than the power asked
        return math.sqrt(effective) * delta - 1 / math.sqrt(effective) - z_alpha * math.sqrt(discordance) \
            - z_power * math.sqrt(max(0.0, discordance - delta ** 2))

    if excess(discordance) < 0:
        return None
    low, high = 0.0, discordance  # excess grows with delta: bisect to float precision
    for _ in range(200):
        middle = (low + high) / 2
        if middle in (low, high):
            break
        low, high = (middle, high) if excess(middle) < 0 else (low, middle)
    return high


def power_summary(rows: int, discordant: int, design_effect: float = 1.0) -> dict:
    """What a comparison's report says of its power: ``{"alpha", "power", "rows", "discordance",
    "minimum_detectable_effect"}`` (and ``design_effect`` when clustered) of the rows compared.
    """
    discordance = discordant / rows if rows else 0.0
    out = {"alpha": ALPHA, "power": POWER, "rows": int(rows), "discordance": discordance,
           "minimum_detectable_effect": minimum_detectable_effect(rows, discordance, design_effect=design_effect)}
    if design_effect != 1.0:
        out["design_effect"] = float(design_effect)
    return out


# --- python -m dist_eval.power: planning a comparison before any run -------------------------

def build_parser():
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m dist_eval.power",
        description="Plan a paired comparison of two checkpoints' accuracies (McNemar's exact test): the rows a "
                    "difference needs (--effect), or the smallest difference a number of rows detects (--rows).",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--effect", type=float, metavar="D",
                      help="the difference in accuracy to detect (0.01: one point): prints the rows it needs")
    what.add_argument("--rows", type=int, metavar="N", help="the rows compared: prints their minimum detectable effect")
    parser.add_argument("--discordance", type=float, required=True, metavar="P",
                        help="the share of rows right in one checkpoint only (compare prints it for two runs)")
    parser.add_argument("--design-effect", type=float, default=1.0, metavar="X",
                        help="clustered rows (--cluster-by): the design effect of the difference (default 1)")
    parser.add_argument("--alpha", type=float, default=ALPHA, help=f"the test's level (default {ALPHA:g})")
    parser.add_argument("--power", type=float, default=POWER, help=f"the power asked (default {POWER:g})")
    return parser


def plan(args) -> str:
    """The line ``python -m dist_eval.power`` prints; a bad argument is a UsageError naming its flag."""
    from dist_eval.errors import UsageError

    for flag, value, low, high in (("--discordance", args.discordance, 0.0, 1.0), ("--alpha", args.alpha, 0.0, 1.0),
                                   ("--power", args.power, 0.0, 1.0)):
        if not low < value < high and not (flag == "--discordance" and value == 1.0):
            raise UsageError(f"{flag} {value:g}: expected a share in (0, 1). Pass e.g. {flag} "
                             f"{dict(alpha=0.05, power=0.8).get(flag[2:], 0.1)}.")
    if args.design_effect < 1.0:
        raise UsageError(f"--design-effect {args.design_effect:g}: expected 1 or more (1: independent rows).")
    clustered = f", design effect {args.design_effect:g}" if args.design_effect != 1.0 else ""
    at = (f"with {100 * args.power:g}% power at level {args.alpha:g}, {100 * args.discordance:g}% of the rows right "
          f"in one checkpoint only{clustered}")
    if args.effect is not None:
        if not 0 < abs(args.effect) <= args.discordance:
            raise UsageError(f"--effect {args.effect:g}: expected a difference in (0, --discordance "
                             f"{args.discordance:g}] (a difference is made of the discordant rows). Pass a smaller "
                             "--effect or a larger --discordance.")
        rows = rows_for_effect(args.effect, args.discordance, args.alpha, args.power, args.design_effect)
        return f"dist_eval.power: {rows} rows detect a difference in accuracy of {abs(args.effect):g} {at}"
    if args.rows <= 0:
        raise UsageError(f"--rows {args.rows}: expected a number of rows >= 1.")
    mde = minimum_detectable_effect(args.rows, args.discordance, args.alpha, args.power, args.design_effect)
    if mde is None:
        return f"dist_eval.power: {args.rows} rows detect no difference in accuracy {at}"
    return (f"dist_eval.power: {args.rows} rows detect a difference in accuracy of {mde:.4f} ({100 * mde:.2f} points) "
            f"or more {at} (minimum detectable effect)")


def main(argv=None) -> int:
    import sys

    from dist_eval.errors import UsageError

    args = build_parser().parse_args(argv)
    try:
        print(plan(args), flush=True)
    except UsageError as e:
        print(f"dist_eval.power: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
