"""Bounded memory (issue 51) changes no result: a long-tailed set's outputs (predictions.jsonl with
logits and texts, metrics.json but its run facts, slices.csv, per_class.csv / .md) are the same
bytes on N=1 and N=3, and those the code before issue 51 wrote on this machine (recorded in
tests/memory_reference.json; ``python tests/test_memory_bounded.py --record`` records this code's).
The same set's K = 1, 3, 7 shards, merged, are its one run's bytes (issue 53)."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import sys
from unittest import mock

import numpy as np
import pytest
from conftest import WORDS, run_cli
from float_promises import assert_same_bits
from inprocess_cli import run_cli_in_process

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(HERE, "memory_reference.json")
# the files compared byte for byte (metrics.json: without its run facts, which hold timings)
FILES = ("predictions.jsonl", "slices.csv", "per_class.csv", "per_class.md")
# the run facts that are results (the same for any N)
RUN_RESULTS = ("sample", "duplicates_dropped", "resumed_samples")


def write_long_tailed_csv(path, num_rows: int, seed: int = 0) -> str:
    """Rows of 1 to 150 words, long-tailed (median about 9, a few past --max-length 48), 3 labels, a ``lang``."""
    r = random.Random(seed)
    with open(path, "w") as f:
        f.write("text,label,lang\n")
        for _ in range(num_rows):
            words = min(150, 1 + int(r.lognormvariate(2.1, 0.8)))
            text = " ".join(r.choice(WORDS) for _ in range(words))
            f.write(f"{text},{r.choice([0, 0, 1, 1, 2])},{r.choice(('de', 'en', 'en', 'fr'))}\n")
    return str(path)


def run_args(model, checkpoint, data, out):
    """The token budget and length buckets (the plan from the lengths), truncation, a --limit sample,
    slices (the token-length quartiles too), logits and texts saved, the intervals of the scores."""
    return ["--model", model, "--checkpoint", checkpoint, "--backend", "local", "--data-files", data,
            "--output-dir", str(out), "--batch-size", "16", "--max-batch-tokens", "300", "--max-length", "48",
            "--limit", "1800", "--limit-seed", "5", "--slice-by", "lang", "--save-logits", "--save-text",
            "--bootstrap-resamples", "30", "--progress", "none", "--quiet"]


def digests(folder) -> dict:
    """{file: sha256} of the compared outputs; metrics.json's: of its results, sorted keys."""
    out = {}
    for name in FILES:
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    out["metrics.json"] = hashlib.sha256(json.dumps(results_of(folder), sort_keys=True).encode()).hexdigest()
    return out


def results_of(folder) -> dict:
    """metrics.json without the run's facts but those that are results."""
    with open(os.path.join(folder, "metrics.json")) as f:
        metrics = json.load(f)
    run = metrics.pop("run")
    metrics["run"] = {key: run[key] for key in RUN_RESULTS}
    return metrics


def machine() -> dict:
    """What the recorded bits depend on besides the code: the libraries that compute and the CPU."""
    import numpy
    import tokenizers
    import torch

    cpu = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return {"torch": torch.__version__, "numpy": numpy.__version__, "tokenizers": tokenizers.__version__,
            "machine": platform.machine(), "cpu": cpu,
            # the kernels torch picks (ATEN_CPU_CAPABILITY may choose others on the same CPU): the logits' last bits
            "aten_capability": torch.backends.cpu.get_cpu_capability()}


@pytest.fixture(scope="module")
def long_tailed(tiny_model, tiny_checkpoint, tmp_path_factory):
    """(the data, the N=1 run's folder): the CLI in this process, one thread as a rank computes."""
    base = tmp_path_factory.mktemp("long_tailed")
    data = write_long_tailed_csv(base / "data.csv", 2400, seed=51)
    # without matplotlib: the figures are no compared output
    assert run_cli_in_process(run_args(tiny_model, tiny_checkpoint, data, base / "one"),
                              hide_modules=("matplotlib",)) == 0
    return data, base / "one"


def test_outputs_are_those_recorded_before_issue_51(long_tailed):
    """N=1's outputs are the bytes the code before issue 51 wrote (on the machine it was recorded on)."""
    with open(REFERENCE) as f:
        recorded = json.load(f)
    if recorded["machine"] != machine():
        pytest.skip(f"recorded on {recorded['machine']}, this is {machine()}: the logits' last bits may differ; "
                    "the N=1 against N=3 test still runs")
    found = digests(long_tailed[1])
    changed = [name for name in found if found[name] != recorded["digests"].get(name)]
    assert not changed, (f"{changed} differ from the recorded bytes. A change meant to change results (and only "
                         "such) records them again: .venv/bin/python tests/test_memory_bounded.py --record")


@pytest.mark.multiproc
def test_three_ranks_write_the_bytes_of_one(long_tailed, tiny_model, tiny_checkpoint, tmp_path):
    """N=3 under torchrun writes N=1's files byte for byte."""
    data, one = long_tailed
    proc = run_cli(run_args(tiny_model, tiny_checkpoint, data, tmp_path / "three"), nproc=3, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.load(open(tmp_path / "three" / "metrics.json"))["run"]["world_size"] == 3
    assert_same_bits(results_of(tmp_path / "three"), results_of(one), "metrics.json, N=3 against N=1")
    for name in FILES:
        assert (tmp_path / "three" / name).read_bytes() == (one / name).read_bytes(), f"{name}, N=3 against N=1"


@pytest.mark.parametrize("k", [1, 3, 7])
def test_the_long_tailed_sets_shards_merge_into_its_one_run(long_tailed, tiny_model, tiny_checkpoint, tmp_path, k):
    """Issue 53 on a long-tailed set (the token budget's plan, truncated rows, a --limit sample,
    slices with the length quartiles, logits, texts): its K shards, each run apart, merged by
    ``python -m dist_eval merge``'s code, are its one run's bytes."""
    from dist_eval.shard_merge import main as merge_main

    data, one = long_tailed
    shards = [tmp_path / f"shard{i}" for i in range(k)]
    for i, out in enumerate(shards):
        assert run_cli_in_process([*run_args(tiny_model, tiny_checkpoint, data, out), "--shard", f"{i}/{k}"],
                                  hide_modules=("matplotlib",)) == 0  # figures: the same function of the same metrics
    merged = tmp_path / "merged"
    with mock.patch.dict(sys.modules, {"matplotlib": None}):
        assert merge_main([*map(str, shards), "--output-dir", str(merged)]) == 0
    got, want = (json.load(open(folder / "metrics.json")) for folder in (merged, one))
    assert_same_bits({k: v for k, v in got.items() if k != "run"}, {k: v for k, v in want.items() if k != "run"},
                     "the merged shards' metrics against one run's")
    for name in FILES:
        assert (merged / name).read_bytes() == (one / name).read_bytes(), f"{name}, merged shards against one run"


def _shard_results(rows, labels=None, classes: int = 3):
    from dist_eval.shard_results import ShardResults

    rows = np.asarray(rows, dtype=np.int64)
    rng = np.random.default_rng(len(rows))
    return ShardResults(indices=rows, labels=rows % classes if labels is None else np.asarray(labels, np.int64),
                        preds=(rows * 7) % classes, losses=rng.random(len(rows)),
                        logits=rng.normal(size=(len(rows), classes)).astype(np.float32),
                        sample_values={"v": rng.random(len(rows))})


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 16])
def test_the_merge_a_range_of_rows_at_a_time_is_the_whole_merge(chunk):
    """stream_to_main (rank 0's merge, a range of row indices at a time, into mapped files) keeps what
    merge_gathered keeps of the whole: the first copy of each row (a row given twice with other values:
    the first wins), every field, the duplicates' count; and refuses as it refuses, in the same words
    (missing rows, rows outside the split or the shard, duplicates that disagree). Ranges of 1 row up."""
    from dist_eval.merge import CoverageError, merge_gathered, stream_to_main

    order = np.random.default_rng(0).permutation(300)
    rows = np.r_[order, order[:40], 299, 0]  # duplicates, in no order: the first copy of each must win
    local = _shard_results(rows)
    whole = merge_gathered([local.as_payload()], 300)
    merged = stream_to_main(local, 300, chunk_rows=chunk)
    for name in ("indices", "labels", "preds", "losses", "logits"):
        assert np.asarray(getattr(merged, name)).tobytes() == getattr(whole, name).tobytes(), name
    assert np.asarray(merged.sample_values["v"]).tobytes() == whole.sample_values["v"].tobytes()
    assert merged.num_duplicates_dropped == whole.num_duplicates_dropped == 42
    shard = np.arange(3, 300, 5)
    merged = stream_to_main(_shard_results(shard[::-1]), 300, shard, chunk_rows=chunk)
    assert merged.indices.tolist() == shard.tolist()
    for rows_given, num_rows, shard_rows, labels in (
            ([0, 2, 3, 4, 11], 12, None, None), ([-2, 0, 1, 2, 9], 3, None, None), (shard[2:], 300, shard, None),
            (np.r_[shard, 4], 300, shard, None), ([0, 1, 1], 2, None, [0, 1, 2])):
        with pytest.raises(CoverageError) as whole_error:
            merge_gathered([_shard_results(rows_given, labels).as_payload()], num_rows, shard_rows)
        with pytest.raises(CoverageError) as error:
            stream_to_main(_shard_results(rows_given, labels), num_rows, shard_rows, chunk)
        assert str(error.value) == str(whole_error.value)


def test_the_report_says_what_an_exact_score_interval_of_a_big_set_costs():
    """A set above EXACT_SCORE_ROWS rows with a class of 5 rows: its score intervals are the exact
    bootstrap, whose memory grows with the rows on every rank; run.exact_score_intervals says so, why
    and what it costs. A set whose classes are all common: drawn grouped, nothing said."""
    from dist_eval.intervals import EXACT_SCORE_ROWS
    from dist_eval.loop_facts import LoopFacts
    from dist_eval.merge import merge_on_main

    rows = EXACT_SCORE_ROWS + 10
    local = _shard_results(np.arange(rows), labels=np.where(np.arange(rows) < 5, 2, np.arange(rows) % 2))
    report, _ = merge_on_main(local, rows, 3, bootstrap=(2, 0))
    cost = report["run"]["exact_score_intervals"]
    assert cost == {"rows": rows, "why": "class 2 has 5 rows on one side of its AUROC, fewer than 1000",
                    "bytes_per_rank": rows * (32 * 3 + 68), "row_draws": 2 * rows}
    assert LoopFacts.from_report(report).report()["run"]["exact_score_intervals"] == cost  # kept as evaluate keeps it
    report, _ = merge_on_main(_shard_results(np.arange(rows)), rows, 3, bootstrap=(2, 0))
    assert report["run"]["exact_score_intervals"] is None


def record() -> None:
    """The N=1 run of this module's fixtures (the suite's tiny model and checkpoint), its digests recorded."""
    import tempfile

    from conftest import build_checkpoint, build_tiny_model

    os.environ["DIST_EVAL_ROW_STORE"] = "off"
    with tempfile.TemporaryDirectory() as base:
        model, checkpoint = build_tiny_model(os.path.join(base, "model")), build_checkpoint(os.path.join(base, "p.pt"))
        data = write_long_tailed_csv(os.path.join(base, "data.csv"), 2400, seed=51)
        assert run_cli_in_process(run_args(model, checkpoint, data, os.path.join(base, "one"))) == 0
        with open(REFERENCE, "w") as f:
            json.dump({"machine": machine(), "digests": digests(os.path.join(base, "one"))}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":  # --record: this code's outputs on this machine become the reference
    if sys.argv[1:] != ["--record"]:
        raise SystemExit("usage: python tests/test_memory_bounded.py --record")
    record()


def test_the_forward_loop_keeps_its_rows_in_files_as_it_put_them():
    """ShardLoop's results are its batches' values as put, in order, read from its files as memory maps:
    a batch evaluated again replaces its values in place, the row store's rows taken out of a batch are
    gone, take_redone gives the batches evaluated again (issue 51: the loop holds no list of arrays)."""
    import torch

    from dist_eval.predict import ShardLoop

    def model(ids):
        return ids[:, :3].float() / 7

    rng = np.random.default_rng(1)
    batches = [(b, np.arange(10 * b, 10 * b + n), torch.from_numpy(rng.integers(0, 50, (n, 4))), rng.integers(0, 3, n))
               for b, n in enumerate((5, 3, 4))]
    loop = ShardLoop(model, 3, keep_logits=True, sample_metrics={"m": lambda logits, labels: logits[:, 0] + labels})
    loop.run(batches)
    again = (1, batches[1][1], batches[1][2] + 1, batches[1][3])  # batch 1 evaluated again: other logits
    loop.put(1, again, model(again[2]), None, None)
    loop.redone_positions.add(1)
    loop.rows.keep_only(0, np.array([True, False, True, True, False]))
    done = [(batches[0][1], batches[0][2], batches[0][3]), (again[1], again[2], again[3]), batches[2][1:]]
    done[0] = tuple(values[[0, 2, 3]] for values in done[0])
    logits = np.concatenate([model(ids).numpy() for _, ids, _ in done])
    labels = np.concatenate([labels for _, _, labels in done])
    results = loop.results()
    assert results.indices.tolist() == np.concatenate([rows for rows, _, _ in done]).tolist()
    assert results.labels.tolist() == labels.tolist()
    assert results.logits.tobytes() == logits.tobytes()
    assert results.preds.tolist() == logits.argmax(axis=1).tolist()
    assert results.sample_values["m"].tobytes() == (logits[:, 0].astype(np.float64) + labels).tobytes()
    redone = loop.take_redone()
    assert redone["rows"].tolist() == again[1].tolist()
    assert redone["logits"].tobytes() == model(again[2]).numpy().tobytes()
    loop.rows.kept.clear()  # every batch's rows, in order: the files themselves, mapped
    assert isinstance(loop.results().logits.base, np.memmap)
