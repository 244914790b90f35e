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


def test_the_parts_of_a_run_that_stops_early_merge_into_every_field_of_one_merge():
    """merge_parts (a stopping run's rounds, each merged alone, indices already the set's):
    every field of MergedResults equals the one merge of all the rows, a field added later
    included; a field of a kind it does not know is refused, not dropped."""
    import dataclasses

    from dist_eval.merge import MergedResults, merge_parts
    from dist_eval.results import SAMPLE_VALUE_PREFIX

    def full(rows):
        out = payload(rows)
        out["logits"] = np.stack([rows * 1.0, -rows * 1.0], axis=1)
        out[SAMPLE_VALUE_PREFIX + "score"] = rows * 0.25
        return out

    rounds = [[7, 2, 5], [0, 9], [3, 1, 8, 4, 6]]
    parts = []
    for rows in rounds:  # each round merged alone (its rows 0..R-1), then its indices mapped to the set's
        part = merge_gathered([full(np.arange(len(rows)))], len(rows))
        whole = full(np.asarray(rows))
        for name in ("labels", "preds", "losses", "logits"):
            setattr(part, name, whole[name])
        part.sample_values = {"score": whole[SAMPLE_VALUE_PREFIX + "score"]}
        part.indices, part.num_duplicates_dropped = np.asarray(rows), 1
        parts.append(part)
    merged = merge_parts(parts)
    expected = merge_gathered([full(np.asarray(rows)) for rows in rounds], 10)
    for f in dataclasses.fields(MergedResults):
        got, want = getattr(merged, f.name), getattr(expected, f.name)
        if f.name == "num_duplicates_dropped":
            assert got == 3 and want == 0
        elif isinstance(want, dict):
            assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
        else:
            assert np.array_equal(got, want), f.name
    parts[0].sample_values = ["not", "a", "dict"]
    with pytest.raises(TypeError, match="sample_values"):
        merge_parts(parts)
