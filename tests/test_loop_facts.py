"""dist_eval/loop_facts.py (issue 47): what an evaluation's loop measured is one typed value that
rounds add up and that writes the report's keys in one place."""
import ast
import os

from conftest import REPO

from dist_eval.loop_facts import LoopFacts, StoreFacts


def _facts(scale: int, folder="/store") -> LoopFacts:
    return LoopFacts(world_size=2, per_rank_samples=[3 * scale, 2 * scale], eval_loop_seconds=1.5 * scale,
                     forward_seconds_sum=2.0 * scale, loop_cpu_seconds_sum=2.5 * scale, duplicates_dropped=scale,
                     max_batch_seconds=0.1 * scale, resumed_samples=scale, num_truncated=scale,
                     row_store=StoreFacts(folder, False, scale, 4 * scale, 0.5 * scale, 0.01 * scale, 0.02 * scale))


def test_rounds_add_up_and_the_report_reads_back():
    total = _facts(1) + _facts(2)
    assert total == LoopFacts(world_size=2, per_rank_samples=[9, 6], eval_loop_seconds=4.5, forward_seconds_sum=6.0,
                              loop_cpu_seconds_sum=7.5, duplicates_dropped=3, max_batch_seconds=0.2,
                              resumed_samples=3, num_truncated=3,
                              row_store=StoreFacts("/store", False, 3, 12, 1.5, 0.03, 0.06))
    report = total.report()
    assert report["num_truncated"] == 3 and report["run"]["samples_per_second"] == 12 / 4.5
    assert LoopFacts.from_report(report) == total
    assert LoopFacts.from_report(_facts(0).report()).samples_per_second is None  # no row evaluated


def test_only_loop_facts_writes_the_loop_keys():
    """The merge, the evaluation and the rounds build or add LoopFacts; no other module of the
    evaluation core spells its keys (the report's renderers read metrics.json as written)."""
    keys = {"eval_loop_seconds", "resumed_samples", "rows_from_store", "per_rank_samples", "forward_seconds_sum",
            "loop_cpu_seconds_sum", "duplicates_dropped", "rows_evaluated", "samples_per_second"}
    core = ["merge.py", "evaluation.py", "exact.py", "stopping.py", "known.py", "predict.py", "pipeline.py",
            "output/report.py"]
    found = []
    for name in core:
        path = os.path.join(REPO, "dist_eval", name)
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Constant) and node.value in keys:
                found.append(f"{name}:{node.lineno} {node.value!r}")
    assert not found, found
