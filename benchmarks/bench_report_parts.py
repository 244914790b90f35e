"""The report's own parts on a big set, in one process (issue 74): the rows' content keys (all of them,
and the last rank's block of N=2, as "keying the rows" computes them) and predictions.jsonl's writing, of
the code in a folder (this checkout, or a ``git worktree`` of another commit), wall and CPU seconds and
the file's md5 (the same for two codes: the same bytes).

    .venv/bin/python benchmarks/bench_report_parts.py --rows 1000000 [--code FOLDER] [--data FOLDER]

The set: bench_big_set's long-tailed rows (made once in ``--data``, kept); the results: random logits
of 4 classes, seeded.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def timed(work):
    wall, cpu = time.perf_counter(), time.process_time()
    result = work()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--code", default=os.path.dirname(HERE), help="a folder of dist_eval's code (default: this one)")
    p.add_argument("--data", default=None, help="a folder for the set (made if absent; default: a temporary one)")
    args = p.parse_args()
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.abspath(args.code))
    import bench_gpu
    import datasets
    import numpy as np

    from dist_eval.data import sample
    from dist_eval.merge import MergedResults
    from dist_eval.output.files import write_predictions

    folder = args.data or tempfile.mkdtemp(prefix="bench_report_parts_")
    if not os.path.exists(os.path.join(folder, "dataset_info.json")):
        bench_gpu.make_data(folder, args.rows, 0)
    data = datasets.load_from_disk(folder)
    names, n = ("text", "label"), len(data)
    keys, wall, cpu = timed(lambda: sample.HexKeys(sample.dataset_keys(data, names, sample.CONTENT_KEY_SEED)))
    print(f"{args.code}: the content keys of {n} rows: {wall:.2f} s wall, {cpu:.2f} s CPU")
    if hasattr(sample, "range_keys"):
        block, wall, cpu = timed(lambda: sample.range_keys(data, names, sample.CONTENT_KEY_SEED, n // 2, n))
        assert np.array_equal(block, keys.keys[n // 2:])
        print(f"  a rank's block of N=2 ({n - n // 2} rows): {wall:.2f} s wall, {cpu:.2f} s CPU")
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((n, 4)).astype(np.float32)
    merged = MergedResults(np.arange(n), rng.integers(0, 4, n), logits.argmax(1), rng.random(n), logits)
    with tempfile.TemporaryDirectory() as out:
        _, wall, cpu = timed(lambda: write_predictions(out, merged, ["World", "Sports", "Business", "Sci/Tech"],
                                                       False, {"key": keys}))
        path = os.path.join(out, "predictions.jsonl")
        with open(path, "rb") as f:
            digest = hashlib.md5(f.read()).hexdigest()
        print(f"  predictions.jsonl ({os.path.getsize(path)} bytes, md5 {digest}): {wall:.2f} s wall, {cpu:.2f} s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
