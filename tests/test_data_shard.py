"""dataset_batches (dist_eval.data.shard) on two ranks run as two threads of this process,
the collectives faked with a barrier: each row is tokenized once per run (issue 29: the
lengths for the plan and the batches each tokenized it), and every rank's batches are
exactly those of a one-rank run."""
import contextlib
import os
import sys
import threading

import numpy as np
import pytest
from conftest import REPO
from thread_ranks import ThreadRanks

from dist_eval import ranks

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import bench_gpu  # noqa: E402


class _CountingTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer, self.texts, self.lock = tokenizer, 0, threading.Lock()

    def __call__(self, texts, *args, **kwargs):
        with self.lock:
            self.texts += len(texts)
        return self.tokenizer(texts, *args, **kwargs)


@pytest.fixture(scope="module")
def long_tailed(tmp_path_factory):
    import datasets
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("shard")
    data = bench_gpu.make_data(str(folder / "data"), 300, 13)
    bench_gpu.save_tokenizer(str(folder / "model"), data["vocab"])
    return AutoTokenizer.from_pretrained(str(folder / "model")), datasets.load_from_disk(str(folder / "data"))


def _batches(tokenizer, dataset, settings):
    from dist_eval.data.shard import dataset_batches

    labels = np.array(dataset["label"])
    batches, truncated, _ = dataset_batches(dataset, tokenizer, labels, settings, pad_token_id=0, prefix_tokens=8)
    return {b: (rows.tolist(), padded.tolist()) for b, rows, padded, _ in batches}, truncated


@pytest.mark.parametrize("cap", [None, 2048])
def test_each_row_is_tokenized_once_and_the_batches_do_not_change(long_tailed, monkeypatch, cap):
    from dist_eval.config import Settings

    tokenizer, dataset = long_tailed
    settings = Settings(batch_size=16, max_batch_tokens=cap, max_length=64)
    alone, truncated_alone = _batches(tokenizer, dataset, settings)
    fake, counting = ThreadRanks(2), _CountingTokenizer(tokenizer)
    for name in ("all_gather_object", "exchange_objects"):
        monkeypatch.setattr(ranks, name, getattr(fake, name))
    monkeypatch.setattr(ranks, "get_rank", fake.rank)
    monkeypatch.setattr(ranks, "get_world_size", lambda: 2)
    monkeypatch.setattr(ranks, "phase", lambda name: contextlib.nullcontext())
    results = [None, None]

    def run(rank):
        fake.local.rank = rank
        results[rank] = _batches(counting, dataset, settings)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(results), "a rank failed"
    assert counting.texts == len(dataset)  # before: rows of the other rank's block tokenized again
    (first, truncated0), (second, truncated1) = results
    assert not set(first) & set(second) and {**first, **second} == alone
    assert truncated0 + truncated1 == truncated_alone > 0
