"""Who reports a dead rank 0: dist_eval.ranks.siblings, on real processes."""
import subprocess
import sys

from dist_eval.procs import start_time
from dist_eval.ranks.siblings import dead_main_rank


def _process(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def _entry(proc: subprocess.Popen):
    return proc.pid, start_time(proc.pid)


def test_the_lowest_surviving_rank_reports_a_dead_rank_0():
    rank0, rank1, rank2 = _process(60), _process(60), _process(60)
    try:
        siblings = {0: _entry(rank0), 1: _entry(rank1), 2: _entry(rank2)}
        assert dead_main_rank(siblings, 1) is None  # rank 0 alive: it reports
        assert dead_main_rank(siblings, 0) is None
        rank0.kill()
        rank0.wait()
        assert dead_main_rank(siblings, 1) == rank0.pid  # rank 1 says it
        assert dead_main_rank(siblings, 2) is None  # ... and rank 2 does not
        rank1.kill()
        rank1.wait()
        assert dead_main_rank(siblings, 2) == rank0.pid  # rank 1 gone too: rank 2 says it
    finally:
        for proc in (rank0, rank1, rank2):
            proc.kill()
            proc.wait()


def test_a_reused_pid_is_not_rank_0_and_unknown_nodes_say_nothing():
    rank0 = _process(60)
    try:
        pid, _ = _entry(rank0)
        assert dead_main_rank({0: (pid, "1")}, 1) == pid  # same pid, another start time: not rank 0
        assert dead_main_rank({}, 1) is None  # rank 0 on another node (or no /proc): rank 0's node reports
    finally:
        rank0.kill()
        rank0.wait()
