"""benchmarks/bench_gpu.py: its data generator, its in-process batch plan (dist_eval's own), and
its CPU smoke mode end to end; benchmarks/bench_score_intervals.py and bench_sequence_rounds.py run."""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

from dist_eval.config import DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCH_TOKENS

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import bench_gpu  # noqa: E402
import inprocess_loop  # noqa: E402


def test_long_tailed_data_is_deterministic_with_the_issues_spread():
    texts, labels = bench_gpu.long_tailed_texts(2000, 13)
    assert (texts, labels) == bench_gpu.long_tailed_texts(2000, 13)
    assert bench_gpu.long_tailed_texts(2000, 14)[0] != texts
    words = sorted(len(t.split()) for t in texts)
    assert statistics.median(words) == 19
    assert 44 <= words[int(0.9 * (len(words) - 1))] <= 54  # p90 about 49
    assert words[-1] == 178 and words[0] >= 3
    assert sorted(set(labels)) == [0, 1, 2, 3]


@pytest.mark.parametrize("batch_size,cap", [(64, 2048), (256, 16384), (16, 0)])
def test_inprocess_plan_is_the_one_dist_eval_runs(tmp_path, batch_size, cap):
    import datasets
    from transformers import AutoTokenizer

    from dist_eval.config import Settings
    from dist_eval.data.shard import dataset_batches

    data = bench_gpu.make_data(str(tmp_path / "data"), 300, 13)
    bench_gpu.save_tokenizer(str(tmp_path / "model"), data["vocab"])
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    dataset = datasets.load_from_disk(str(tmp_path / "data"))
    ids, plan = inprocess_loop.plan_like_dist_eval(tokenizer, dataset, 8, 0, batch_size, cap)

    settings = Settings(batch_size=batch_size, max_batch_tokens=cap or None)
    labels = np.array(dataset["label"])
    batches, _, own = dataset_batches(dataset, tokenizer, labels, settings, pad_token_id=0, prefix_tokens=8)
    assert [b.tolist() for b in plan] == [own[k].tolist() for k in sorted(own)]
    for (_, rows, padded, _), planned in zip(batches, plan):
        assert rows.tolist() == planned.tolist()
        assert [ids[r] for r in rows.tolist()] == [[t for t in row if t != 0] for row in padded.tolist()]
    if cap:
        assert max(len(b) * (max(len(ids[r]) for r in b.tolist()) + 8) for b in plan if len(b) > 1) <= cap


@pytest.mark.swarm
@pytest.mark.multiproc
def test_cpu_smoke_run_end_to_end(tmp_path, capfd, monkeypatch):
    """bench_gpu.main in this process (the script's own code; what it times runs in the processes it
    launches: the swarm, the seeds' loop, torchrun, the in-process loop), its signal handlers restored.
    The dist_eval run draws no figures (matplotlib hidden from the processes it launches)."""
    from inprocess_cli import without_modules

    out = tmp_path / "gpu.json"
    argv = ["--model-size", "tiny", "--device", "cpu", "--rows", "40", "--ranks", "1", "--servers", "1",
            "--repeats", "1", "--out", str(out)]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([without_modules(tmp_path / "hidden", "matplotlib"), REPO]))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    capfd.readouterr()
    try:
        code = bench_gpu.main(argv)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    stdout, stderr = capfd.readouterr()
    assert code == 0, stderr[-3000:]
    assert "x seeds" in stdout and "dist_eval N=1, defaults" in stdout
    report = json.loads(out.read_text())
    names = [r["name"] for r in report["results"]]
    assert names == ["seeds' loop, batch 16", "dist_eval N=1, defaults",
                     f"in-process, batch {DEFAULT_BATCH_SIZE}, cap {DEFAULT_MAX_BATCH_TOKENS}"]
    assert all(r["agreement"] == 1.0 for r in report["results"])  # float32: the same predictions
    assert report["machine"]["cpus"] == os.cpu_count() and report["model"]["dtype"] == "float32"


def test_score_intervals_benchmark_runs():
    """benchmarks/bench_score_intervals.py on a small set, without a baseline: it runs and
    prints rank 0's seconds."""
    script = os.path.join(REPO, "benchmarks", "bench_score_intervals.py")
    cmd = [sys.executable, script, "--rows", "300", "--resamples", "40", "--nproc", "2", "--baseline", ""]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "300 rows, 4 classes, 40 resamples, rank 0 of 2:" in proc.stdout and "this checkout" in proc.stdout
    assert "the same bits" not in proc.stdout  # no baseline: nothing to compare


def test_sequence_rounds_benchmark_runs_and_the_two_ways_agree():
    """benchmarks/bench_sequence_rounds.py on a small set: both ways timed, the same last interval."""
    script = os.path.join(REPO, "benchmarks", "bench_sequence_rounds.py")
    cmd = [sys.executable, script, "--population", "5000", "--round", "100", "--upto", "3000"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "30 rounds of 100 rows, up to 3000 of 5000:" in proc.stdout
    assert "last interval the same bits: True" in proc.stdout


# the benchmarks that evaluate rows under torchrun or the API, and compare runs of the same rows
ROW_EVALUATING_BENCHMARKS = ["bench_throughput", "bench_gpu", "bench_big_set", "bench_slurm", "bench_stopping",
                             "bench_score_intervals", "bench_row_store", "families_swarm"]


def test_the_benchmarks_evaluate_every_row_afresh():
    """The row store is on by default: a benchmark's second run of the same rows would read them
    all from it (a 20,000-row SLURM job: 60,000 samples/s instead of 3,000, no forward run).
    Imported where DIST_EVAL_ROW_STORE is unset, each benchmark turns it off for its runs."""
    env = {k: v for k, v in os.environ.items() if k != "DIST_EVAL_ROW_STORE"}
    code = ("import importlib, os, sys\nsys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], 'tests')]\n"
            "for name in sys.argv[2:]:\n    os.environ.pop('DIST_EVAL_ROW_STORE', None)\n"
            "    importlib.import_module(name)\n    print(name, os.environ.get('DIST_EVAL_ROW_STORE'))\n")
    proc = subprocess.run([sys.executable, "-c", code, os.path.join(REPO, "benchmarks"), *ROW_EVALUATING_BENCHMARKS],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:-1] == [f"{name} off" for name in ROW_EVALUATING_BENCHMARKS], proc.stdout
