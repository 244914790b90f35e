"""The GPU path end to end (marked ``gpu``: deselected where torch sees no CUDA device, and the
run's summary says so): the local backend on ``--device cuda`` equals the CPU to fp32
rounding; the local swarm that dist_eval starts with ``--local-device auto`` puts fp16
servers on the GPU and serves a run whose predictions agree with the CPU's except near-ties;
more ranks than GPUs work."""
import json

import numpy as np
import pytest
from conftest import read_jsonl, run_cli, write_csv
from test_cli import local_args

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc]

NEAR_TIE = 1e-2  # fp16 servers round the logits: a row whose top two logits are this close may flip


@pytest.fixture(scope="module")
def data_csv(tmp_path_factory):
    return write_csv(str(tmp_path_factory.mktemp("gpu") / "data.csv"), 48, seed=21)


@pytest.fixture(scope="module")
def cpu_run(tiny_model, tiny_checkpoint, data_csv, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_cpu_reference")
    proc = run_cli(local_args(tiny_model, tiny_checkpoint, data_csv, out, "--save-logits"), nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_jsonl(out / "predictions.jsonl"), json.load(open(out / "metrics.json"))


def _logits(rows):
    return np.array([r["logits"] for r in rows], dtype=np.float64)


def _clear_rows(rows):
    """The rows whose top two logits are further apart than NEAR_TIE."""
    top2 = np.sort(_logits(rows), axis=1)[:, -2:]
    return top2[:, 1] - top2[:, 0] > NEAR_TIE


def test_local_backend_on_cuda_equals_the_cpu(tiny_model, tiny_checkpoint, data_csv, cpu_run, tmp_path):
    proc = run_cli(local_args(tiny_model, tiny_checkpoint, data_csv, tmp_path, "--save-logits", "--device", "cuda"),
                   nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, cpu_rows = read_jsonl(tmp_path / "predictions.jsonl"), cpu_run[0]
    # another device, not another batch plan: CUDA's kernels round otherwise, so equal to fp32 rounding
    # only; a looser bound than float_promises.ROUNDING, kept until measured on a GPU
    np.testing.assert_allclose(_logits(rows), _logits(cpu_rows), rtol=1e-4, atol=1e-5)
    clear = _clear_rows(cpu_rows)
    assert [r["pred"] for r, c in zip(rows, clear) if c] == [r["pred"] for r, c in zip(cpu_rows, clear) if c]


def test_more_ranks_than_gpus(tiny_model, tiny_checkpoint, data_csv, cpu_run, tmp_path):
    """Each rank on cuda:LOCAL_RANK % device_count: two ranks share a GPU; every row once."""
    import torch

    nproc = torch.cuda.device_count() + 1
    proc = run_cli(local_args(tiny_model, tiny_checkpoint, data_csv, tmp_path, "--save-logits", "--device", "cuda"),
                   nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(tmp_path / "predictions.jsonl")
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert [r["index"] for r in rows] == list(range(48)) and metrics["run"]["world_size"] == nproc
    np.testing.assert_allclose(_logits(rows), _logits(cpu_run[0]), rtol=1e-4, atol=1e-5)  # another device, as above


@pytest.mark.swarm
def test_the_local_swarm_serves_fp16_on_the_gpu(tiny_model, tiny_checkpoint, data_csv, cpu_run, tmp_path):
    """No flag but --local-device auto (the default): fp16 servers on the GPU serve two ranks
    (more ranks than GPUs on a one-GPU machine)."""
    proc = run_cli(["--model", tiny_model, "--data-files", data_csv, "--checkpoint", tiny_checkpoint,
                    "--output-dir", str(tmp_path), "--save-logits", "--local-device", "auto"], nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "float16 on cuda" in proc.stdout, proc.stdout[-3000:]  # the plan the run printed
    rows, cpu_rows = read_jsonl(tmp_path / "predictions.jsonl"), cpu_run[0]
    metrics = json.load(open(tmp_path / "metrics.json"))
    assert metrics["run"]["backend"] == "petals" and metrics["num_samples"] == 48
    clear = _clear_rows(cpu_rows)
    differ = [i for i, c in enumerate(clear) if c and rows[i]["pred"] != cpu_rows[i]["pred"]]
    assert not differ, f"rows whose prediction changed on fp16 servers though not near a tie: {differ}"
