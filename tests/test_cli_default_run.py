"""The embedded default, as the README's command 1 runs it (`dist-eval --nproc-per-node 2`, no
dist_eval flag but the output folder): starts a local swarm, evaluates the built-in prompt-tuned
model through Petals, reports accuracy > 0.90, audits nothing on its own swarm (no --audit, no
$DIST_EVAL_AUDIT: the default rule), prints nothing that is not dist_eval's own, and stops every
server it started."""
import json
import os
import sys

import pytest
from conftest import read_jsonl, run_in_own_group, swarm_server_pids
from inprocess_cli import run_cli_in_process

pytestmark = [pytest.mark.swarm, pytest.mark.multiproc]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, demo_cache):
    before = set(swarm_server_pids())
    out = tmp_path_factory.mktemp("default") / "out"
    # A new matplotlib config folder: its first import on a machine logs "generated new fontManager",
    # which must not reach the run's output.
    mpl = tmp_path_factory.mktemp("mplconfig")
    env = {**os.environ, "DIST_EVAL_CACHE": demo_cache, "MPLCONFIGDIR": str(mpl), "HF_HUB_OFFLINE": "1"}
    env.pop("OMP_NUM_THREADS", None)  # as on a user's shell
    env.pop("DIST_EVAL_AUDIT", None)  # the suite's 0 (conftest.py): a user's default, the audit's rule, runs
    proc = run_in_own_group([sys.executable, "-m", "dist_eval.launcher", "--nproc-per-node", "2", "--",
                             "--output-dir", str(out)], timeout=600, env=env)
    return out, proc, before


def test_default_run(default_run):
    out, proc, before = default_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    # a normal run prints no traceback (offline version check, exit-time event-loop noise)
    for noise in ("Traceback", "Exception ignored", "Error", "huggingface/tokenizers", "[INFO]", "fontManager"):
        assert noise not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-4000:]
    # every line is dist_eval's own: its "dist_eval: ..." lines and the summary's indented ones
    for line in (proc.stdout + proc.stderr).splitlines():
        assert line.startswith(("dist_eval: ", "  ")), line
    metrics = json.load(open(out / "metrics.json"))
    assert metrics["accuracy"] > 0.90
    assert metrics["run"]["backend"] == "petals" and metrics["run"]["world_size"] == 2
    assert metrics["run"]["demo"] is True and len(metrics["run"]["initial_peers"]) >= 2
    # the run's own local swarm is audited only when asked (its servers are this run's processes)
    assert "audit" not in metrics["run"]["swarm"] and "swarm audit" not in proc.stdout, metrics["run"]["swarm"]
    assert len(metrics["confusion_matrix"]) >= 3
    rows = read_jsonl(out / "predictions.jsonl")
    assert [r["index"] for r in rows] == list(range(metrics["num_samples"]))
    assert {"label_name", "pred_name"} <= set(rows[0])
    assert f"accuracy {metrics['accuracy']:.4f}" in proc.stdout
    assert set(swarm_server_pids()) <= before  # every server it started is gone


def test_local_backend_gives_the_same_predictions(default_run, tmp_path, demo_cache, monkeypatch):
    """The demo on the local backend, one rank in this process (one thread: a torchrun rank's bits), without
    figures (matplotlib hidden: its predictions and metrics.json are compared, the figures are the same
    function of the same metrics; ~2.4 of its ~7 CPU-s)."""
    out, proc, _ = default_run
    assert proc.returncode == 0
    local = tmp_path / "local"
    monkeypatch.setenv("DIST_EVAL_CACHE", demo_cache)
    assert run_cli_in_process(["--output-dir", str(local), "--backend", "local"], hide_modules=("matplotlib",)) == 0
    assert read_jsonl(local / "predictions.jsonl") == read_jsonl(out / "predictions.jsonl")
    swarm_metrics = json.load(open(out / "metrics.json"))
    local_metrics = json.load(open(local / "metrics.json"))
    assert {k: v for k, v in local_metrics.items() if k != "run"} == {
        k: v for k, v in swarm_metrics.items() if k != "run"
    }
