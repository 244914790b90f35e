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


def _older_report(run: dict) -> dict:
    """A report as an older version wrote it: the metrics, and ``run`` with only some of its keys."""
    per_class = {name: {"label": k, "precision": 0.5, "recall": 0.5, "f1": 0.5, "support": 2}
                 for k, name in enumerate(("neg", "pos"))}
    return {"num_samples": 4, "num_labels": 2, "accuracy": 0.5, "f1_macro": 0.5, "precision_macro": 0.5,
            "recall_macro": 0.5, "per_class": per_class, "confusion_matrix": [[1, 1], [1, 1]], "run": run}


def test_the_run_facts_are_typed_and_an_older_report_still_renders():
    """RunFacts writes run.*'s keys in order (those that apply only when set) and reads them back;
    the summary and report.html of a report missing run keys show what it has, the rest absent."""
    from dist_eval.loop_facts import RunFacts, SampleFacts
    from dist_eval.output.html import render_html
    from dist_eval.output.summary import format_summary

    facts = RunFacts(backend="local", data_files=["/d.csv"], wall_seconds=2.0, phase_seconds={"a": 1.0},
                     run_key="k", sample=SampleFacts(10, 0, 50, 10))
    written = facts.report()
    assert list(written)[:2] == ["backend", "model"] and list(written)[-2:] == ["run_key", "sample"]
    assert "pair" not in written and "swarm" not in written and "total_seconds" not in written
    assert RunFacts.of({"run": written}) == facts
    for run in ({}, {"backend": "local"}, {"world_size": 2, "wall_seconds": 3.25, "phase_seconds": {"b": 0.5}}):
        summary = format_summary(_older_report(run))
        assert summary.startswith(f"dist_eval: 4 samples, {run.get('world_size', 1)} rank(s), backend "
                                  f"{run.get('backend', '?')}, {run.get('wall_seconds', 0):.1f} s wall, 0.0 samples/s")
        assert ("  time: b 0.5 s" in summary) == ("phase_seconds" in run)
        page = render_html(_older_report(run))
        assert ("3.2 s" in page) == ("wall_seconds" in run) and ("world size" in page) == ("world_size" in run)


def test_no_module_but_loop_facts_spells_the_run_facts():
    """The CLI's flow, the report writers and the shards' merge read and write run.*'s facts through
    RunFacts, not by their keys."""
    keys = {"wall_seconds", "phase_seconds", "startup_seconds", "total_seconds", "started_at", "world_size",
            "initial_peers", "samples_per_second"}
    output = os.path.join(REPO, "dist_eval", "output")
    names = ["pipeline.py", "shard_merge.py", *(f"output/{f}" for f in os.listdir(output) if f.endswith(".py"))]
    found = []
    for name in names:
        path = os.path.join(REPO, "dist_eval", name)
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Constant) and node.value in keys:
                found.append(f"{name}:{node.lineno} {node.value!r}")
    assert not found, found
