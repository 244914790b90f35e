"""dist_eval.swarm.merged_forward on a real swarm: a forward request through a server's
blocks is one task of its runtime (not one per block), with the same logits bit for bit.
Marked `swarm`."""
import re
import time

import pytest
import torch
from conftest import build_checkpoint
from inprocess_cli import one_thread

from dist_eval.backends import load_model

pytestmark = pytest.mark.swarm


def _tasks_reported(swarm):
    """{pool name: tasks run} over every server's stats lines so far."""
    counts = {}
    for path in swarm.log_paths:
        for pool, batches in re.findall(r"\] (\S+): (\d+) batches \(", open(path).read()):
            counts[pool] = counts.get(pool, 0) + int(batches)
    return counts


def _settled_tasks(swarm, quiet_s: float = 2.5, limit_s: float = 30.0):
    """_tasks_reported once no new task was reported for ``quiet_s`` (over two report intervals):
    what earlier requests to the shared swarm (test_backends_wire.py's) ran, all reported."""
    counts, since, deadline = _tasks_reported(swarm), time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.2)
        now = _tasks_reported(swarm)
        if now != counts:
            counts, since = now, time.monotonic()
    return counts


def test_one_task_per_request_and_the_same_logits(split_swarm, tiny_model, tmp_path):
    """split_swarm (conftest's): two servers holding blocks 0:2 and 2:4, one thread each, reporting
    their runtime's tasks every second; shared with test_backends_wire.py, so the tasks counted
    are those reported after the ones before this test."""
    assert split_swarm.placement == [(0, 2), (2, 4)]
    before = _settled_tasks(split_swarm)
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

    def counted():  # reported since ``before``
        counts = {pool: n - before.get(pool, 0) for pool, n in _tasks_reported(split_swarm).items()}
        return {pool: n for pool, n in counts.items() if n}

    deadline = time.monotonic() + 10
    while sum(counted().values()) < 2 * len(batches) and time.monotonic() < deadline:
        time.sleep(0.2)
    tasks = counted()
    # each server ran each request as one task of the merged pool: 3 requests x 2 servers
    assert tasks == {"merged_forward": 2 * len(batches)}, tasks
