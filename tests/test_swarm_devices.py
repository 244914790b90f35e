"""Where a local swarm's servers run (dist_eval.swarm.devices): pure decisions of GPUs,
memory and model size, so the GPU plans are checked on this CPU machine; and the flags."""
import os

import pytest

from dist_eval.swarm.devices import GPU_MAX_BATCH_SIZE, ServerPlan, model_weights, plan_servers
from dist_eval.swarm.placement import SwarmError

GIB = 2**30


def plan(device="auto", servers=None, dtype=None, gpus=(), weights=2 * GIB, saved="float16", blocks=22, cpus=16,
         ram=0):
    return plan_servers(device, servers, dtype, gpu_memory=[g * GIB for g in gpus], weight_bytes=weights,
                        saved_dtype=saved, num_blocks=blocks, cpus=cpus, cpu_memory=ram * GIB)


def test_cpu_plan_is_what_it_was():
    for request in ("auto", "cpu"):
        p = plan(request, gpus=() if request == "auto" else (80,))
        assert p == ServerPlan(("cpu", "cpu"), "float32", None, None, threads=8)
        assert p.server_args(1) == ["--device", "cpu", "--torch_dtype", "float32"]
    assert plan("cpu", servers=3, dtype="bfloat16").devices == ("cpu",) * 3


def test_cpu_servers_hold_full_replicas_where_they_fit_half_the_memory_available():
    # 2 GiB saved in fp16 = 4 GiB per float32 replica
    assert plan("cpu", servers=3, ram=24).blocks_per_server == 22  # 12 GiB <= half of 24
    assert plan("cpu", servers=3, ram=23).blocks_per_server is None  # two servers a block (placement's layout)
    assert plan("cpu", servers=3, ram=12, dtype="bfloat16").blocks_per_server == 22  # 6 GiB in bf16
    assert plan("cpu", ram=16).blocks_per_server == 22 and plan("cpu", ram=0).blocks_per_server is None
    from dist_eval.swarm.devices import available_memory

    assert available_memory() > 0  # /proc/meminfo on Linux


def test_the_cores_are_shared_out_among_the_servers():
    assert plan("cpu", cpus=2).threads == 1 and plan("cpu", servers=3, cpus=2).threads == 1
    assert plan("cpu", servers=3, cpus=16).threads == 5
    assert plan("auto", gpus=(80,), weights=4 * GIB, saved="float32", cpus=16).threads == 2  # 8 servers


def test_one_big_gpu_gets_8_full_fp16_replicas():
    # a 1B model in fp16 (2 GiB) on an 80 GiB GPU: 20 would fit in half the memory; 8 pay off
    p = plan("auto", gpus=(80,), weights=4 * GIB, saved="float32")  # saved in fp32: served in fp16
    assert p.devices == ("cuda:0",) * 8 and p.torch_dtype == "float16"
    assert p.blocks_per_server == 22 and p.max_batch_size == GPU_MAX_BATCH_SIZE
    assert p.server_args(7) == ["--device", "cuda:0", "--torch_dtype", "float16",
                                "--max_batch_size", str(GPU_MAX_BATCH_SIZE)]


def test_replicas_per_gpu_are_bounded_by_memory_and_spread_over_gpus():
    p = plan("cuda", gpus=(40, 40), weights=14 * GIB, saved="bfloat16")  # a 7B model in bf16
    assert p.torch_dtype == "bfloat16" and p.devices == ("cuda:0", "cuda:1")  # 20 GiB each for weights: 1 each
    p = plan("cuda:1", gpus=(24, 80), weights=14 * GIB, saved="bfloat16")
    assert p.devices == ("cuda:1",) * 2
    p = plan("cuda", servers=3, gpus=(80, 80))
    assert p.devices == ("cuda:0", "cuda:1", "cuda:0")


def test_a_model_too_big_for_one_gpu_is_split_over_the_gpus_or_refused():
    p = plan("cuda", gpus=(24, 24, 24, 24), weights=40 * GIB, saved="float16", blocks=40)
    assert p.devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3") and p.blocks_per_server == 10
    with pytest.raises(SwarmError, match=r"do not fit the local swarm's 2 GPU\(s\).*--initial-peers"):
        plan("cuda", gpus=(24, 24), weights=40 * GIB, saved="float16", blocks=40)


@pytest.mark.parametrize("device,gpus,message", [
    ("cuda", (), "no CUDA device is visible"),
    ("cuda:2", (80, 80), "2 CUDA device"),
    ("tpu", (80,), "expected auto, cpu, cuda"),
])
def test_bad_device_requests_say_what_exists(device, gpus, message):
    with pytest.raises(SwarmError, match=message):
        plan(device, gpus=gpus)


def test_bad_dtype_and_server_count():
    with pytest.raises(SwarmError, match="torch_dtype='half'"):
        plan(dtype="half")
    with pytest.raises(SwarmError, match="num_servers=0"):
        plan(servers=0)


def test_model_weights_reads_the_folder(tiny_model):
    size, saved = model_weights(tiny_model)
    assert size > 0 and saved in ("float32", "float16", "bfloat16")


def test_flags_reach_the_plan(tiny_model):
    from dist_eval.cli import checked_config
    from dist_eval.config import EvalConfig
    from dist_eval.errors import UsageError
    from dist_eval.swarm import LocalSwarm
    from dist_eval.swarm.cli import _build_parser

    args = _build_parser().parse_args([tiny_model, "--device", "cpu", "--torch-dtype", "bfloat16", "--servers", "3"])
    swarm = LocalSwarm(tiny_model, num_servers=args.servers, device=args.device, torch_dtype=args.torch_dtype)
    assert swarm.server_plan.devices == ("cpu",) * 3 and swarm.server_plan.torch_dtype == "bfloat16"
    assert swarm.num_servers == 3 and swarm.server_plan.threads == max(1, (os.cpu_count() or 1) // 3)
    assert LocalSwarm(tiny_model).server_plan.describe() == "float32 on cpu"
    with pytest.raises(UsageError, match="local_device"):
        checked_config(local_device="gpu")  # the CLI checks a device request before its first phase
    assert EvalConfig().local_device == "auto" and EvalConfig().local_servers is None


def test_auto_follows_the_gpus_torch_sees(tiny_model):
    from dist_eval.swarm import LocalSwarm
    from dist_eval.swarm.devices import visible_gpu_memory

    gpus = visible_gpu_memory("cuda")  # asked in a child process
    plan = LocalSwarm(tiny_model, device="auto").server_plan
    if not gpus:  # a machine without a GPU (the project's CI machine)
        assert visible_gpu_memory("auto") == [] and plan.devices == ("cpu",) * 2
        with pytest.raises(SwarmError, match="no CUDA device is visible"):
            LocalSwarm(tiny_model, device="cuda")
    else:
        assert all(g > 0 for g in gpus) and plan.devices[0] == "cuda:0" and plan.torch_dtype != "float32"
