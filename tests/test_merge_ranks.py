"""The merge with real ranks (torchrun, gloo; merge_worker.py): the report of N ranks is
one process's, bit for bit, with the score intervals shared over the ranks (a small set)
or drawn grouped on rank 0 (a set above EXACT_SCORE_ROWS rows), and equal to what
``python -m dist_eval.rescore`` computes from the merged rows. One process is this one, its BLAS
on 2 and 3 threads, the ranks' on one each (torchrun's OMP_NUM_THREADS=1): the intervals' sums of
products must not depend on it (metrics.weighted_sums; with ``@`` the Brier interval of 3,001 rows
differed in its last bits)."""
import json
import os

import merge_worker
import pytest
from conftest import REPO, run_ranks
from threadpoolctl import threadpool_limits

from dist_eval.intervals import EXACT_SCORE_ROWS, GROUPED_SCORES_METHOD, METHOD

SIZES = [3001, EXACT_SCORE_ROWS + 3]


def merged_reports(tmp_path, world: int, zygote) -> dict:
    out = tmp_path / f"world{world}.json"
    if world == 1:  # one process, no process group: the worker's code in this process, BLAS on 2 and 3 threads
        reports = []
        for threads in (2, 3):
            with threadpool_limits(limits=threads, user_api="blas"):
                assert merge_worker.main(str(out), SIZES) == 0
            reports.append(out.read_text())
        assert reports[0] == reports[1], "the report depends on the number of BLAS threads"
        return json.loads(reports[0])
    # real ranks in a gloo group, forked (conftest's run_ranks): the merge is tested, not the launch
    proc = run_ranks(zygote, [str(out), *map(str, SIZES)], nproc=world, script=os.path.join(REPO, "tests",
                                                                                            "merge_worker.py"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.multiproc
def test_n_ranks_merge_to_one_process_report_with_either_score_intervals(tmp_path, rank_zygote):
    one = merged_reports(tmp_path, 1, rank_zygote)
    for world in (2, 3):
        merged = merged_reports(tmp_path, world, rank_zygote)
        assert json.dumps(merged, sort_keys=True) == json.dumps(one, sort_keys=True), world
    for size, method in zip(SIZES, (METHOD, GROUPED_SCORES_METHOD)):
        report, rescored = one[str(size)]["report"], one[str(size)]["rescored"]
        intervals = report["confidence_intervals"]
        assert intervals["method"] == method
        assert set(intervals) >= {"accuracy", "ece", "brier", "top2_accuracy", "auroc_macro"}
        for name in ("ece", "brier", "top2_accuracy", "auroc_macro"):
            assert intervals[name][0] <= report[name] <= intervals[name][1], (size, name)
        assert json.dumps(rescored["confidence_intervals"], sort_keys=True) == json.dumps(intervals, sort_keys=True)
