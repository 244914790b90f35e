"""dist_eval.data.loader: the seeds' DataLoader as it is (no 'index', an attention mask,
a DistributedSampler or a plain loader), in one process and in real gloo groups."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, free_port, write_csv
from float_promises import assert_within_rounding
from sklearn import metrics as skm

from dist_eval.data import loader as dl
from dist_eval.errors import UsageError

WORKER = os.path.join(REPO, "tests", "gloo_loader_worker.py")


def rows(n, width=6, lengths=None):
    lengths = lengths or [1 + i % width for i in range(n)]
    out = []
    for i, k in enumerate(lengths):
        ids = torch.zeros(width, dtype=torch.long)
        ids[:k] = torch.arange(1, k + 1) + i
        out.append({"input_ids": ids, "attention_mask": (torch.arange(width) < k).long(), "labels": i % 3})
    return out


def batches(loader):
    return list(dl.loader_batches(loader))


def test_sequential_loader_rows_and_cut_to_longest_real_row():
    data = rows(5, lengths=[2, 3, 1, 4, 2])
    got = batches(torch.utils.data.DataLoader(data, batch_size=2))
    assert [b[1].tolist() for b in got] == [[0, 1], [2, 3], [4]]
    assert [b[2].shape[1] for b in got] == [3, 4, 2]  # cut to the longest real row, mask dropped
    assert all(torch.equal(b[2][j], data[r]["input_ids"][: b[2].shape[1]]) for b in got for j, r in enumerate(b[1]))
    assert [b[3].tolist() for b in got] == [[0, 1], [2, 0], [1]]


def test_indices_come_from_the_sampler_and_follow_set_epoch():
    data = rows(9)
    sampler = torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(1))
    order = list(iter(torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(1))))
    got = batches(torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler))
    assert np.concatenate([b[1] for b in got]).tolist() == order
    for b in got:  # each row's own tokens, whatever the order
        assert all(b[2][j, 0].item() == data[r]["input_ids"][0].item() for j, r in enumerate(b[1]))


def test_distributed_sampler_shards_and_drops_padded_repeats(monkeypatch):
    data = rows(7)
    seen = []
    for rank in range(3):
        monkeypatch.setattr(dl.ranks, "get_world_size", lambda: 3)
        monkeypatch.setattr(dl.ranks, "get_rank", lambda rank=rank: rank)
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=3, rank=rank, shuffle=True, seed=2)
        sampler.set_epoch(5)
        seen += np.concatenate([b[1] for b in batches(torch.utils.data.DataLoader(data, 2, sampler=sampler))]).tolist()
    assert sorted(seen) == list(range(7))


def test_plain_loader_is_sharded_by_batches(monkeypatch):
    data = rows(10)
    seen = []
    for rank in range(3):
        monkeypatch.setattr(dl.ranks, "get_world_size", lambda: 3)
        monkeypatch.setattr(dl.ranks, "get_rank", lambda rank=rank: rank)
        seen.append([b[1].tolist() for b in batches(torch.utils.data.DataLoader(data, batch_size=3))])
    assert seen == [[[0, 1, 2], [9]], [[3, 4, 5]], [[6, 7, 8]]]


def test_all_zero_rows_are_allowed_and_keep_the_batch_uncut():
    data = rows(3, lengths=[2, 0, 1])
    (b,) = batches(torch.utils.data.DataLoader(data, batch_size=3))
    assert b[1].tolist() == [0, 1, 2] and b[2].shape[1] == 6


def refusal(loader):
    with pytest.raises(UsageError) as e:
        batches(loader)
    message = str(e.value)
    assert message.startswith("data:") and "\n" not in message
    return message


def test_left_padding_is_refused():
    data = rows(2)
    data[1]["attention_mask"] = torch.tensor([0, 0, 1, 1, 1, 1])
    assert "right padding" in refusal(torch.utils.data.DataLoader(data, batch_size=2))


def test_unknowable_indices_are_refused():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(rows(3))

    assert "IterableDataset" in refusal(torch.utils.data.DataLoader(Stream(), batch_size=2))
    custom = [[0, 1], [2]]
    assert "batch_sampler" in refusal(torch.utils.data.DataLoader(rows(3), batch_sampler=custom))
    assert "drop_last" in refusal(torch.utils.data.DataLoader(rows(3), batch_size=2, drop_last=True))
    sampler = torch.utils.data.DistributedSampler(rows(3), num_replicas=2, rank=1)
    assert "num_replicas=2" in refusal(torch.utils.data.DataLoader(rows(3), batch_size=2, sampler=sampler))


def test_unknowable_indices_are_used_when_batches_carry_index():
    data = [dict(r, index=i) for i, r in enumerate(rows(3))]
    got = batches(torch.utils.data.DataLoader(data, batch_sampler=[[2, 0], [1]]))
    assert [b[1].tolist() for b in got] == [[2, 0], [1]]


@pytest.fixture(scope="module")
def runs(tiny_model, tiny_checkpoint, tmp_path_factory):
    base = tmp_path_factory.mktemp("gloo_loader")
    csv = write_csv(str(base / "data.csv"), 50, seed=5)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",  # this checkout's dist_eval
           "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    out = {}
    for world in (1, 2, 3):
        out[world] = base / f"n{world}"
        out[world].mkdir()
        launcher = [sys.executable] if world == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
            "--master_port", str(free_port())]
        proc = subprocess.run([*launcher, WORKER, tiny_model, tiny_checkpoint, csv, str(out[world])],
                              capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def load(out_dir, name):
    with open(os.path.join(out_dir, name + ".json")) as f:
        return dict(np.load(os.path.join(out_dir, name + ".npz"))), json.load(f)


# a DistributedSampler needs a process group: one process runs the plain loaders only
WORLD_CASES = [(world, case) for world in (1, 2, 3)
               for case in ("dist_shuffle0", "dist_shuffle1", "plain_shuffle0", "plain_shuffle1")
               if world > 1 or case.startswith("plain")]


@pytest.mark.multiproc
@pytest.mark.parametrize("size", [1, 5, 7, 50])
@pytest.mark.parametrize(("world", "case"), WORLD_CASES)
def test_seeds_loader_every_row_once_metrics_equal_sklearn(runs, world, size, case):
    single, _ = load(runs[1], f"plain_shuffle0_{size}")
    arrays, m = load(runs[world], f"{case}_{size}")
    assert arrays["indices"].tolist() == list(range(size))  # every row once; repeats dropped
    assert m["num_samples"] == size and sum(m["run"]["per_rank_samples"]) == size
    assert np.array_equal(arrays["preds"], single["preds"]) and np.array_equal(arrays["labels"], single["labels"])
    uncut = np.load(os.path.join(runs[1], f"uncut_{size}.npy"))  # cut batches: the same results
    assert_within_rounding(arrays["logits"], uncut, f"the logits of {case}, N={world}, against uncut batches'",
                           why="the caller's loader cuts other batches (other rows, other padded lengths)")
    assert np.array_equal(arrays["preds"], uncut.argmax(1))
    labels, preds = single["labels"], single["preds"]
    kw = dict(labels=[0, 1, 2], zero_division=0)
    assert m["accuracy"] == pytest.approx(skm.accuracy_score(labels, preds), abs=1e-12)
    assert m["f1_macro"] == pytest.approx(skm.f1_score(labels, preds, average="macro", **kw), abs=1e-12)
    assert m["confusion_matrix"] == skm.confusion_matrix(labels, preds, labels=[0, 1, 2]).tolist()
