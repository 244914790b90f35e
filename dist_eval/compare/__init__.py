"""Compare two runs over the same data: ``python -m dist_eval.compare OUT_A OUT_B [OUT ...]``.

Prints the main metrics of both runs with B - A (and their confidence intervals when
the runs have them), a paired test on the shared rows (McNemar's exact test of the
accuracies; paired bootstrap intervals of B - A in accuracy, macro-F1 and loss; also
written to ``--json PATH``), per slice when both runs have ``--slice-by``'s (McNemar's test of each
slice, its p-value adjusted by Holm for the number of slices, and the slice's paired interval of
B - A), then the rows whose prediction changed (index, label,
pred A, pred B), up to ``--max-rows``. The rows are paired by their content (predictions.jsonl's
``key``): rows of one run only are counted, named in one warning and left out of the paired test
(runs without keys: by position). More than two runs: each pair, or each against ``--baseline``,
Holm-adjusted over every comparison. Exit 0; exit 2 with one error line when a folder is not a
finished run or the runs share no row.

The package's modules, in data-flow order: :mod:`~dist_eval.compare.read` (a run's folder),
:mod:`~dist_eval.compare.join` (rows paired by content), :mod:`~dist_eval.compare.statistics` (the paired
tests, Holm), :mod:`~dist_eval.compare.formatting` (the lines printed), :mod:`~dist_eval.compare.cli`.
"""
from dist_eval.compare.cli import EXIT_USAGE, build_parser, main
from dist_eval.compare.formatting import (
    checkpoints_table,
    format_comparison,
    format_many,
    format_paired,
    format_power,
    format_rows_for_effect,
    many_warning,
    one_side_warning,
)
from dist_eval.compare.join import join_by_content
from dist_eval.compare.read import RunOutputs, load_run
from dist_eval.compare.statistics import Comparison, checkpoint_comparisons, compare_many, compare_runs, paired_test

__all__ = ["EXIT_USAGE", "Comparison", "RunOutputs", "build_parser", "checkpoint_comparisons", "checkpoints_table",
           "compare_many", "compare_runs", "format_comparison", "format_many", "format_paired", "format_power",
           "format_rows_for_effect", "join_by_content", "load_run", "main", "many_warning", "one_side_warning",
           "paired_test"]
