"""dist_eval.swarm.merged_forward on a real swarm: a forward request through a server's
blocks is one task of its runtime (not one per block), with the same logits bit for bit.
Marked `swarm`."""
import re
import time

import pytest
import torch
from conftest import build_checkpoint, one_thread_swarm
from inprocess_cli import one_thread

from dist_eval.backends import load_model

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def split_swarm(tiny_model, tmp_path_factory):
    """Two servers holding blocks 0:2 and 2:4 (every request crosses both, each for part of
    the model), one thread each, reporting their runtime's tasks every second."""
    logs = tmp_path_factory.mktemp("merged-logs")
    yield from one_thread_swarm(tiny_model, num_servers=2, blocks_per_server=2, dht_prefix="merged-forward",
                                log_dir=str(logs), extra_server_args=["--stats_report_interval", "1"])


def _tasks_reported(swarm):
    """{pool name: tasks run} over every server's stats lines so far."""
    counts = {}
    for path in swarm.log_paths:
        for pool, batches in re.findall(r"\] (\S+): (\d+) batches \(", open(path).read()):
            counts[pool] = counts.get(pool, 0) + int(batches)
    return counts


def test_one_task_per_request_and_the_same_logits(split_swarm, tiny_model, tmp_path):
    assert split_swarm.placement == [(0, 2), (2, 4)]
    checkpoint = build_checkpoint(str(tmp_path / "deep.pt"), tuning_mode="deep_ptune", pre_seq_len=3)
    torch.manual_seed(0)
    batches = [torch.randint(2, 60, (rows, length)) for rows, length in ((4, 9), (7, 5), (2, 17))]
    petals = load_model("petals", tiny_model, checkpoint=checkpoint, initial_peers=split_swarm.initial_peers,
                        dht_prefix=split_swarm.dht_prefix)
    local = load_model("local", tiny_model, checkpoint=checkpoint)
    try:
        with one_thread(), torch.no_grad():
            remote = [petals.module(ids) for ids in batches]
            expected = [local.module(ids) for ids in batches]
    finally:
        petals.close()
    for got, want in zip(remote, expected):
        assert torch.equal(got, want)  # deep prompts added between the blocks, bitwise as in-process

    deadline = time.monotonic() + 10
    while sum(_tasks_reported(split_swarm).values()) < 2 * len(batches) and time.monotonic() < deadline:
        time.sleep(0.2)
    tasks = _tasks_reported(split_swarm)
    # each server ran each request as one task of the merged pool: 3 requests x 2 servers
    assert tasks == {"merged_forward": 2 * len(batches)}, tasks
