"""Bounded memory (issue 51) changes no result: a long-tailed set's outputs (predictions.jsonl with
logits and texts, metrics.json but its run facts, slices.csv, per_class.csv / .md, the rows the row store
keeps) are the same bytes whether each chunk of the bounded-memory code holds the whole set (one chunk:
the unbounded path) or the set crosses every chunk boundary several times (the sizes shrunk through
``DIST_EVAL_CHUNK_ROWS``, dist_eval/chunks.py), on N=1 and N=3, and with every row served from the row
store; both sides computed in the same test, on this machine. The reference keys its rows as the code
before issue 74 did (rank 0, in the report); the runs compared with it, as the ranks do now (each its block,
beside the token lengths, gathered on rank 0). The same set's K = 1, 3, 7 shards, merged,
are its one run's bytes (issue 53)."""
from __future__ import annotations

import json
import os
import random
import sys
from unittest import mock

import numpy as np
import pytest
from conftest import WORDS, run_ranks
from float_promises import assert_same_bits
from inprocess_cli import run_cli_in_process

from dist_eval.chunks import DEFAULT_ROWS, ENV

# the files compared byte for byte (metrics.json: without its run facts, which hold timings)
FILES = ("predictions.jsonl", "slices.csv", "per_class.csv", "per_class.md")
# the run facts that are results (the same for any N and any chunk sizes)
RUN_RESULTS = ("sample", "duplicates_dropped", "resumed_samples")
# the set: 2,400 rows, its --limit sample 1,800 (a rank's block of 600 on N=3; predictions.jsonl's lines,
# the merge's row indices, the softmax's and the metrics' rows), about 30,000 token ids
SET_ROWS, SAMPLE_ROWS = 2400, 1800
# One chunk of everything (a size above any set's): the unbounded path, the reference
ONE_CHUNK = str(1 << 40)
# Each chunk crossed several times by the rows it takes (a rank's block of 600 rows the smallest), with an
# uneven remainder, no two sizes alike (their boundaries fall in different places)
SHRUNK = {"tokenize": 97, "exchange": 211, "copy_tokens": 1009, "keys": 173, "slice_read": 131, "store_keys": 157,
          "known": 89, "lines": 113, "merge": 251, "softmax": 199, "metrics": 139, "aside": 229}
IN_CHUNKS = ",".join(f"{name}={rows}" for name, rows in SHRUNK.items())


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


def run_args(model, checkpoint, data, out, row_store=None):
    """The token budget and length buckets (the plan from the lengths), truncation, a --limit sample,
    slices (the token-length quartiles too), logits and texts saved, the intervals of the scores;
    ``row_store``: the run's store folder (else off, as every test's)."""
    return ["--model", model, "--checkpoint", checkpoint, "--backend", "local", "--data-files", data,
            "--output-dir", str(out), "--batch-size", "16", "--max-batch-tokens", "300", "--max-length", "48",
            "--limit", str(SAMPLE_ROWS), "--limit-seed", "5", "--slice-by", "lang", "--save-logits", "--save-text",
            "--bootstrap-resamples", "30", "--progress", "none", "--quiet",
            *(["--row-store", str(row_store)] if row_store else [])]


def results_of(folder) -> dict:
    """metrics.json without the run's facts but those that are results."""
    with open(os.path.join(folder, "metrics.json")) as f:
        metrics = json.load(f)
    run = metrics.pop("run")
    metrics["run"] = {key: run[key] for key in RUN_RESULTS}
    return metrics


def stored_rows(store) -> dict:
    """{(model and task folder, row key): (its logits' bytes, its servers)} of every row a row store
    keeps (the seconds each took left out: a timing)."""
    from dist_eval.rowstore.upkeep import key_folders, survey

    return {(os.path.relpath(folder, store), row): (logits.tobytes(), servers)
            for folder, key in key_folders(str(store))
            for row, (logits, _, servers) in survey(folder, key).rows.items()}


def assert_the_same_outputs(got, want, what: str) -> None:
    """Every compared output of the run in ``got`` is ``want``'s, byte for byte."""
    assert_same_bits(results_of(got), results_of(want), f"metrics.json, {what}")
    for name in FILES:
        assert (got / name).read_bytes() == (want / name).read_bytes(), f"{name}, {what}"


@pytest.fixture(scope="module")
def long_tailed(tiny_model, tiny_checkpoint, tmp_path_factory):
    """(the data, the N=1 run's folder, its row store): the CLI in this process, one thread as a rank
    computes, every chunk the whole set (the unbounded path)."""
    base = tmp_path_factory.mktemp("long_tailed")
    data = write_long_tailed_csv(base / "data.csv", SET_ROWS, seed=51)
    # without matplotlib: the figures are no compared output; the content keys the old way (issue 74): rank 0
    # keys every row in the report, not the ranks beside their token lengths
    with mock.patch.dict(os.environ, {ENV: ONE_CHUNK}), mock.patch("dist_eval.data.shard._key_rows"):
        assert run_cli_in_process(run_args(tiny_model, tiny_checkpoint, data, base / "one", base / "store"),
                                  hide_modules=("matplotlib",)) == 0
    assert SAMPLE_ROWS - 10 < len(stored_rows(base / "store")) <= SAMPLE_ROWS  # rows of one text share a key
    return data, base / "one", base / "store"


def test_every_chunk_size_is_shrunk_to_cross_the_set_several_times():
    """The shrunk sizes name every chunk dist_eval has (one added later must be crossed here too), and
    each one's boundary is crossed at least twice, with a remainder, by the fewest rows it takes (a rank's
    block on N=3)."""
    assert set(SHRUNK) == set(DEFAULT_ROWS)
    block = SAMPLE_ROWS // 3
    for name, rows in SHRUNK.items():
        if name != "copy_tokens":  # token ids: about 30,000 of them
            assert block // rows >= 2 and block % rows, name


def test_the_chunk_sizes_are_read_at_each_call_and_a_wrong_setting_is_refused_naming_it(monkeypatch):
    """DIST_EVAL_CHUNK_ROWS: unset, the defaults; one size for all, or the named ones; read at each call;
    a name or size it does not take refused in one line naming the variable, what it takes and the fix."""
    from dist_eval.chunks import chunk_rows
    from dist_eval.errors import UsageError

    monkeypatch.delenv(ENV, raising=False)
    assert {name: chunk_rows(name) for name in DEFAULT_ROWS} == DEFAULT_ROWS
    monkeypatch.setenv(ENV, "7")
    assert {chunk_rows(name) for name in DEFAULT_ROWS} == {7}
    monkeypatch.setenv(ENV, IN_CHUNKS)
    assert {name: chunk_rows(name) for name in DEFAULT_ROWS} == SHRUNK
    monkeypatch.setenv(ENV, "merge=5")
    assert chunk_rows("merge") == 5 and chunk_rows("lines") == DEFAULT_ROWS["lines"]
    for wrong, said in (("merg=5", "'merg' names no chunk size"), ("merge=0", "'0' is no size"),
                        ("x", "'x' is no size")):
        monkeypatch.setenv(ENV, wrong)
        with pytest.raises(UsageError, match=f"{ENV}='{wrong}': {said}: expected .* unset {ENV} for the defaults"):
            chunk_rows("merge")


def test_one_rank_in_chunks_writes_the_bytes_of_one_chunk(long_tailed, tiny_model, tiny_checkpoint, tmp_path,
                                                           monkeypatch):
    """N=1 with every chunk crossed several times writes the unbounded run's files byte for byte and
    keeps the same rows in its row store; run again, every row served from that store (the known rows'
    batches crossed too), it writes them again. Each row is tokenized once and keyed once."""
    from dist_eval.data import sample, tokenize

    data, one, store = long_tailed
    monkeypatch.setenv(ENV, IN_CHUNKS)
    keyed, range_keys = [], sample.range_keys
    monkeypatch.setattr(sample, "range_keys", lambda *args: keyed.append(args[-1] - args[-2]) or range_keys(*args))
    tokenized, token_ids = [], tokenize._token_ids
    monkeypatch.setattr(tokenize, "_token_ids", lambda tok, texts, *args: tokenized.append(len(texts))
                        or token_ids(tok, texts, *args))
    for served in (False, True):
        out = tmp_path / ("served" if served else "fresh")
        keyed.clear()
        tokenized.clear()
        assert run_cli_in_process(run_args(tiny_model, tiny_checkpoint, data, out, tmp_path / "store"),
                                  hide_modules=("matplotlib",)) == 0
        if not served:  # the set keyed for its --limit sample, the sample's rows once beside their lengths
            assert sum(keyed) == SET_ROWS + SAMPLE_ROWS, keyed  # not again in the report (issue 74)
        # each row tokenized once, by the length pass: the forwards take its spilled ids (issue 74)
        assert sum(tokenized) == SAMPLE_ROWS, tokenized
        row_store = json.load(open(out / "metrics.json"))["run"]["row_store"]
        assert row_store["rows_from_store"] == (SAMPLE_ROWS if served else 0), row_store
        assert_the_same_outputs(out, one, f"in chunks {'(every row served from the store) ' if served else ''}"
                                          "against one chunk")
        assert stored_rows(tmp_path / "store") == stored_rows(store), "the row store, in chunks against one chunk"


@pytest.mark.multiproc
def test_three_ranks_in_chunks_write_the_bytes_of_one_rank_in_one_chunk(long_tailed, tiny_model, tiny_checkpoint,
                                                                       tmp_path, rank_zygote, no_figures):
    """N=3 (three real rank processes in a real gloo group, with torchrun's environment, forked by
    conftest's run_ranks: what the ranks compute is tested, not the launch), every chunk crossed several
    times on every rank (the token ids' exchange too), writes N=1's unbounded files byte for byte and
    keeps the same rows in its row store. No figures drawn (matplotlib hidden): they are no compared output."""
    data, one, store = long_tailed
    proc = run_ranks(rank_zygote, run_args(tiny_model, tiny_checkpoint, data, tmp_path / "three", tmp_path / "store"),
                     nproc=3, timeout=300, env={ENV: IN_CHUNKS, **no_figures})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.rank_codes == [0, 0, 0], "forked ranks (not torchrun): the zygote serves this environment"
    assert json.load(open(tmp_path / "three" / "metrics.json"))["run"]["world_size"] == 3
    assert_the_same_outputs(tmp_path / "three", one, "N=3 in chunks against N=1 in one chunk")
    assert stored_rows(tmp_path / "store") == stored_rows(store), "the row store, N=3 in chunks against N=1"


@pytest.mark.parametrize("k", [1, 3, 7])
def test_the_long_tailed_sets_shards_merge_into_its_one_run(long_tailed, tiny_model, tiny_checkpoint, tmp_path, k,
                                                            monkeypatch):
    """Issue 53 on a long-tailed set (the token budget's plan, truncated rows, a --limit sample,
    slices with the length quartiles, logits, texts): its K shards, each run apart (every chunk crossed
    several times: a shard's rows selected a chunk at a time too), merged by ``python -m dist_eval
    merge``'s code, are its one run's bytes."""
    from dist_eval.shard_merge import main as merge_main

    data, one, _ = long_tailed
    monkeypatch.setenv(ENV, IN_CHUNKS)
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
    from dist_eval.results import ShardResults

    rows = np.asarray(rows, dtype=np.int64)
    rng = np.random.default_rng(len(rows))
    return ShardResults(indices=rows, labels=rows % classes if labels is None else np.asarray(labels, np.int64),
                        preds=(rows * 7) % classes, losses=rng.random(len(rows)),
                        logits=rng.normal(size=(len(rows), classes)).astype(np.float32),
                        sample_values={"v": rng.random(len(rows))})


def test_the_token_counts_no_plan_measured_are_counted_in_chunks_as_in_one(tiny_model, tmp_path, monkeypatch):
    """data.shard.token_lengths where no batch plan measured the rows (--slice-by's length quartiles with
    neither a token budget nor length buckets: not the CLI runs above), counted a chunk of rows at a time:
    each row's count, truncated to max_length, as the tokenizer gives it, in one chunk and in many."""
    import csv

    import datasets

    from dist_eval.backends.tokenizer import load_tokenizer
    from dist_eval.config import Settings
    from dist_eval.data.shard import token_lengths

    with open(write_long_tailed_csv(tmp_path / "rows.csv", 600, seed=3)) as f:
        texts = [row["text"] for row in csv.DictReader(f)]
    data, tokenizer = datasets.Dataset.from_dict({"text": texts, "label": [0] * len(texts)}), load_tokenizer(tiny_model)
    expected = [min(len(tokenizer(text)["input_ids"]), 48) for text in texts]
    for sizes in (ONE_CHUNK, IN_CHUNKS):
        monkeypatch.setenv(ENV, sizes)
        assert token_lengths(data, tokenizer, Settings(max_length=48)).tolist() == expected, sizes


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 16])
def test_the_merge_a_range_of_rows_at_a_time_is_the_whole_merge(chunk, monkeypatch):
    """stream_to_main (rank 0's merge, a range of row indices at a time, into mapped files) keeps what
    merge_gathered keeps of the whole: the first copy of each row (a row given twice with other values:
    the first wins), every field, the duplicates' count; and refuses as it refuses, in the same words
    (missing rows, rows outside the split or the shard, duplicates that disagree). Ranges of 1 row up.
    merge_parts (the rounds of a run that stops early joined in row order, the merge's chunk of rows at
    a time) gives the whole merge's fields too."""
    from dist_eval.merge import CoverageError, MergedResults, merge_gathered, merge_parts, stream_to_main

    order = np.random.default_rng(0).permutation(300)
    rows = np.r_[order, order[:40], 299, 0]  # duplicates, in no order: the first copy of each must win
    local = _shard_results(rows)
    whole = merge_gathered([local.as_payload()], 300)
    merged = stream_to_main(local, 300, chunk_rows=chunk)
    for name in ("indices", "labels", "preds", "losses", "logits"):
        assert np.asarray(getattr(merged, name)).tobytes() == getattr(whole, name).tobytes(), name
    assert np.asarray(merged.sample_values["v"]).tobytes() == whole.sample_values["v"].tobytes()
    assert merged.num_duplicates_dropped == whole.num_duplicates_dropped == 42
    monkeypatch.setenv(ENV, f"merge={chunk}")
    rounds = np.split(np.random.default_rng(1).permutation(300), [70, 71, 190])  # uneven, their rows in no order
    joined = merge_parts([MergedResults(indices=whole.indices[r], labels=whole.labels[r], preds=whole.preds[r],
                                        losses=whole.losses[r], logits=whole.logits[r],
                                        sample_values={"v": whole.sample_values["v"][r]}) for r in rounds])
    for name in ("indices", "labels", "preds", "losses", "logits"):
        assert np.asarray(getattr(joined, name)).tobytes() == getattr(whole, name).tobytes(), name
    assert np.asarray(joined.sample_values["v"]).tobytes() == whole.sample_values["v"].tobytes()
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
    report = merge_on_main(local, rows, 3, bootstrap=(2, 0)).report
    cost = report["run"]["exact_score_intervals"]
    assert cost == {"rows": rows, "why": "class 2 has 5 rows on one side of its AUROC, fewer than 1000",
                    "bytes_per_rank": rows * (32 * 3 + 68), "row_draws": 2 * rows}
    assert LoopFacts.from_report(report).report()["run"]["exact_score_intervals"] == cost  # kept as evaluate keeps it
    report = merge_on_main(_shard_results(np.arange(rows)), rows, 3, bootstrap=(2, 0)).report
    assert report["run"]["exact_score_intervals"] is None


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


def test_a_ranks_spilled_token_ids_leave_nothing_on_disk_when_it_is_killed(tmp_path):
    """The token ids a rank spills ($TMPDIR, issue 51; read back by the forwards, issue 74) are in files
    no name points to, from their creation: while the rank runs they are mapped and read, and once it is
    killed (SIGKILL: no clean-up of its own runs) nothing of them is left in $TMPDIR."""
    import signal
    import subprocess
    import textwrap

    spill_dir = tmp_path / "tmp"
    spill_dir.mkdir()
    code = textwrap.dedent("""
        import sys, time
        import numpy as np
        from dist_eval.data.shard import PackedIds, _Spill
        spill = _Spill()
        for start in range(0, 1 << 20, 1 << 16):
            spill.add(np.arange(start, start + (1 << 16)))
        ids = PackedIds(np.arange(1 << 16), np.full(1 << 16, 16), spill.array())
        assert ids.take(np.array([5]))[0] == list(range(80, 96))
        print("spilled", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(spill_dir)})
    try:
        assert proc.stdout.readline().strip() == "spilled"
        with open(f"/proc/{proc.pid}/maps") as f:
            mapped = [line for line in f if str(spill_dir) in line]
        assert mapped and all(line.rstrip().endswith("(deleted)") for line in mapped), mapped
        assert os.listdir(spill_dir) == []
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert os.listdir(spill_dir) == []
