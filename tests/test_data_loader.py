"""dist_eval.data.loader: the seeds' DataLoader as it is (no 'index', an attention mask,
a DistributedSampler or a plain loader), in one process. In real gloo groups:
test_evaluation.py's test_seeds_loader_every_row_once_metrics_equal_sklearn (its launches
run gloo_loader_worker.py's cases)."""
import numpy as np
import pytest
import torch

from dist_eval.data import loader as dl
from dist_eval.errors import UsageError


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
