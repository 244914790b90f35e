"""Issue 73: every report carries a receipt (metrics.json's run.receipt: dist_eval/receipt.py), and
``python -m dist_eval.verify OUT`` checks a report against it and against its own rows, on real parts:

- the receipt binds the report: the digests of the model files read, the checkpoint, the data file, the
  rows (order-free), predictions.jsonl and the metrics are those of the files, recomputed here;
- an honest report verifies: local N=1 (in-process), and on a local swarm (tiny_swarm) N=1 and N=2, its
  rows evaluated again by ``--backend local`` (its blocks streamed from disk) equal bit for bit, and by
  ``--backend petals`` on a swarm within the tolerance; the streamed local backend equals the in-memory one;
- each of these is caught and named: a prediction edited in predictions.jsonl, a metric edited in
  metrics.json, another checkpoint, another data file, and a swarm uniformly wrong (two servers of
  weights with one block changed: the audit finds them agreeing, verify finds the rows wrong).
"""
import json
import os
import shutil

import pytest
from conftest import build_checkpoint, forking_from, one_thread_swarm, read_jsonl, run_ranks, write_csv
from inprocess_cli import one_thread, run_cli_in_process

from dist_eval import verify
from dist_eval.atomic import file_sha256
from dist_eval.backends.provenance import folder_identity
from dist_eval.receipt import hex_keys, metrics_digest, rows_digest
from dist_eval.verify import chance_to_pass

ROWS = 48


def _run(args) -> None:
    assert run_cli_in_process([*args, "--progress", "none", "--quiet"], hide_modules=("matplotlib",)) == 0


def _verify(out, *flags, capsys):
    with one_thread():
        code = verify.main([str(out), *flags])
    said = capsys.readouterr()
    return code, said.out + said.err


@pytest.fixture(scope="module")
def local_report(tiny_model, tiny_checkpoint, tmp_path_factory):
    """(folder, data file) of an honest --backend local run, N=1, in this process, with logits."""
    root = tmp_path_factory.mktemp("verify-local")
    data = write_csv(str(root / "rows.csv"), ROWS, seed=5)
    out = root / "out"
    _run(["--backend", "local", "--model", tiny_model, "--checkpoint", tiny_checkpoint, "--data-files", data,
          "--batch-size", "4", "--save-logits", "--output-dir", str(out)])
    return out, data


def _verdict(said: str) -> str:
    """The verdict line (the last of the verifier's lines: a library's log may follow on stderr)."""
    return [line for line in said.splitlines() if line.startswith(("dist_eval.verify: VERIFIED",
                                                                    "dist_eval.verify: NOT VERIFIED"))][-1]


def _copy(out, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    return copy


def test_the_receipt_binds_the_report_to_the_files_that_made_it(local_report, tiny_model, tiny_checkpoint):
    out, data = local_report
    metrics = json.load(open(out / "metrics.json"))
    receipt = metrics["run"]["receipt"]
    assert receipt["model"]["files"] == dict(folder_identity(tiny_model)["files"])
    assert receipt["checkpoint"]["sha256"] == file_sha256(tiny_checkpoint)
    assert receipt["data"]["files"] == [{"path": os.path.abspath(data), "sha256": file_sha256(data)}]
    assert receipt["predictions_sha256"] == file_sha256(str(out / "predictions.jsonl"))
    # written once, at the report: the shutdown's rewrite of metrics.json (run.total_seconds) left it valid
    assert "total_seconds" in metrics["run"] and receipt["metrics_sha256"] == metrics_digest(metrics)
    rows = read_jsonl(str(out / "predictions.jsonl"))
    keys, labels = hex_keys([r["key"] for r in rows]), [r["label"] for r in rows]
    assert receipt["data"]["rows_digest"] == rows_digest(keys, labels) == rows_digest(keys[::-1], labels[::-1])
    assert receipt["data"]["rows_digest"] != rows_digest(keys, [(label + 1) % 3 for label in labels])
    assert receipt["settings"]["batch_size"] == 4 and receipt["settings"]["bootstrap_seed"] == 0
    assert receipt["numerics"]["threads"] == 1 and receipt["numerics"]["torch"]
    assert receipt["code"]["dist_eval"] and receipt["promise"]["same_numerics"] == "bit for bit"
    assert receipt["audit"] is None and receipt["servers"] is None


def test_an_honest_local_report_verifies_bit_for_bit(local_report, capsys):
    out, _ = local_report
    code, said = _verify(out, "--backend", "local", "--seed", "3", capsys=capsys)
    assert code == 0, said
    assert f"evaluating {ROWS} of {ROWS} rows again (seed 3)" in said, said  # fewer than --min-rows: all
    assert f"the {ROWS} rows evaluated again agree with the report bit for bit" in said, said
    assert _verdict(said).startswith("dist_eval.verify: VERIFIED"), said
    assert "with chance 0" in said, said  # every row checked: a wrong row cannot pass
    code, said = _verify(out, "--backend", "local", "--in-memory", "--min-rows", "8", capsys=capsys)
    assert code == 0 and "the 8 rows evaluated again agree with the report bit for bit" in said, said


def test_the_streamed_local_backend_equals_the_in_memory_one_bit_for_bit(tiny_model, tmp_path):
    """Issue 73's reference without the model in memory: the blocks stay on disk (on the meta device between
    forwards: nothing of them held), each loaded from the model's own safetensors when the forward reaches it;
    the logits equal the in-memory local backend's bit for bit: ptune and deep_ptune, one file and shards."""
    import torch
    from conftest import split_into_shards

    from dist_eval.backends import load_model

    ids = torch.tensor([[5, 6, 7, 8, 9, 0, 0], [10, 11, 12, 13, 14, 15, 16], [20, 0, 0, 0, 0, 0, 0]])
    shards = split_into_shards(tiny_model, str(tmp_path / "shards"))
    for mode in ("ptune", "deep_ptune"):
        checkpoint = build_checkpoint(str(tmp_path / f"{mode}.pt"), tuning_mode=mode)
        with one_thread(), torch.no_grad():
            whole = load_model("local", tiny_model, checkpoint=checkpoint).module(ids)
            for folder in (tiny_model, shards):
                streamed = load_model("local", folder, checkpoint=checkpoint, stream_blocks=True)
                blocks = dict(streamed.module.hf_model.named_parameters())
                assert blocks["model.layers.1.mlp.up_proj.weight"].device.type == "meta"  # on disk
                assert blocks["model.embed_tokens.weight"].device.type == "cpu"
                assert torch.equal(streamed.module(ids), whole), (mode, folder)
                assert blocks["model.layers.1.mlp.up_proj.weight"].device.type == "meta"  # freed after its forward


def test_a_merge_of_shards_has_a_receipt_and_verifies(local_report, tiny_model, tiny_checkpoint, tmp_path, capsys):
    """Two shards (--shard 0/2, 1/2) merged (dist_eval.shard_merge): the merge's receipt is the shards' model,
    checkpoint and data with the merged rows' digests, and the merged report verifies, its rows evaluated again
    in the whole set's plan equal bit for bit (a shard's batches are the whole set's); each shard's report
    verifies too."""
    from dist_eval import shard_merge

    data = local_report[1]
    shards = [tmp_path / f"shard{i}" for i in range(2)]
    for i, folder in enumerate(shards):
        _run(["--backend", "local", "--model", tiny_model, "--checkpoint", tiny_checkpoint, "--data-files", data,
              "--batch-size", "4", "--save-logits", "--shard", f"{i}/2", "--output-dir", str(folder)])
    merged = tmp_path / "merged"
    assert shard_merge.main([*map(str, shards), "--output-dir", str(merged), "--quiet"]) == 0
    receipt = json.load(open(merged / "metrics.json"))["run"]["receipt"]
    whole = json.load(open(local_report[0] / "metrics.json"))["run"]["receipt"]
    assert receipt["data"]["rows_digest"] == whole["data"]["rows_digest"] and receipt["settings"]["shard"] is None
    assert [s["shard"] for s in receipt["shards"]] == ["0/2", "1/2"], receipt["shards"]
    assert receipt["predictions_sha256"] == whole["predictions_sha256"]  # the merge is the whole run, byte for byte
    code, said = _verify(merged, "--backend", "local", "--min-rows", "12", capsys=capsys)
    assert code == 0 and "the 12 rows evaluated again agree with the report bit for bit" in said, said
    # each shard's own report too: its rows are a part of the set's (rescore refused them: "not one row per index
    # 0..n-1", a DIFFERS line for an honest shard)
    for folder in shards:
        code, said = _verify(folder, "--backend", "local", "--min-rows", "6", capsys=capsys)
        assert code == 0 and "the 6 rows evaluated again agree with the report" in said, said
        assert "ok: every metric and interval recomputed from predictions.jsonl equals the report" in said, said


def test_a_signed_receipt_verifies_with_its_key_and_an_edit_under_it_is_caught(tiny_model, tiny_checkpoint,
                                                                              local_report, tmp_path, capsys):
    """--sign KEY (Ed25519): the receipt carries its signature and public key; verify --key checks both. A metric
    edited with a receipt rewritten to match the edit (its digests recomputed) fails the signature; re-signed with
    another key, --key names the other signer; a key file that is not one is refused in one line before any work."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

    from dist_eval.receipt import signed

    def pem_of(key, name):
        path = tmp_path / name
        path.write_bytes(key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
        return str(path)

    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    out = tmp_path / "signed"
    _run(["--backend", "local", "--model", tiny_model, "--checkpoint", tiny_checkpoint, "--data-files",
          local_report[1], "--batch-size", "4", "--save-logits", "--sign", pem_of(key, "key.pem"), "--output-dir",
          str(out)])
    metrics = json.load(open(out / "metrics.json"))
    assert metrics["run"]["receipt"]["signature"]["public_key"] == public
    code, said = _verify(out, "--key", public, capsys=capsys)
    assert code == 0 and f"signed by the key {public[:16]}... (--key), unchanged since" in said, said
    metrics["accuracy"] += 0.1  # an edit, and a receipt made to match it
    receipt = metrics["run"]["receipt"]
    receipt["metrics_sha256"] = metrics_digest(metrics)
    json.dump(metrics, open(out / "metrics.json", "w"))
    code, said = _verify(out, "--key", public, capsys=capsys)
    assert code == 1 and "signature does not verify with its public key" in said, said
    assert "metrics.json's metrics are those the run wrote" in said, said  # the digest alone was fooled
    metrics["run"]["receipt"] = signed(receipt, pem_of(other, "other.pem"))  # re-signed by someone else
    json.dump(metrics, open(out / "metrics.json", "w"))
    code, said = _verify(out, "--key", public, capsys=capsys)
    assert code == 1 and f"not the expected {public[:16]}" in said, said
    bad = tmp_path / "bad.pem"
    bad.write_text("not a key")
    assert run_cli_in_process(["--backend", "local", "--model", tiny_model, "--data-files", local_report[1],
                               "--sign", str(bad), "--output-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert f"--sign {bad}: expected an unencrypted PEM Ed25519 private key" in err and "openssl genpkey" in err, err


def test_an_edited_prediction_is_caught_and_named(local_report, tmp_path, capsys):
    copy = _copy(local_report[0], tmp_path)
    lines = open(copy / "predictions.jsonl").read().splitlines()
    row = json.loads(lines[0])
    row["pred"] = row["label"] if row["pred"] != row["label"] else (row["label"] + 1) % 3  # right <-> wrong
    lines[0] = json.dumps(row)
    open(copy / "predictions.jsonl", "w").write("\n".join(lines) + "\n")
    code, said = _verify(copy, capsys=capsys)
    assert code == 1, said
    assert "DIFFERS: predictions.jsonl: sha256" in said and "changed after the run" in said, said
    assert "DIFFERS: accuracy: recomputed from predictions.jsonl" in said, said
    assert "DIFFERS: row 0 of predictions.jsonl: pred" in said and "its logits' argmax" in said, said
    assert _verdict(said).startswith("dist_eval.verify: NOT VERIFIED"), said


def test_an_edited_metric_is_caught_and_named(local_report, tmp_path, capsys):
    copy = _copy(local_report[0], tmp_path)
    metrics = json.load(open(copy / "metrics.json"))
    metrics["f1_macro"] += 0.01
    json.dump(metrics, open(copy / "metrics.json", "w"), indent=2)
    code, said = _verify(copy, capsys=capsys)
    assert code == 1, said
    assert "DIFFERS: metrics.json: the metrics' sha256" in said, said
    assert "DIFFERS: f1_macro: recomputed from predictions.jsonl" in said, said
    assert "predictions.jsonl is the file the run wrote" in said, said  # the rows themselves are intact


def test_another_checkpoint_is_caught_by_its_digest_and_its_rows(local_report, tmp_path, capsys):
    other = build_checkpoint(str(tmp_path / "other.pt"), seed=9)
    code, said = _verify(local_report[0], "--checkpoint", other, "--backend", "local", "--min-rows", "8",
                         capsys=capsys)
    assert code == 1, said
    assert f"DIFFERS: --checkpoint {other}: sha256" in said and "another checkpoint" in said, said
    assert "evaluated again: logits differ" in said, said


def test_the_head_file_is_checked_by_its_digest_where_the_receipt_or_head_says(tiny_model, tiny_checkpoint,
                                                                                local_report, tmp_path, capsys):
    """A run given its head apart (--head, petals #268's export: the prompts in --checkpoint): the receipt's
    digest of the head is checked (it was not: a head swapped after the run passed), at the recorded path or
    where --head says it is now, and --backend evaluates with that head."""
    import torch

    tensors = torch.load(tiny_checkpoint, weights_only=True)["state_dict"]
    prompts = torch.nn.Embedding(*tensors["prompt_embeddings.weight"].shape)
    prompts.weight.data.copy_(tensors["prompt_embeddings.weight"])
    torch.save(prompts, tmp_path / "prompts.pt")
    head = tmp_path / "head.pt"
    torch.save({"score.weight": tensors["score.weight"]}, head)
    out = tmp_path / "out"
    _run(["--backend", "local", "--model", tiny_model, "--checkpoint", str(tmp_path / "prompts.pt"), "--head",
          str(head), "--data-files", local_report[1], "--batch-size", "4", "--save-logits", "--output-dir", str(out)])
    code, said = _verify(out, capsys=capsys)
    assert code == 0 and f"ok: --head {head} is the head the run read (sha256)" in said, said
    moved = tmp_path / "moved.pt"
    head.rename(moved)
    torch.save({"score.weight": tensors["score.weight"] * 2}, head)  # another head where the run's was
    code, said = _verify(out, capsys=capsys)
    assert code == 1 and f"DIFFERS: --head {head}: sha256" in said and "another head" in said, said
    code, said = _verify(out, "--head", str(moved), "--backend", "local", "--min-rows", "8", capsys=capsys)
    assert code == 0 and f"ok: --head {moved} is the head the run read" in said, said
    assert "the 8 rows evaluated again agree with the report bit for bit" in said, said


def test_another_data_file_is_caught_by_its_digest_and_its_rows(local_report, tmp_path, capsys):
    other = write_csv(str(tmp_path / "other.csv"), ROWS, seed=6)
    code, said = _verify(local_report[0], "--data-files", other, "--backend", "local", "--min-rows", "8",
                         capsys=capsys)
    assert code == 1, said
    assert f"DIFFERS: --data-files {other}: sha256" in said and "another data file" in said, said
    assert "the data's rows (content keys and labels) are not the report's" in said, said
    shorter = write_csv(str(tmp_path / "shorter.csv"), ROWS // 2, seed=5)  # no row of the report's second half
    code, said = _verify(local_report[0], "--data-files", shorter, "--backend", "local", capsys=capsys)
    assert code == 1 and f"the data holds {ROWS // 2} rows, predictions.jsonl has row {ROWS - 1}" in said, said
    assert "no row evaluated again (none compared)" in _verdict(said), said  # not "(no --backend)"


def test_flags_and_folders_verify_refuses_in_one_line(local_report, tmp_path, capsys):
    code, said = _verify(tmp_path, capsys=capsys)
    assert code == 2 and "missing metrics.json and predictions.jsonl" in said, said
    code, said = _verify(local_report[0], "--backend", "petals", capsys=capsys)
    assert code == 2 and "--initial-peers" in said and "Pass" in said, said
    code, said = _verify(local_report[0], "--share", "0", capsys=capsys)
    assert code == 2 and said.startswith("dist_eval.verify: error: --share 0: expected a share"), said
    code, said = _verify(local_report[0], "--backend", "local", "--seed", "-1", capsys=capsys)
    assert code == 2 and said.startswith("dist_eval.verify: error: --seed -1: expected a seed >= 0"), said
    code, said = _verify(local_report[0], "--key", str(tmp_path), capsys=capsys)  # a folder: no key
    assert code == 2 and said.startswith(f"dist_eval.verify: error: --key {tmp_path}: expected a PEM"), said
    code, said = _verify(local_report[0], "--head", str(local_report[1]), capsys=capsys)  # the run had no head
    assert code == 2 and f"dist_eval.verify: error: --head {local_report[1]}: the run was given no --head" in said, \
        said
    copy = _copy(local_report[0], tmp_path)
    metrics = json.load(open(copy / "metrics.json"))
    del metrics["run"]["receipt"]
    json.dump(metrics, open(copy / "metrics.json", "w"))
    code, said = _verify(copy, capsys=capsys)
    assert code == 2 and "expected a receipt (run.receipt), found none" in said, said


def test_a_damaged_predictions_file_is_a_finding_not_a_traceback(local_report, tmp_path, capsys):
    """A line that is not UTF-8, and lines of JSON that are not rows (the input verify exists to judge): each
    one line that differs, and the verdict NOT VERIFIED, with rows evaluated again too."""
    for damage in (b"\xff\xfe not text\n", b"5\n", b"[1, 2]\n"):
        copy = _copy(local_report[0], tmp_path / str(len(damage)))
        lines = (copy / "predictions.jsonl").read_bytes().splitlines(keepends=True)
        (copy / "predictions.jsonl").write_bytes(damage + b"".join(lines[1:]))
        code, said = _verify(copy, "--backend", "local", "--min-rows", "4", capsys=capsys)
        assert code == 1 and "Traceback" not in said, said
        assert "predictions.jsonl: sha256" in said and _verdict(said).startswith("dist_eval.verify: NOT VERIFIED")


def test_a_report_without_logits_says_its_probability_scores_are_not_checked(tiny_model, tiny_checkpoint,
                                                                             local_report, tmp_path, capsys):
    """Without --save-logits, rescore cannot recompute ECE, Brier, AUROC, top-k accuracy: verify says so in a
    "not checked" line (it said "every metric recomputed"), and an edit of one of them is not called checked."""
    out = tmp_path / "out"
    _run(["--backend", "local", "--model", tiny_model, "--checkpoint", tiny_checkpoint, "--data-files",
          local_report[1], "--batch-size", "4", "--output-dir", str(out)])
    code, said = _verify(out, capsys=capsys)
    assert code == 0, said
    assert "not checked: ece, brier, top2_accuracy, auroc_macro, reliability and their intervals (predictions.jsonl " \
        "has no logits: --save-logits at the run)" in said, said
    assert "ok: every other metric and interval recomputed from predictions.jsonl equals the report" in said, said


def test_bit_for_bit_is_promised_only_where_the_verifier_computes_as_the_run_did(local_report):
    """A CPU run verified on another device (--device cuda) is compared within the tolerance: its numerics are the
    verifier's own, not the recorded run's (before, the run's device was taken for the verifier's, and an honest
    report was held to the run's bits)."""
    from dist_eval.verify import same_numerics

    receipt = json.load(open(local_report[0] / "metrics.json"))["run"]["receipt"]
    assert same_numerics(receipt, "local", "cpu")
    assert not same_numerics(receipt, "local", "cuda") and not same_numerics(receipt, "petals", "cpu")


def test_a_swarm_rows_last_bits_are_taken_within_the_tolerance_a_local_runs_are_not():
    """A swarm's servers may compute on GPUs or other threads (not in the receipt): a row that differs from the
    report in its last bits alone is said and taken within the tolerance; one beyond it differs; a local run's
    row that differs in its last bits differs (its numerics are the verifier's)."""
    import numpy as np

    from dist_eval.verify import LAST_BITS, judge_row

    logits = np.array([0.25, -1.5, 3.0], dtype=np.float32)
    reported = {"logits": logits.tolist(), "pred": 2, "loss": 0.0}
    last_bits = np.nextafter(logits, np.float32(10))
    assert judge_row(reported, logits, 0.0, (True, 1e-4, True)) is None
    assert judge_row(reported, last_bits, 0.0, (True, 1e-4, True)) == LAST_BITS
    assert "bit for bit" in judge_row(reported, last_bits, 0.0, (True, 1e-4, False))
    assert "differ from the report" in judge_row(reported, logits + 0.01, 0.0, (True, 1e-4, True))
    assert judge_row(reported, last_bits, 0.0, (False, 1e-4, False)) is None


def test_the_chance_that_a_share_misses_every_wrong_row():
    assert chance_to_pass(40, 10) == pytest.approx(30 / 40)  # one wrong row of 40
    assert chance_to_pass(100, 100) == 0.0
    assert chance_to_pass(100_000, 300) == pytest.approx(0.99 ** 300, rel=0.02)


def test_dist_eval_verify_runs_the_verifier(local_report, monkeypatch, capsys):
    """``dist-eval verify OUT`` (the console script's subcommand) hands its arguments to ``python -m
    dist_eval.verify`` in its own process (os.execv, caught here and run in this process)."""
    from dist_eval import launcher

    calls = []
    monkeypatch.setattr(os, "execv", lambda path, argv: calls.append(argv))
    launcher.main(["verify", str(local_report[0]), "--min-rows", "5"])
    assert calls and calls[0][1:3] == ["-m", "dist_eval.verify"], calls
    code, said = _verify(*calls[0][3:], capsys=capsys)
    assert code == 0 and "dist_eval.verify: VERIFIED" in said and "no row evaluated again" in said, said


# ------------------------------------------------------------------------ on a local swarm

def _swarm_args(model, checkpoint, data, swarm, out, *extra):
    return ["--model", model, "--checkpoint", checkpoint, "--data-files", data, "--initial-peers",
            *swarm.initial_peers, "--dht-prefix", swarm.dht_prefix, "--batch-size", "4", "--output-dir", str(out),
            "--progress", "none", "--quiet", *extra]


@pytest.mark.swarm
@pytest.mark.multiproc
def test_an_honest_swarm_report_verifies_n1_and_n2(tiny_model, tiny_checkpoint, tiny_swarm, rank_zygote, tmp_path,
                                                    capsys):
    data = write_csv(str(tmp_path / "rows.csv"), 24, seed=8)
    one, two = tmp_path / "n1", tmp_path / "n2"
    assert run_cli_in_process(_swarm_args(tiny_model, tiny_checkpoint, data, tiny_swarm, one, "--save-logits"),
                              hide_modules=("matplotlib",)) == 0
    proc = run_ranks(rank_zygote, _swarm_args(tiny_model, tiny_checkpoint, data, tiny_swarm, two), nproc=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for out in (one, two):
        receipt = json.load(open(out / "metrics.json"))["run"]["receipt"]
        assert receipt["backend"] == "petals" and receipt["servers"], receipt
        code, said = _verify(out, "--backend", "local", capsys=capsys)
        assert code == 0, said
        assert "the 24 rows evaluated again agree with the report bit for bit" in said, said
    # the rows again on a swarm (here the same one): its servers' numerics are not the verifier's to know, so
    # within the receipt's tolerance
    code, said = _verify(one, "--backend", "petals", "--initial-peers", *tiny_swarm.initial_peers, "--dht-prefix",
                         tiny_swarm.dht_prefix, "--min-rows", "6", capsys=capsys)
    assert code == 0, said
    assert "the 6 rows evaluated again agree with the report within the tolerance" in said, said


@pytest.fixture(scope="module")
def wrong_model(tiny_model, tmp_path_factory):
    """A copy of the tiny Llama with one block's MLP changed (every other file the same bytes)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("wrong-model")
    for name in os.listdir(tiny_model):
        shutil.copy(os.path.join(tiny_model, name), folder / name)
    (weights,) = [name for name in os.listdir(folder) if name.endswith(".safetensors")]
    tensors = load_file(str(folder / weights))
    tensors["model.layers.2.mlp.down_proj.weight"] = tensors["model.layers.2.mlp.down_proj.weight"] * 1.5
    save_file(tensors, str(folder / weights), metadata={"format": "pt"})
    return str(folder)


@pytest.mark.swarm
def test_a_swarm_uniformly_wrong_passes_the_audit_and_fails_verify(tiny_model, tiny_checkpoint, wrong_model,
                                                                   tiny_swarm, tmp_path, capsys):
    """Two servers, both started from the weights with block 2 changed: every replay of the audit agrees (the
    servers agree with each other), the client's model folder is the honest one, and verify --backend local
    evaluates the drawn rows with the honest weights: they differ, named row by row. (The two servers forked
    from tiny_swarm's fork server: conftest.forking_from, their imports once.)"""
    data = write_csv(str(tmp_path / "rows.csv"), 24, seed=8)
    out = tmp_path / "out"
    wrong = one_thread_swarm(wrong_model, num_servers=2, dht_prefix="wrong-swarm")
    try:
        with forking_from(tiny_swarm):
            swarm = next(wrong)
        assert run_cli_in_process(_swarm_args(tiny_model, tiny_checkpoint, data, swarm, out, "--audit", "1"),
                                  hide_modules=("matplotlib",)) == 0
    finally:
        wrong.close()  # the swarm stopped
    receipt = json.load(open(out / "metrics.json"))["run"]["receipt"]
    audit = receipt["audit"]
    assert audit["share"] == 1 and audit["replayed"] + audit["row_checks"] >= 1, audit
    assert audit["mismatches"] == 0 and not audit["excluded"], audit  # the audit passed
    code, said = _verify(out, capsys=capsys)
    assert code == 0, said  # the report is what the swarm computed: its files and metrics agree
    code, said = _verify(out, "--backend", "local", "--min-rows", "8", capsys=capsys)
    assert code == 1, said
    assert said.count("evaluated again: logits differ") >= 1 or "evaluated again: loss" in said, said
    assert _verdict(said).startswith("dist_eval.verify: NOT VERIFIED"), said
