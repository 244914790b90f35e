"""``python -m dist_eval.compare OUT_A OUT_B [OUT ...]``: the arguments checked, the runs read and compared, the
lines printed, ``--json`` written; exit 2 with one error line on a refusal.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from dist_eval.compare.formatting import (
    format_comparison,
    format_many,
    format_rows_for_effect,
    many_warning,
    one_side_warning,
)
from dist_eval.compare.read import load_run
from dist_eval.compare.statistics import compare_many, compare_runs
from dist_eval.errors import UsageError

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dist_eval.compare",
        description="Compare two dist_eval runs over the same data, their rows paired by content: metric differences, "
                    "the paired test and changed predictions; more runs: each pair (or each against --baseline), "
                    "Holm-adjusted.",
    )
    parser.add_argument("run_a", metavar="OUT_A", help="output folder of run A (metrics.json, predictions.jsonl)")
    parser.add_argument("run_b", metavar="OUT_B", help="output folder of run B")
    parser.add_argument("more", metavar="OUT", nargs="*",
                        help="more runs (checkpoints): each pair is compared, or each against --baseline, with "
                             "Holm's adjustment over every comparison")
    parser.add_argument("--baseline", metavar="OUT", default=None,
                        help="compare every other run with this one (one of the folders given), not each pair")
    parser.add_argument("--max-rows", type=int, default=20, help="changed rows to list (default 20; 0: none)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the paired test (McNemar p-value, bootstrap intervals of B - A) to PATH")
    parser.add_argument("--bootstrap-resamples", type=int, default=1000,
                        help="resamples of the paired bootstrap (default 1000; 0: no intervals)")
    parser.add_argument("--bootstrap-seed", type=int, default=0, help="seed of the paired bootstrap (default 0)")
    parser.add_argument("--rows-for-effect", type=float, default=None, metavar="D",
                        help="also print how many rows a paired comparison needs to detect a difference in accuracy "
                             "of D (0.01: one point) with 80%% power at level 0.05, at the discordance of these runs")
    return parser


def _check_args(args) -> tuple:
    """(the folders, the baseline's place among them or None); bad arguments refused in one line."""
    folders = [args.run_a, args.run_b, *args.more]
    if args.bootstrap_resamples < 0 or args.bootstrap_seed < 0:
        raise UsageError("--bootstrap-resamples and --bootstrap-seed: expected integers >= 0.")
    if args.baseline is not None and args.baseline not in folders:
        raise UsageError(f"--baseline {args.baseline}: expected one of the folders compared ({', '.join(folders)}). "
                         "Pass one of them, or drop --baseline (each pair).")
    if len(folders) > 2 and len(set(folders)) != len(folders):
        raise UsageError(f"{', '.join(folders)}: a folder is given twice. Pass each run once.")
    if args.rows_for_effect is not None and len(folders) > 2:
        raise UsageError(f"--rows-for-effect {args.rows_for_effect:g}: expected two runs (the discordance of one "
                         f"pair), got {len(folders)}. Compare the pair alone to plan its rows.")
    return folders, None if args.baseline is None else folders.index(args.baseline)


def _compared(args) -> tuple:
    """What the runs the arguments name compare to: (a warning line or '', the lines to print, what
    ``--json`` writes, its name). Two runs: the paired test (and the rows an effect needs); more: every
    pair, or each against the baseline, Holm over them all.
    """
    folders, baseline = _check_args(args)
    if len(folders) > 2:
        result = compare_many([load_run(folder) for folder in folders], baseline, args.bootstrap_resamples,
                              args.bootstrap_seed)
        return many_warning(result), [format_many(result)], result, "comparisons"
    if baseline == 1:  # the baseline is A
        folders.reverse()
    a, b = load_run(folders[0]), load_run(folders[1])
    comparison = compare_runs(a, b, args.bootstrap_resamples, args.bootstrap_seed)
    lines = [format_comparison(comparison, args.max_rows)]
    if args.rows_for_effect is not None:
        lines.append(format_rows_for_effect(comparison.paired, args.rows_for_effect))
    return one_side_warning(comparison), [line for line in lines if line], comparison.paired, "paired test"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        warning, lines, written, name = _compared(args)
    except UsageError as e:
        print(f"dist_eval.compare: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if warning:
        print(warning, file=sys.stderr, flush=True)
    for line in lines:
        print(line, flush=True)
    if args.json:
        from dist_eval.atomic import atomic_write

        atomic_write(args.json, lambda f: json.dump(written, f, indent=2))
        print(f"{name} written to {args.json}", flush=True)
    return 0
