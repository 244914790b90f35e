"""The row store (issue 38, dist_eval/rowstore/): a later run reads the rows an earlier one
evaluated and evaluates only the others; anything that decides a row's logits changes its key;
corrupted, foreign, cut and half-written files are skipped with one warning line; concurrent
and killed writers leave only whole files. In-process runs of a tiny Llama on the local
backend (the suite turns the store off for every other test: conftest.py).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from conftest import REPO, build_checkpoint, build_tiny_model, read_jsonl, run_ranks, write_csv
from float_promises import assert_same_bits, assert_within_rounding
from inprocess_cli import one_thread

from dist_eval import evaluate
from dist_eval.backends import load_model
from dist_eval.backends.tokenizer import load_tokenizer
from dist_eval.data.load import load_split
from dist_eval.rowstore import RowStore, read_file, row_keys, store_for, tokenizer_digest, write_file

ROWS = 12
MORE = 20  # of the 24 rows: a sample's first rows are the smaller sample's (24 would be the file's order)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("rowstore")
    model_dir = build_tiny_model(str(root / "model"))
    checkpoint = build_checkpoint(str(root / "ptune.pt"))
    data = write_csv(str(root / "data.csv"), 24)
    return {"root": root, "model": model_dir, "checkpoint": checkpoint, "data": load_split([data], None)}


def _run(model_dir, checkpoint, dataset, store, forwards=None, **keywords):
    """evaluate() of a fresh load_model; ``forwards``: a list that gets each forward's rows."""
    keywords = {"limit": ROWS, "batch_size": 8, **keywords}
    with one_thread():
        model = load_model("local", model_dir, checkpoint=checkpoint)
        if forwards is not None:
            forward = model.module.forward
            model.module.forward = lambda input_ids: forwards.append(len(input_ids)) or forward(input_ids)
        try:
            return evaluate(model, dataset, tokenizer=load_tokenizer(model_dir), row_store=store, return_logits=True,
                            bootstrap_resamples=0, **keywords)
        finally:
            model.close()


def _facts(result) -> dict:
    return result.metrics["run"]["row_store"]


def _counts(result) -> tuple:
    """(rows read from the store, rows evaluated)."""
    return _facts(result)["rows_from_store"], _facts(result)["rows_evaluated"]


def _files(store: str) -> list:
    return sorted(os.path.join(d, n) for d, _, names in os.walk(store) for n in names if n.endswith(".rows"))


def test_a_later_run_evaluates_only_the_rows_the_store_lacks(assets, tmp_path):
    """--limit 12, then 20 (the first 12 are the 12's: served with their logits, bit for bit),
    then 24 again (no forward); fresh_rows evaluates all again; "off" reads and writes nothing."""
    store, args = str(tmp_path / "store"), (assets["model"], assets["checkpoint"], assets["data"])
    first = _run(*args, store)
    assert _facts(first) | {"folder": None, "read_seconds": 0, "write_seconds": 0} == {
        "folder": None, "fresh_rows": False, "rows_from_store": 0, "rows_evaluated": ROWS, "seconds_saved": 0.0,
        "read_seconds": 0, "write_seconds": 0}
    assert _facts(first)["write_seconds"] > 0
    forwards = []
    second = _run(*args, store, forwards, limit=MORE)
    assert forwards == [MORE - ROWS]  # the rows the store lacks, planned alone: one batch of 8
    facts = _facts(second)
    assert (facts["rows_from_store"], facts["rows_evaluated"]) == (ROWS, MORE - ROWS) and facts["seconds_saved"] > 0
    assert facts["folder"] == _facts(first)["folder"]
    assert_same_bits(second.predictions.logits[:ROWS], first.predictions.logits,  # the sample's first rows
                     "the rows served from the store against the run that stored them")
    run = second.metrics["run"]  # samples/s: the rows evaluated, not those the store served
    assert run["samples_per_second"] == (MORE - ROWS) / run["eval_loop_seconds"]
    third = _run(*args, store, limit=MORE)
    assert _counts(third) == (MORE, 0)
    assert third.metrics["run"]["forward_seconds_sum"] == 0
    assert third.metrics["run"]["samples_per_second"] is None  # no row evaluated
    assert_same_bits(third.predictions.logits, second.predictions.logits, "every row served from the store")
    assert_same_bits(third.metrics["accuracy"], second.metrics["accuracy"], "the accuracy of rows served")
    written = _files(store)
    fresh = _run(*args, store, limit=MORE, fresh_rows=True)
    assert _counts(fresh) == (0, MORE)
    assert_within_rounding(fresh.predictions.logits, second.predictions.logits, "fresh_rows against the store's",
                           why="fresh_rows plans the 20 rows together; the store's came from a plan of 12 and one of 8")
    assert len(_files(store)) > len(written)  # still written
    written = _files(store)
    off = _run(*args, "off", limit=MORE)
    assert _facts(off)["folder"] is None and _counts(off) == (0, MORE)
    assert _files(store) == written


@pytest.mark.parametrize("plan", [{}, {"length_buckets": False, "max_batch_tokens": None}])
def test_rows_from_the_store_still_count_as_truncated(assets, tmp_path, plan):
    """--max-length cuts rows: a run half read from the store counts as many as a run without it
    (with the token lengths measured, and without)."""
    store, args = str(tmp_path / "store"), (assets["model"], assets["checkpoint"], assets["data"])
    _run(*args, store, max_length=6, **plan)
    served = _run(*args, store, limit=MORE, max_length=6, **plan)
    alone = _run(*args, "off", limit=MORE, max_length=6, **plan)
    assert _counts(served) == (ROWS, MORE - ROWS)
    assert served.metrics["num_truncated"] == alone.metrics["num_truncated"] > 0


def _change_weight(model_dir: str) -> None:
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] += 1e-3
    save_file(tensors, path, metadata={"format": "pt"})


def _change_prompt(checkpoint: str) -> None:
    from dist_eval.backends.checkpoint import save_checkpoint

    tensors = dict(torch.load(checkpoint, weights_only=True)["state_dict"])
    tensors["prompt_embeddings.weight"][0, 0] += 1e-3
    save_checkpoint(checkpoint, "ptune", tensors)


def _change_vocabulary(model_dir: str) -> None:
    path = os.path.join(model_dir, "tokenizer.json")
    with open(path) as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    vocab["w0"], vocab["w1"] = vocab["w1"], vocab["w0"]
    with open(path, "w") as f:
        json.dump(spec, f)


CHANGES = {
    "one weight": lambda a: (_change_weight(a["model"]), {}),
    "another model, same folder name": lambda a: (shutil.rmtree(a["model"]), build_tiny_model(a["model"], seed=5), {}),
    "one prompt value": lambda a: (_change_prompt(a["checkpoint"]), {}),
    "the tokenizer's vocabulary": lambda a: (_change_vocabulary(a["model"]), {}),
    "max_length": lambda a: ({"max_length": 6},),
    "template": lambda a: ({"template": "w5 {text}"},),
    "nothing (the control)": lambda a: ({},),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_changing_what_decides_the_logits_evaluates_every_row_again(assets, tmp_path, change):
    """Each of these changes the key: not one row is served; with nothing changed, every row is."""
    work = {"model": str(tmp_path / "model"), "checkpoint": str(tmp_path / "ptune.pt")}
    shutil.copytree(assets["model"], work["model"])
    shutil.copy(assets["checkpoint"], work["checkpoint"])
    store = str(tmp_path / "store")
    before = _run(work["model"], work["checkpoint"], assets["data"], store)
    keywords = CHANGES[change](work)[-1]
    after = _run(work["model"], work["checkpoint"], assets["data"], store, **keywords)
    served = _facts(after)["rows_from_store"]
    assert served == (ROWS if change.startswith("nothing") else 0), change
    if change.startswith("nothing"):
        assert_same_bits(after.predictions.logits, before.predictions.logits, "every row served from the store")
    else:
        assert _facts(after)["folder"] != _facts(before)["folder"]


def test_the_numerics_and_the_merges_are_in_the_key(assets):
    """dtype, backend and device (a model's identity) and one merge of a BPE tokenizer change the key."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    with one_thread():
        model = load_model("local", assets["model"], checkpoint=assets["checkpoint"])
    tokenizer = load_tokenizer(assets["model"])
    from dist_eval.config import Settings

    base = store_for("/store", model, tokenizer, Settings(), 0).folder
    identity = model.identity
    for name, value in (("dtype", "bfloat16"), ("device", "cuda"), ("backend", "petals")):
        model.identity = {**identity, "model": {**identity["model"], name: value}}
        assert store_for("/store", model, tokenizer, Settings(), 0).folder != base, name
    model.identity = identity
    assert store_for("/store", model, tokenizer, Settings(text_pair_column="p", template="{text} {text_pair}"), 0
                     ).folder != base
    model.close()

    def bpe(merges):
        vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4}
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab, merges)))

    assert tokenizer_digest(bpe([("a", "b")])) != tokenizer_digest(bpe([("b", "c")]))
    assert tokenizer_digest(bpe([("a", "b")])) == tokenizer_digest(bpe([("a", "b")]))
    # how it was found is not in it (transformers 5.x keeps local_files_only, True where HF_HUB_OFFLINE is set, and
    # is_local in init_kwargs: a run's ranks and the process that filled the store had two keys, no row found)
    found_offline = bpe([("a", "b")])
    found_offline.init_kwargs.update(local_files_only=True, is_local=True)
    assert tokenizer_digest(found_offline) == tokenizer_digest(bpe([("a", "b")]))


def test_every_library_that_changes_tokens_or_logits_is_in_the_key(assets):
    """Issue 50. Before: the key held torch's version only; a new tokenizers or transformers (another
    tokenization of the same files) served the old rows."""
    from importlib import metadata

    import tokenizers
    import torch
    import transformers

    from dist_eval.config import Settings
    from dist_eval.rowstore import RowStore

    with one_thread():
        model = load_model("local", assets["model"], checkpoint=assets["checkpoint"])
    try:
        store = store_for("/store", model, load_tokenizer(assets["model"]), Settings(), 0)
    finally:
        model.close()
    versions = store.facts["model"]["libraries"]
    assert versions["torch"] == torch.__version__ and versions["transformers"] == transformers.__version__
    assert versions["tokenizers"] == tokenizers.__version__ and versions["petals"] == metadata.version("petals")
    assert versions["sentencepiece"] == metadata.version("sentencepiece")
    for name in ("tokenizers", "transformers", "petals"):
        other = {**store.facts["model"], "libraries": {**versions, name: "0.0.1"}}
        assert RowStore("/store", other, store.facts["task"]).folder != store.folder, name


def test_corrupted_foreign_and_cut_files_are_skipped_with_one_warning(assets, tmp_path, capfd):
    """A cut file, a flipped byte, a file of another key holding the same rows, bytes that are no
    row file, a temporary file a killed writer left: one warning line, none read as rows."""
    store, args = str(tmp_path / "store"), (assets["model"], assets["checkpoint"], assets["data"])
    first = _run(*args, store, save_interval=0)  # a file per batch
    files = _files(store)
    assert len(files) == 2
    folder, key = os.path.dirname(files[0]), "/".join(files[0].split(os.sep)[-3:-1])
    keys, logits, _ = read_file(files[0], key, 3)
    with open(files[0], "rb") as f:
        whole = f.read()
    with open(files[0], "wb") as f:
        f.write(whole[:-5])  # cut
    with open(os.path.join(folder, "flipped.rows"), "wb") as f:
        f.write(whole[:-1] + bytes([whole[-1] ^ 1]))
    poison = np.full_like(logits, 1e6)
    key_array = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), 16)
    write_file(os.path.join(folder, "other.rows"), key.replace(key[-1], "x" if key[-1] != "x" else "y"), key_array,
               poison, np.zeros(len(keys)))
    with open(os.path.join(folder, "junk.rows"), "wb") as f:
        f.write(os.urandom(500))
    with open(os.path.join(folder, f".{os.path.basename(files[1])}.tmp-dead"), "wb") as f:
        f.write(whole[: len(whole) // 2])
    capfd.readouterr()
    again = _run(*args, store)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "row store" in line]
    assert len(warnings) == 1 and "skipped 4 file(s)" in warnings[0], warnings
    facts = _facts(again)
    assert (facts["rows_from_store"], facts["rows_evaluated"]) == (ROWS - len(keys), len(keys))
    assert np.abs(again.predictions.logits).max() < 1e3
    assert_within_rounding(again.predictions.logits, first.predictions.logits, "rows of skipped files evaluated again",
                           why="the rows of the skipped files are planned into a batch of their own")


WRITER = """
import sys, numpy as np
from dist_eval.rowstore import write_file
folder, key, tag, rows = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
keys = np.zeros((rows, 16), np.uint8)
keys[:, :8] = np.arange(rows, dtype="<u8").view(np.uint8).reshape(rows, 8)
i = 0
while True:
    write_file(f"{folder}/{tag}-{i:06d}.rows", key, keys, np.full((rows, 3), float(i), np.float32), np.ones(rows))
    i += 1
    if i >= int(sys.argv[5]):
        break
"""


def test_concurrent_and_killed_writers_leave_only_whole_files(tmp_path, capfd):
    """Two processes write into one folder at once (as two jobs on one cluster file system); a
    third is SIGKILLed while writing big files: every file there is whole, none half-read."""
    folder, key = str(tmp_path / "m" / "t"), "m/t"
    os.makedirs(folder)
    env = {**os.environ, "PYTHONPATH": REPO}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, folder, key, tag, "50", "40"], env=env)
               for tag in ("a", "b")]
    killed = subprocess.Popen([sys.executable, "-c", WRITER, folder, key, "k", "200000", "1000000"], env=env)
    try:
        for writer in writers:
            assert writer.wait(timeout=120) == 0
        deadline = time.monotonic() + 60
        while not any(n.startswith("k-") for n in os.listdir(folder)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
    capfd.readouterr()
    store = RowStore.__new__(RowStore)
    store.folder, store.key = folder, key
    found = store.read(3)
    assert not capfd.readouterr().err  # no file skipped
    names = os.listdir(folder)
    assert sum(n.startswith(("a-", "b-")) for n in names) == 80 and any(n.startswith("k-") for n in names)
    assert len(found) == 200000
    for name in names:
        if name.endswith(".rows"):
            keys, logits, _ = read_file(os.path.join(folder, name), key, 3)
            assert len(keys) == (200000 if name.startswith("k-") else 50)


def test_swapped_checkpoints_keep_their_own_rows(assets, tmp_path):
    """As a run of several checkpoints swaps them (LoadedModel.load_trainable): B is not served
    A's rows; A swapped back is served its own, bit for bit."""
    from dist_eval.backends.classifier import read_trainable

    other = build_checkpoint(str(tmp_path / "other.pt"), seed=7)
    store, tokenizer = str(tmp_path / "store"), load_tokenizer(assets["model"])
    with one_thread():
        model = load_model("local", assets["model"], checkpoint=assets["checkpoint"])
        def run():
            return evaluate(model, assets["data"], tokenizer=tokenizer, row_store=store, limit=ROWS, batch_size=8,
                            bootstrap_resamples=0, return_logits=True)

        first = run()
        model.load_trainable(read_trainable(assets["model"], other))
        second = run()
        model.load_trainable(read_trainable(assets["model"], assets["checkpoint"]))
        third = run()
        model.close()
    assert [_facts(r)["rows_from_store"] for r in (first, second, third)] == [0, 0, ROWS]
    assert_same_bits(third.predictions.logits, first.predictions.logits, "every row served from the store")


def test_a_failed_run_leaves_its_evaluated_rows_and_a_stopping_run_reads_them(assets, tmp_path):
    """A run that fails mid-way has stored the batches it finished (flushed on failure); a run
    that stops early reads rows by rounds, and the same run again evaluates none."""
    store, tokenizer = str(tmp_path / "store"), load_tokenizer(assets["model"])
    with one_thread():
        model = load_model("local", assets["model"], checkpoint=assets["checkpoint"])
        forward, calls = model.module.forward, []

        def failing(input_ids):
            calls.append(len(input_ids))
            if len(calls) == 2:
                raise RuntimeError("the swarm went away")
            return forward(input_ids)

        model.module.forward = failing
        with pytest.raises(RuntimeError):
            evaluate(model, assets["data"], tokenizer=tokenizer, row_store=store, limit=MORE, batch_size=8,
                     in_flight=1, bootstrap_resamples=0)
        model.module.forward = forward
        again = evaluate(model, assets["data"], tokenizer=tokenizer, row_store=store, limit=MORE, batch_size=8,
                         bootstrap_resamples=0)
        assert _facts(again)["rows_from_store"] == calls[0]
        stop = dict(tokenizer=tokenizer, row_store=store, stop_at_width=0.9, stop_round_rows=8, batch_size=8,
                    bootstrap_resamples=0)
        stopped = evaluate(model, assets["data"], **stop)
        repeated = evaluate(model, assets["data"], **stop)
        model.close()
    assert sum(_counts(stopped)) == stopped.metrics["num_samples"] > 0
    assert _facts(repeated)["rows_from_store"] == repeated.metrics["num_samples"]
    assert _facts(repeated)["rows_evaluated"] == 0
    assert repeated.metrics["num_samples"] == stopped.metrics["num_samples"]
    assert_same_bits(repeated.metrics["accuracy"], stopped.metrics["accuracy"], "the accuracy of rows served")


RUN = """
import sys, torch
torch.set_num_threads(1)
from dist_eval import evaluate
from dist_eval.backends import load_model
from dist_eval.backends.tokenizer import load_tokenizer
from dist_eval.data.load import load_split
model_dir, checkpoint, data, store, limit = sys.argv[1:6]
model = load_model("local", model_dir, checkpoint=checkpoint)
# fresh_rows: each run evaluates (and writes) every row of its sample whichever reads the store
# first; without it the faster run's rows could be served to the other (seen: the 12-row run
# waited on datasets' cache lock while the 20-row run wrote them, and evaluated none)
result = evaluate(model, load_split([data], None), tokenizer=load_tokenizer(model_dir), row_store=store,
                  limit=int(limit), batch_size=4, save_interval=0, bootstrap_resamples=0, fresh_rows=True)
print(result.metrics["run"]["row_store"]["rows_evaluated"])
"""


def test_two_runs_writing_one_store_at_once_leave_it_whole(assets, tmp_path, capfd):
    """Two processes evaluate overlapping samples into one store at the same time (two jobs on
    one cluster file system): a third run reads every row of both, no file skipped."""
    data, store = str(tmp_path / "data.csv"), str(tmp_path / "store")
    assets["data"].to_csv(data, index=False)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen([sys.executable, "-c", RUN, assets["model"], assets["checkpoint"], data, store, limit],
                             env=env, stdout=subprocess.PIPE, text=True) for limit in ("12", "20")]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0] and outputs[0].split()[-1] == "12"
    capfd.readouterr()
    third = _run(assets["model"], assets["checkpoint"], load_split([data], None), store, limit=MORE)
    assert "row store" not in capfd.readouterr().err
    assert _counts(third) == (MORE, 0)


def test_row_keys_are_the_text_and_pair():
    keys = row_keys(["a b", "a b", "a b"], ["x", "x", "y"])
    assert (keys[0] == keys[1]).all() and not (keys[0] == keys[2]).all()
    assert not (row_keys(["a b"], None)[0] == row_keys(["a b"], [""])[0]).all()


@pytest.mark.multiproc
def test_two_ranks_with_the_store_equal_one_rank_bitwise(assets, tmp_path, rank_zygote):
    """The CLI on 2 ranks (forked: conftest's run_ranks) reads the rows an earlier run stored and evaluates the
    others: its report equals one in-process rank's on a copy of that store, bit for bit."""
    store = str(tmp_path / "store")
    _run(assets["model"], assets["checkpoint"], assets["data"], store, limit=8)
    shutil.copytree(store, str(tmp_path / "copy"))
    data_file = str(tmp_path / "data.csv")
    assets["data"].to_csv(data_file, index=False)
    out = str(tmp_path / "out")
    proc = run_ranks(rank_zygote, ["--model", assets["model"], "--checkpoint", assets["checkpoint"], "--data-files",
                                   data_file, "--backend", "local", "--output-dir", out, "--row-store", store,
                                   "--save-logits", "--batch-size", "8", "--limit", "20", "--bootstrap-resamples", "0"],
                     nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    assert metrics["run"]["row_store"]["rows_from_store"] == 8 and metrics["run"]["row_store"]["rows_evaluated"] == 12
    assert "8 rows from the row store" in proc.stdout
    one = _run(assets["model"], assets["checkpoint"], load_split([data_file], None), str(tmp_path / "copy"), limit=20)
    assert _facts(one)["rows_from_store"] == 8
    logits = np.array([row["logits"] for row in read_jsonl(os.path.join(out, "predictions.jsonl"))], np.float32)
    assert_same_bits(logits, one.predictions.logits, "the logits, 2 ranks against 1 on the same store")
    assert_same_bits(metrics["accuracy"], one.metrics["accuracy"], "the accuracy, 2 ranks against 1")


def _poisoned_copy(store: str, path: str, name: str, value: float, stamp: float) -> str:
    """A whole, checksummed file of ``path``'s rows whose logits are all ``value``, named ``name``
    in ``store``'s key folder, dated ``stamp`` (its modification time)."""
    key = "/".join(path.split(os.sep)[-3:-1])
    keys, logits, seconds = read_file(path, key, 3)
    key_array = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), 16)
    planted = os.path.join(os.path.dirname(path), name)
    write_file(planted, key, key_array, np.full_like(logits, value), seconds)
    os.utime(planted, (stamp, stamp))
    return planted


def test_only_files_this_user_can_trust_are_served(assets, tmp_path, capfd):
    """Issue 50. Before: files were read in name order and the first holding a row won, whoever
    wrote it; a whole, checksummed file of NaN logits was served too; a FIFO named *.rows blocked
    rank 0 forever and a link to /dev/zero read until memory ran out. Now: a file of non-finite
    logits, a FIFO and a device are each skipped (one warning line), never served; another user's
    file too (root: test_a_file_of_another_user_is_never_served). Any user runs it."""
    store, args = str(tmp_path / "store"), (assets["model"], assets["checkpoint"], assets["data"])
    first = _run(*args, store)
    [real] = _files(store)
    folder, newest = os.path.dirname(real), time.time() + 60
    _poisoned_copy(store, real, "1-nan.rows", float("nan"), newest)  # the newest
    os.mkfifo(os.path.join(folder, "2-fifo.rows"))
    os.symlink("/dev/zero", os.path.join(folder, "3-zero.rows"))
    key = "/".join(real.split(os.sep)[-3:-1])
    for name in ("2-fifo.rows", "3-zero.rows"):  # bounded here first: a reader that blocks fails, not hangs
        reader = threading.Thread(target=lambda n=name: pytest.raises(ValueError, read_file,
                                                                      os.path.join(folder, n), key, 3), daemon=True)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), f"reading {name} blocked"
    capfd.readouterr()
    again = _run(*args, store)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "row store" in line]
    assert len(warnings) == 1 and "skipped 3 file(s)" in warnings[0], warnings
    assert _counts(again) == (ROWS, 0)
    assert_same_bits(again.predictions.logits, first.predictions.logits, "the rows of the store's own file")


@pytest.mark.root
def test_a_file_of_another_user_is_never_served(assets, tmp_path, capfd):
    """Issue 50: a whole, checksummed file of the key, the newest, first by name, but another user's (given
    to uid 4242: root only) is skipped (one warning line naming why), never served."""
    store, args = str(tmp_path / "store"), (assets["model"], assets["checkpoint"], assets["data"])
    first = _run(*args, store)
    [real] = _files(store)
    theirs = _poisoned_copy(store, real, "0-planted.rows", 1e6, time.time() + 60)  # sorts first and is the newest
    os.chown(theirs, 4242, 4242)
    capfd.readouterr()
    again = _run(*args, store)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "row store" in line]
    assert len(warnings) == 1 and "skipped 1 file(s)" in warnings[0], warnings
    assert "0-planted.rows (owned by another user (uid 4242))" in warnings[0], warnings
    assert _counts(again) == (ROWS, 0)
    assert_same_bits(again.predictions.logits, first.predictions.logits, "the rows of the store's own file")


def test_the_newest_copy_of_a_row_wins_so_fresh_rows_supersede_older_ones(assets, tmp_path):
    """Issue 50. Before: the first file by name won, so --fresh-rows could not mend a store (its
    new files lost to a stale copy about half the time). Now the newest copy of a row is served."""
    store, args = str(tmp_path / "store"), (assets["model"], assets["checkpoint"], assets["data"])
    _run(*args, store)
    [real] = _files(store)
    stale = _poisoned_copy(store, real, "0-stale.rows", 7.0, time.time() - 3600)  # sorts first, older
    assert os.path.basename(stale) < os.path.basename(real)
    fresh = _run(*args, store, fresh_rows=True)
    served = _run(*args, store)
    assert _counts(served) == (ROWS, 0)
    assert_same_bits(served.predictions.logits, fresh.predictions.logits, "the newest copy")
    newest = _poisoned_copy(store, real, "0-newer.rows", 5.0, time.time() + 60)
    assert np.all(_run(*args, store).predictions.logits == 5.0), newest


def test_non_finite_logits_fail_the_run_and_are_never_stored(assets, tmp_path):
    """Issue 49/50. Before: a NaN row's argmax became a prediction, its loss null, and the row store
    kept it for every later run. Now the run fails naming the rows, and nothing of them is stored."""
    store = str(tmp_path / "store")
    with one_thread():
        model = load_model("local", assets["model"], checkpoint=assets["checkpoint"])
        forward, calls = model.module.forward, []

        def overflowing(input_ids):  # the second forward (one at a time: in_flight=1): one row's logit overflows
            logits = forward(input_ids)
            calls.append(len(input_ids))
            if len(calls) == 2:
                logits[0, 1] = float("nan")
            return logits

        model.module.forward = overflowing
        try:
            with pytest.raises(RuntimeError, match=r"NaN or inf logits for 1 row\(s\) of batch \d+ \(rows \d+\)"):
                evaluate(model, assets["data"], tokenizer=load_tokenizer(assets["model"]), row_store=store,
                         limit=ROWS, batch_size=8, bootstrap_resamples=0, save_interval=0, in_flight=1)
        finally:
            model.close()
    assert len(calls) == 2
    stored = [read_file(path, "/".join(path.split(os.sep)[-3:-1]), 3)[1] for path in _files(store)]
    assert [len(logits) for logits in stored] == [calls[0]]  # the first batch, whole; none of the second
    assert np.isfinite(stored[0]).all()


def test_a_store_is_verified_and_compacted_reporting_what_it_dropped(assets, tmp_path, capsys):
    """Issue 50: ``python -m dist_eval.rowstore verify|compact DIR``. verify names every file a run
    would skip and why (exit 1); compact keeps the newest copy of each row in one file, removes the
    superseded and untrusted files this user owns, leaves another user's, and says so; a run then
    reads every row from the compacted file, the newest copies."""
    from dist_eval.rowstore.upkeep import main

    store, args = str(tmp_path / "store"), (assets["model"], assets["checkpoint"], assets["data"])
    _run(*args, store)
    [real] = _files(store)
    folder = os.path.dirname(real)
    _poisoned_copy(store, real, "0-newer.rows", 5.0, time.time() + 60)  # supersedes every row of the first
    _poisoned_copy(store, real, "1-nan.rows", float("nan"), time.time())
    cut = _poisoned_copy(store, real, "2-cut.rows", 1.0, time.time())
    os.truncate(cut, os.path.getsize(cut) - 3)
    os.mkfifo(os.path.join(folder, "3-fifo.rows"))
    untrusted = ["1-nan.rows", "2-cut.rows", "3-fifo.rows"]
    if os.geteuid() == 0:  # another user's file: planted by chown, as root only
        os.chown(_poisoned_copy(store, real, "4-theirs.rows", 9.0, time.time()), 4242, 4242)
        untrusted.append("4-theirs.rows")
    done = subprocess.run([sys.executable, "-m", "dist_eval.rowstore", "verify", store], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 1, done
    assert f"2 file(s) trusted, {ROWS} row(s), {ROWS} older cop(ies) superseded; {len(untrusted)} file(s) skipped" \
        in done.stdout, done.stdout
    skipped = sorted(os.path.basename(line.split(":")[0]) for line in done.stdout.splitlines() if "  skipped " in line)
    assert skipped == untrusted, done.stdout
    assert "non-finite logits" in done.stdout and "cut short" in done.stdout, done.stdout

    assert main(["compact", store]) == 0
    said = capsys.readouterr().out
    theirs = 1 if "4-theirs.rows" in untrusted else 0
    assert f"1 file(s) written, {2 + 3} removed ({ROWS} superseded cop(ies) and 3 untrusted file(s) dropped); " \
           f"{theirs} file(s) left" in said, said
    [compacted] = [p for p in _files(store) if "compacted" in p]
    assert sorted(os.listdir(folder)) == sorted(["key.json", os.path.basename(compacted)] + ["4-theirs.rows"] * theirs)
    served = _run(*args, store)
    assert _counts(served) == (ROWS, 0) and np.all(served.predictions.logits == 5.0)  # the newest copies
    assert main(["verify", store]) == theirs  # only another user's file is still skipped


def test_rows_record_their_servers_and_those_of_a_blamed_server_are_never_served(tmp_path, capsys):
    """Issue 49: a swarm's row keeps the servers it came from (under the file's checksum); a server the
    audit blames is named in a .blamed file: its rows pending are not written, those written before
    (this run's or an earlier one's) are served by no later run, and compact drops them, keeping the
    others' servers."""
    from dist_eval.backends.petals.audit import AuditLedger, Taken
    from dist_eval.rowstore import RowSource, read_rows
    from dist_eval.rowstore.upkeep import main

    store = RowStore(str(tmp_path / "store"), {"model": "m"}, {"task": "t"})
    keys = row_keys([f"row {i}" for i in range(6)], None)

    def run(ledger, batches):
        source = RowSource((store.folder, store.key, keys, np.zeros(0, np.int64), False), 0, save_interval=3600)
        for rows, servers in batches:
            source.add(np.array(rows), np.full((len(rows), 3), float(rows[0]), np.float32),
                       None if servers is None else Taken(ledger, frozenset(servers)))
        return source

    first = AuditLedger(share=0.03)
    run(first, [([0, 1], {"a", "b"}), ([2], {"c"}), ([3], None)]).flush()  # nothing blamed: every row written
    [written] = _files(str(tmp_path / "store"))
    assert read_rows(written, store.key, 3)[3] == [("a", "b"), ("a", "b"), ("c",), ()]
    assert len(store.read(3)) == 4
    second = AuditLedger(share=0.03)
    source = run(second, [([4], {"c"}), ([5], {"d"})])
    second.excluded["c"] = {"rows": 1, "difference": 0.5}  # blamed before the flush: its row 4 is not written
    source.flush()
    served = store.read(3)
    assert sorted(served) == sorted(bytes(keys[i]) for i in (0, 1, 3, 5)), "row 2 (c, written before) and 4 not served"
    assert served[bytes(keys[5])][2] == ("d",)
    assert main(["compact", str(tmp_path / "store")]) == 0
    assert "1 row(s) of blamed servers withheld" in capsys.readouterr().out
    [compacted] = _files(str(tmp_path / "store"))
    kept = read_rows(compacted, store.key, 3)
    assert sorted(zip(kept[0], kept[3])) == sorted([(bytes(keys[0]), ("a", "b")), (bytes(keys[1]), ("a", "b")),
                                                    (bytes(keys[3]), ()), (bytes(keys[5]), ("d",))])
