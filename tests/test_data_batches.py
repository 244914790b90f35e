"""The global batch plan and its shards (dist_eval.data.batches), no processes: every row
lands on exactly one rank for N = 1..4 and awkward sizes; length buckets and token budgets."""
import numpy as np
import pytest
import torch
from test_merge import payload
from torch.utils.data import DistributedSampler

from dist_eval.data import plan_batches, shard_batch_ids
from dist_eval.data.batches import snake_order
from dist_eval.merge import merge_gathered

SIZES = [1, 2, 3, 5, 7, 100]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("num_rows", SIZES)
@pytest.mark.parametrize("batch_size", [1, 2, 16])
def test_shards_cover_every_row_once(world, num_rows, batch_size):
    batches = plan_batches(num_rows, batch_size)
    shards = [shard_batch_ids(len(batches), r, world) for r in range(world)]
    rows = np.concatenate([batches[b] for shard in shards for b in shard])
    assert sorted(rows.tolist()) == list(range(num_rows))
    # shards are DistributedSampler's (no padding) of the ids in snake order: sizes differ by at most one batch
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    order = snake_order(len(batches), world)
    for r, shard in enumerate(shards):
        padded = list(DistributedSampler(range(len(batches)), num_replicas=world, rank=r, shuffle=False))
        assert sorted(order[p] for p in padded[: len(shard)]) == shard
    merged = merge_gathered([payload(np.concatenate([batches[b] for b in s]) if s else []) for s in shards], num_rows)
    assert merged.indices.tolist() == list(range(num_rows))
    assert merged.num_duplicates_dropped == 0


def test_more_ranks_than_batches_leaves_ranks_empty():
    assert [shard_batch_ids(1, r, 4) for r in range(4)] == [[0], [], [], []]


def test_snake_order_deals_every_rank_nearly_the_same_cost():
    assert snake_order(7, 3) == [0, 1, 2, 5, 4, 3, 6]
    assert snake_order(5, 1) == [0, 1, 2, 3, 4] and snake_order(0, 2) == []
    assert [shard_batch_ids(9, r, 2) for r in range(2)] == [[0, 3, 4, 7, 8], [1, 2, 5, 6]]
    costs = np.sort(np.random.default_rng(0).integers(100, 2048, size=41))[::-1]  # a plan: longest first
    for world in (2, 3, 4, 8):
        totals = [int(costs[shard_batch_ids(len(costs), r, world)].sum()) for r in range(world)]
        assert max(totals) - min(totals) <= costs[0]  # at most one batch apart
        dealt = [int(costs[r::world].sum()) for r in range(world)]  # plan order: rank 0 gets the most
        assert max(totals) - min(totals) < max(dealt) - min(dealt)


def _lengths(num_rows, seed=0):
    return np.random.default_rng(seed).integers(1, 65, size=num_rows)


@pytest.mark.parametrize("num_rows", SIZES)
@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_length_buckets_cover_every_row_once_longest_first(num_rows, batch_size):
    lengths = _lengths(num_rows)
    batches = plan_batches(num_rows, batch_size, lengths)
    rows = np.concatenate(batches)
    assert sorted(rows.tolist()) == list(range(num_rows))
    assert all(len(b) == batch_size for b in batches[:-1]) and 1 <= len(batches[-1]) <= batch_size
    # sorted longest first, ties in row order: the plan is a pure function of the data
    keys = [(-int(lengths[r]), int(r)) for r in rows]
    assert keys == sorted(keys)


def test_length_buckets_reduce_padding():
    lengths = _lengths(1000)

    def padded_tokens(batches):
        return sum(len(b) * int(lengths[b].max()) for b in batches)

    ordered, bucketed = plan_batches(1000, 16), plan_batches(1000, 16, lengths)
    assert padded_tokens(bucketed) < 0.7 * padded_tokens(ordered)
    assert padded_tokens(bucketed) >= int(lengths.sum())


@pytest.mark.parametrize("budget", [1, 10, 64, 100, 1000])
@pytest.mark.parametrize("length_buckets", [True, False])
@pytest.mark.parametrize("prefix", [0, 8])
def test_token_budget_batches(budget, length_buckets, prefix):
    lengths = _lengths(300, seed=1)
    batches = plan_batches(
        300, 16, lengths, max_batch_tokens=budget, length_buckets=length_buckets, prefix_tokens=prefix
    )
    rows = np.concatenate(batches)
    assert sorted(rows.tolist()) == list(range(300))
    if not length_buckets:
        assert rows.tolist() == list(range(300))  # dataset order kept
    for b in batches:
        padded = len(b) * (int(lengths[b].max()) + prefix)
        assert len(b) <= 16 and (padded <= budget or len(b) == 1)  # a row longer than the budget goes alone
    # greedy: the next row would have broken a cap
    for b, nxt in zip(batches, batches[1:]):
        grown = max(int(lengths[b].max()), int(lengths[nxt[0]]))
        assert len(b) == 16 or (len(b) + 1) * (grown + prefix) > budget


def test_token_budget_needs_lengths():
    with pytest.raises(ValueError, match="lengths"):
        plan_batches(10, 4, None, max_batch_tokens=100)


def test_padded_batches_tokenize_missing_rows_as_their_batches_come():
    from dist_eval.data.shard import _AHEAD_ROWS, padded_batches

    planned = [np.arange(i * 100, (i + 1) * 100, dtype=np.int64) for i in range(12)]  # 12 batches of 100 rows
    labels = np.arange(1200) % 3
    known = {r: [r % 50 + 1] * 2 for r in range(0, 1200, 2)}  # half the rows came from the lengths phase
    own = [0, 2, 3, 5, 7, 8, 9, 11]
    calls = []

    def tokenize(rows):
        calls.append(list(rows))
        return [[r % 50 + 1] * 2 for r in rows]

    batches = padded_batches(own, planned, labels, dict(known), tokenize, pad_token_id=0)
    first = next(batches)
    # the first batch is out after one call: its 50 missing rows and the next batches', up to _AHEAD_ROWS
    assert _AHEAD_ROWS == 256 and [len(call) for call in calls] == [300]
    assert calls[0][:50] == list(range(1, 100, 2)) and all(r % 2 for r in calls[0])
    rest = list(batches)
    assert [b[0] for b in [first, *rest]] == own
    assert [len(call) for call in calls] == [300, 100]  # the two batches left, when their turn came
    assert sorted(r for call in calls for r in call) == [r for b in own for r in range(b * 100 + 1, (b + 1) * 100, 2)]
    for batch_id, rows, input_ids, batch_labels in [first, *rest]:
        assert torch.equal(input_ids, torch.tensor([[r % 50 + 1] * 2 for r in range(batch_id * 100,
                                                                                       (batch_id + 1) * 100)]))
        assert np.array_equal(rows, planned[batch_id]) and np.array_equal(batch_labels, labels[rows])
