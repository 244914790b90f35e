"""The suite's forked ranks (tests/forked_ranks.py, conftest's run_ranks): what the tests that use
them rely on being as under torchrun: torchrun's environment in each rank, a real gloo group,
the launch's own environment and PYTHONPATH, each rank's exit code, the others stopped with
SIGTERM once one failed (torchrun's agent does that), and torchrun where the fork server cannot
serve a launch's environment."""
import json
import os
import re
import time

import pytest
from conftest import REPO, run_env, run_ranks
from inprocess_cli import without_modules

PROBE = """import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
tensor = torch.tensor([dist.get_rank() + 1])
dist.all_reduce(tensor)
try:
    import matplotlib  # noqa: F401
    hidden = False
except ImportError:
    hidden = True
facts = {key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                              "TORCHELASTIC_RUN_ID", "DIST_EVAL_PROBE", "OMP_NUM_THREADS")}
facts.update(argv=sys.argv[1:], sum=int(tensor.item()), matplotlib_hidden=hidden, pid=os.getpid(), cwd=os.getcwd())
dist.destroy_process_group()
with open(os.path.join(sys.argv[1], f"rank{facts['RANK']}.json"), "w") as f:
    json.dump(facts, f)
print(f"rank {facts['RANK']} said this")
"""

FAILING = """import os, sys, time
if os.environ["RANK"] == "1":
    sys.exit(3)
time.sleep(120)
"""


@pytest.mark.multiproc
def test_forked_ranks_have_torchruns_environment_a_gloo_group_and_the_launchs_own(rank_zygote, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    hidden = without_modules(tmp_path / "hidden", "matplotlib")
    env = {"DIST_EVAL_PROBE": "yes", "PYTHONPATH": os.pathsep.join(p for p in (hidden, run_env()["PYTHONPATH"]) if p)}
    proc = run_ranks(rank_zygote, [str(tmp_path), "an argument"], nproc=3, timeout=120, env=env, script=str(script))
    assert proc.returncode == 0 and proc.rank_codes == [0, 0, 0], proc.stderr[-3000:]
    facts = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    for rank, fact in enumerate(facts):
        ranks = (fact["RANK"], fact["LOCAL_RANK"], fact["WORLD_SIZE"], fact["LOCAL_WORLD_SIZE"])
        assert ranks == (str(rank), str(rank), "3", "3"), fact
        assert (fact["MASTER_ADDR"], fact["OMP_NUM_THREADS"], fact["DIST_EVAL_PROBE"]) == ("127.0.0.1", "1", "yes")
        assert fact["argv"] == [str(tmp_path), "an argument"] and fact["cwd"] == REPO
        assert fact["sum"] == 1 + 2 + 3  # a real gloo group of the three
        assert fact["matplotlib_hidden"]  # the PYTHONPATH stub before the fork server's, as in a process started so
    assert len({fact["TORCHELASTIC_RUN_ID"] for fact in facts}) == 1
    assert len({fact["pid"] for fact in facts}) == 3 and os.getpid() not in {fact["pid"] for fact in facts}
    # every rank's output, in the launch's stdout (as torchrun's: one stream, print's writes may interleave)
    assert sorted(re.findall(r"rank \d said this", proc.stdout)) == [f"rank {rank} said this" for rank in range(3)]


@pytest.mark.multiproc
def test_a_failed_rank_has_the_others_stopped_with_sigterm_as_torchrun_does(rank_zygote, tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    began = time.monotonic()
    proc = run_ranks(rank_zygote, [], nproc=2, timeout=60, script=str(script))
    assert proc.rank_codes == [-15, 3] and proc.returncode == 1, (proc.rank_codes, proc.stderr[-3000:])
    assert time.monotonic() - began < 30  # not rank 0's 120 s of sleep


def test_an_environment_a_library_reads_at_import_is_not_forked(rank_zygote):
    """Where the fork server's imports would have read another value (huggingface_hub's HF_HOME,
    HF_HUB_OFFLINE, ...), run_ranks runs torchrun; what dist_eval reads when it runs, and entries put
    before the fork server's PYTHONPATH, are served."""
    assert rank_zygote.serves(run_env())
    assert rank_zygote.serves(run_env({"DIST_EVAL_CACHE": "/elsewhere", "DIST_EVAL_ROW_STORE": "/a/store"}))
    assert rank_zygote.serves(run_env({"PYTHONPATH": os.pathsep.join(["/a/stub", run_env()["PYTHONPATH"]])}))
    for env in ({"HF_HOME": "/another/home"}, {"HF_HUB_OFFLINE": "0"}, {"OMP_NUM_THREADS": "2"},
                {"PYTHONPATH": "/a/stub"}):
        assert not rank_zygote.serves(run_env(env)), env
