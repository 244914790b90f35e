"""A rank killed mid-run, then the same command again: only the rows without a stored
result are evaluated again, and the final report equals an uninterrupted run's. Real
multi-rank jobs (gloo, the local backend; ranks forked by conftest's run_ranks, which stops the
others when one dies, as torchrun does: what a kill leaves, not the launch, is tested here), a
real SIGKILL. The uninterrupted references run in this process (one rank: a run's results are
the same bits for any N); one interrupted job serves both tests that start from one (each
resumes its own copy). No run here draws figures (matplotlib hidden): none is looked at."""
import glob
import json
import os
import shutil
import signal
import threading
import time

import pytest
from conftest import REPO, all_pids, read_jsonl, run_ranks, start_ranks, stop_group, write_csv
from inprocess_cli import run_cli_in_process, without_modules

pytestmark = pytest.mark.multiproc
NUM_ROWS = 1000
NO_FIGURES = ("matplotlib",)  # run_cli_in_process's hide_modules


def no_figures_env(folder) -> dict:
    """run_cli's env for a launched run without matplotlib (hidden under ``folder``)."""
    hidden = without_modules(folder, "matplotlib")
    return {"PYTHONPATH": os.pathsep.join(p for p in (hidden, REPO, os.environ.get("PYTHONPATH")) if p)}


@pytest.fixture(scope="module")
def job(tiny_model, tiny_checkpoint, tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    data = write_csv(str(base / "data.csv"), NUM_ROWS, seed=21)
    args = ["--model", tiny_model, "--data-files", data, "--checkpoint", tiny_checkpoint, "--backend", "local",
            "--batch-size", "1", "--in-flight", "1", "--save-logits", "--quiet", "--save-interval", "0",
            "--bootstrap-resamples", "50"]
    reference = base / "reference"
    assert run_cli_in_process([*uninterrupted(args), "--output-dir", str(reference)], hide_modules=NO_FIGURES) == 0
    return base, args, reference


def uninterrupted(args) -> list:
    """``args`` for an uninterrupted reference: its partial results saved at the default interval, not after
    every batch (a thousand fsynced files nobody resumes from; the interval changes no result)."""
    at = args.index("--save-interval")
    return args[:at] + args[at + 2:]


@pytest.fixture(scope="module")
def interrupted(job, rank_zygote):
    """One 2-rank job, rank 1 SIGKILLed once it stored some batches: its output folder (partial
    results only). Tests resume copies of it."""
    base, args, _ = job
    out = base / "interrupted_once"
    code, err = _interrupted_run(rank_zygote, args, out)
    assert code != 0
    assert not (out / "metrics.json").exists() and not (out / "predictions.jsonl").exists()
    stored = glob.glob(str(out / "partial" / "*" / "*.npz"))
    assert stored and not glob.glob(str(out / "partial" / "*" / "*.tmp"))
    return out


def _copy_of(interrupted, out):
    shutil.copytree(interrupted, out)
    return out


def _rank_pid(torchrun_pid: int, rank: int):
    """pid of the worker with RANK=rank among torchrun's children."""
    for pid in all_pids():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().decode().rpartition(")")[2].split()[1])
            if ppid != torchrun_pid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return pid
        except (OSError, ValueError):
            continue
    return None


def _interrupted_run(zygote, args, out, kill_after_files: int = 20, stored: str = "*/rank1-*.npz"):
    """Start a 2-rank job, SIGKILL rank 1 once it stored some batches (files matching ``stored``
    under the partial results); return the job's exit code and its stderr."""
    proc, stdout, stderr = start_ranks(zygote, [*args, "--output-dir", str(out)], nproc=2)
    said = {stdout: [], stderr: []}
    readers = [threading.Thread(target=lambda s=s: said[s].extend(s), daemon=True) for s in (stdout, stderr)]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if len(glob.glob(str(out / "partial" / stored))) >= kill_after_files:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the job ended before it could be interrupted; make it longer"
        victim = proc.pids[1] if proc.pids is not None else _rank_pid(proc.pid, 1)  # forked, or torchrun's
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        stop_group(proc.pid)
        for reader in readers:
            reader.join(timeout=10)
        stdout.close()
        stderr.close()
    return proc.returncode, "".join(said[stderr])


def test_killed_rank_then_resume_equals_uninterrupted_run(job, interrupted, rank_zygote):
    base, args, reference = job
    out = _copy_of(interrupted, base / "interrupted")  # the kill's checks: in the fixture

    # the same command again, on 3 ranks this time: the batch plan does not depend on N; with
    # --slice-by (it changes no result, so the stored batches serve: slices of the resumed run)
    proc = run_ranks(rank_zygote, [*args, "--output-dir", str(out), "--slice-by"], nproc=3,
                     env=no_figures_env(base / "hidden1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.load(open(out / "metrics.json"))
    resumed = metrics["run"]["resumed_samples"]
    assert 0 < resumed < NUM_ROWS  # only the rows without a stored result ran again
    predictions = read_jsonl(out / "predictions.jsonl")
    assert [{k: v for k, v in row.items() if k != "slice"} for row in predictions] == read_jsonl(
        reference / "predictions.jsonl")  # logits included
    ref = json.load(open(reference / "metrics.json"))
    assert {k: v for k, v in metrics.items() if k not in ("run", "slices")} == {k: v for k, v in ref.items()
                                                                                if k != "run"}
    assert not (out / "partial").exists()  # served its purpose, removed
    from dist_eval import rescore  # the slices of the resumed rows: those the rows give

    assert sum(s["num_samples"] for s in metrics["slices"]["by"]["token_length_quartile"].values()) == NUM_ROWS
    assert rescore.main([str(out)]) == 0


def test_a_run_that_stops_early_resumes_its_sequence_exactly(job, rank_zygote):
    """--stop-at-width: rank 1 killed in the third round; the same command again on 3 ranks
    reads the finished rounds back and stops on the same round, rows and numbers."""
    base, args, _ = job
    stopping = [*args, "--stop-at-width", "0.12", "--stop-round-rows", "100"]
    reference = base / "stopping_reference"
    assert run_cli_in_process([*uninterrupted(stopping), "--output-dir", str(reference)],
                              hide_modules=NO_FIGURES) == 0  # one rank: the same rounds
    ref = json.load(open(reference / "metrics.json"))
    assert ref["stopping"]["reason"] == "width" and ref["stopping"]["rounds"] > 3  # the kill lands mid-run

    out = base / "stopping_interrupted"
    code, _ = _interrupted_run(rank_zygote, stopping, out, kill_after_files=5, stored="*/round-000003/rank1-*.npz")
    assert code != 0 and not (out / "metrics.json").exists()
    proc = run_ranks(rank_zygote, [*stopping, "--output-dir", str(out)], nproc=3, env=no_figures_env(base / "hidden2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.load(open(out / "metrics.json"))
    assert metrics["run"]["resumed_samples"] >= 200  # two whole rounds and part of the third read back
    timing = ("seconds", "seconds_saved_estimate")
    assert {k: v for k, v in metrics["stopping"].items() if k not in timing} == \
        {k: v for k, v in ref["stopping"].items() if k not in timing}
    assert read_jsonl(out / "predictions.jsonl") == read_jsonl(reference / "predictions.jsonl")
    assert {k: v for k, v in metrics.items() if k not in ("run", "stopping")} == \
        {k: v for k, v in ref.items() if k not in ("run", "stopping")}
    assert not (out / "partial").exists()


def test_other_settings_never_mix_in_stored_results(job, interrupted, capfd):
    """The interrupted job's partial results, then a run with another batch plan (in this
    process: what is checked is the stored results' fate, not the launch)."""
    base, args, reference = job
    out = _copy_of(interrupted, base / "changed")
    assert glob.glob(str(out / "partial" / "*" / "*.npz"))
    changed = list(args)
    changed[changed.index("--batch-size") + 1] = "3"  # another batch plan: stored batches do not apply
    capfd.readouterr()
    code = run_cli_in_process([*changed, "--output-dir", str(out)], hide_modules=NO_FIGURES)
    printed = "".join(capfd.readouterr())
    assert code == 0, printed[-3000:]
    assert ("removing stored partial results (made by another model, checkpoint, data or settings, or by other code "
            "or libraries)") in printed
    metrics = json.load(open(out / "metrics.json"))
    assert metrics["run"]["resumed_samples"] == 0
    ref_preds = [r["pred"] for r in read_jsonl(reference / "predictions.jsonl")]
    assert [r["pred"] for r in read_jsonl(out / "predictions.jsonl")] == ref_preds


def test_the_device_kind_is_in_the_run_key(tmp_path):
    """Partial results computed on a GPU never mix with CPU ones (other float roundings)."""
    import types

    import torch

    from dist_eval.config import Settings
    from dist_eval.resume import run_key

    (tmp_path / "config.json").write_text("{}")
    dataset = type("D", (), {"_fingerprint": "f", "column_names": ["text", "label"], "__len__": lambda self: 3})()

    def model(device):
        module = torch.nn.Linear(2, 2, device="meta" if device == "meta" else "cpu")
        return types.SimpleNamespace(backend="local", num_labels=3, prompt_tokens=0, module=module)

    key = run_key(str(tmp_path), None, dataset, None, model("cpu"), Settings())
    assert key == run_key(str(tmp_path), None, dataset, None, types.SimpleNamespace(
        backend="local", num_labels=3, prompt_tokens=0), Settings())  # no weights: the CPU
    assert key != run_key(str(tmp_path), None, dataset, None, model("meta"), Settings())


def test_the_installed_libraries_versions_are_in_the_run_key(tmp_path, monkeypatch):
    """Partial results computed under another torch, transformers, tokenizers, ... (the row store's
    KEYED_LIBRARIES) never mix in: a library installed or upgraded after the interruption (another version's
    metadata first on the path, as a new install puts it) changes the key; not the shards' key, whose merge
    compares the versions itself."""
    import types

    from dist_eval.config import Settings
    from dist_eval.resume import run_key

    (tmp_path / "config.json").write_text("{}")
    dataset = type("D", (), {"_fingerprint": "f", "column_names": ["text", "label"], "__len__": lambda self: 3})()
    model = types.SimpleNamespace(backend="local", num_labels=3, prompt_tokens=0)
    key = run_key(str(tmp_path), None, dataset, None, model, Settings())
    assert key == run_key(str(tmp_path), None, dataset, None, model, Settings())
    shards_key = run_key(str(tmp_path), None, dataset, None, model, Settings(), libraries=False)
    info = tmp_path / "site" / "sentencepiece-99.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sentencepiece\nVersion: 99.0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert key != run_key(str(tmp_path), None, dataset, None, model, Settings())
    # the shards' merge names the package itself (shard_merge.check_versions), not "another run key"
    assert shards_key == run_key(str(tmp_path), None, dataset, None, model, Settings(), libraries=False)


def test_unreadable_planted_or_non_finite_partial_files_are_skipped_with_one_warning(tiny_model, tiny_checkpoint,
                                                                                     tmp_path, capfd):
    """Issue 50. Before: a 0-byte .npz (what a crash left, writes were not fsynced) failed every
    resume with an internal error naming no file, and a FIFO named *.npz blocked the resume. Now
    such files, and one of non-finite logits, are skipped with one warning naming the first; their
    batches are evaluated again and the results are the uninterrupted run's, bit for bit."""
    import numpy as np
    from float_promises import assert_same_bits

    from dist_eval import evaluate
    from dist_eval.backends import load_model
    from dist_eval.backends.tokenizer import load_tokenizer
    from dist_eval.data.load import load_split

    data = load_split([write_csv(str(tmp_path / "data.csv"), 40, seed=3)], None)
    folder = tmp_path / "partial"

    def run():
        model = load_model("local", tiny_model, checkpoint=tiny_checkpoint)
        try:
            return evaluate(model, data, tokenizer=load_tokenizer(tiny_model), resume_folder=str(folder),
                            save_interval=0, batch_size=8, row_store="off", bootstrap_resamples=0, return_logits=True)
        finally:
            model.close()

    first = run()
    files = sorted(glob.glob(str(folder / "*.npz")))
    assert len(files) == 5
    with np.load(files[0]) as f:
        arrays = {name: f[name] for name in f.files}
    os.unlink(files[0])  # its batch is poisoned below, and evaluated again
    np.savez(str(folder / "rank0-1-000000.npz"), **{**arrays, "logits": np.full_like(arrays["logits"], np.nan)})
    open(folder / "rank0-2-000000.npz", "wb").close()  # what a crash leaves
    os.mkfifo(folder / "rank0-3-000000.npz")
    capfd.readouterr()
    again = run()
    warnings = [line for line in capfd.readouterr().err.splitlines() if "resume" in line]
    assert len(warnings) == 1 and "skipped 3 file(s)" in warnings[0] and "rank0-1-000000.npz" in warnings[0], warnings
    assert again.metrics["run"]["resumed_samples"] == 40 - len(arrays["rows"])
    assert_same_bits(again.predictions.logits, first.predictions.logits, "a resumed run with skipped files")
