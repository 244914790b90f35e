"""dist_eval.ranks.devices: the GPU-node decisions as pure functions (tested without a GPU),
and the refusals a CPU machine can show for real."""
import pytest

from dist_eval.config import EvalConfig
from dist_eval.errors import UsageError
from dist_eval.ranks import devices
from dist_eval.ranks.collectives import group_device


def backend(flag, available, count, local_rank):
    return devices.dist_backend_for(flag, cuda_available=available, device_count=count, local_rank=local_rank)


def device(requested, available, count, local_rank):
    return devices.local_device(requested, cuda_available=available, device_count=count, local_rank=local_rank)


@pytest.mark.parametrize("available,count", [(False, 0), (True, 1), (True, 8)])
@pytest.mark.parametrize("local_rank", [0, 1, 5, 15])
def test_gloo_by_default_whatever_the_gpus_so_n_is_not_capped(available, count, local_rank):
    assert backend("gloo", available, count, local_rank) == "gloo"


def test_nccl_on_request_needs_one_gpu_per_rank():
    assert backend("nccl", True, 2, 1) == "nccl"
    for available, count, local_rank in ((False, 0, 0), (True, 1, 1), (True, 2, 4)):
        with pytest.raises(UsageError) as e:
            backend("nccl", available, count, local_rank)
        assert str(e.value).startswith("dist_backend='nccl'") or str(e.value).startswith("dist_backend=nccl")
        assert "\n" not in str(e.value) and "gloo" in str(e.value)
    with pytest.raises(UsageError):
        backend("mpi", True, 1, 0)


def test_local_device_per_rank_wraps_around_the_gpus():
    assert device("cpu", False, 0, 3) == "cpu"
    assert [device("cuda", True, 2, r) for r in range(5)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert device("cuda:1", True, 2, 7) == "cuda:1"


@pytest.mark.parametrize("requested,available,count", [
    ("cuda", False, 0), ("cuda:0", False, 0), ("cuda:2", True, 2), ("gpu", True, 1), ("cuda:x", True, 1)])
def test_a_device_that_does_not_exist_is_refused_in_one_line(requested, available, count):
    with pytest.raises(UsageError) as e:
        device(requested, available, count, 0)
    assert str(e.value).startswith("device=") and "\n" not in str(e.value)


def test_device_is_for_the_local_backend_only():
    with pytest.raises(UsageError, match="device"):
        EvalConfig(device="cuda", backend="petals")
    assert EvalConfig(device="cuda", backend="local").device == "cuda"
    assert EvalConfig().dist_backend == "gloo" and EvalConfig().device == "cpu"


def test_collectives_use_the_cpu_in_one_process():
    assert str(group_device()) == "cpu"


def test_load_model_refuses_a_missing_gpu(tiny_model, tiny_checkpoint):
    import torch

    from dist_eval import load_model

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UsageError) as e:
        load_model("local", tiny_model, checkpoint=tiny_checkpoint, device="cuda")
    assert str(e.value).startswith("device=") and "no CUDA device" in str(e.value)
    model = load_model("local", tiny_model, checkpoint=tiny_checkpoint, device="cpu")
    assert model.module.prompt_device().type == "cpu"
