"""The merge on rank 0 (dist_eval.merge), no processes: order by index, de-duplicate the
padding of a DistributedSampler, check coverage, refuse inconsistent duplicates."""
import numpy as np
import pytest
from torch.utils.data import DistributedSampler

from dist_eval.merge import CoverageError, merge_gathered

SIZES = [1, 2, 3, 5, 7, 100]


def payload(rows, labels=None):
    rows = np.asarray(rows, dtype=np.int64)
    labels = rows % 3 if labels is None else np.asarray(labels)
    return {"indices": rows, "labels": labels, "preds": (rows * 7) % 3, "losses": rows * 0.5}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("num_rows", SIZES)
def test_merge_drops_distributed_sampler_padding(world, num_rows):
    # What a user DataLoader with DistributedSampler(drop_last=False) yields: padded repeats
    per_rank = [
        list(DistributedSampler(range(num_rows), num_replicas=world, rank=r, shuffle=False)) for r in range(world)
    ]
    total = sum(map(len, per_rank))
    merged = merge_gathered([payload(rows) for rows in per_rank], num_rows)
    assert merged.indices.tolist() == list(range(num_rows))
    assert merged.num_duplicates_dropped == total - num_rows
    assert merged.losses.tolist() == [i * 0.5 for i in range(num_rows)]  # each row's own values, once


def test_merge_orders_by_index():
    merged = merge_gathered([payload([4, 0, 2]), payload([1, 3])], 5)
    assert merged.indices.tolist() == [0, 1, 2, 3, 4]
    assert merged.preds.tolist() == [(i * 7) % 3 for i in range(5)]


def test_merge_reports_missing_rows():
    with pytest.raises(CoverageError, match=r"4 distinct rows, expected 6: 2 missing \(first \[1, 5\]\)"):
        merge_gathered([payload([0, 2]), payload([3, 4])], 6)


def test_merge_reports_rows_outside_the_split():
    with pytest.raises(CoverageError, match="1 outside the split"):
        merge_gathered([payload([0, 1, 2, 9])], 3)


def test_merge_refuses_duplicates_that_disagree():
    with pytest.raises(CoverageError, match="different labels"):
        merge_gathered([payload([0, 1], labels=[0, 1]), payload([1], labels=[2])], 2)
