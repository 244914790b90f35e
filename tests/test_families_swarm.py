"""BLOOM and Falcon on a real private Petals swarm, through the CLI on forked ranks: for no
tuning, ptune and deep_ptune, Petals N=2 equals local N=1 bit for bit (fp32), and (ptune) the
predictions are identical for N = 1, 2, 3. One swarm per family (module fixture), in a
layout petals cannot read as it is (BLOOM saved from BloomForCausalLM, Falcon from
FalconModel): the swarm serves the converted copy, the client reads it too. The checkpoints
are read in the forms users hold (dist_eval's file, a petals state dict with the family's
prefix, petals #268's nn.Embedding export + --head). Marked `swarm`."""
import contextlib
import json
import os
from unittest import mock

import pytest
import torch
from conftest import build_checkpoint, converted_family_swarm, read_jsonl, run_ranks, write_csv
from inprocess_cli import run_cli_in_process

pytestmark = [pytest.mark.swarm, pytest.mark.multiproc]

LAYOUT = {"bloom": "causal_lm", "falcon": "base"}
ROWS = 30


@pytest.fixture(scope="module", params=sorted(LAYOUT))
def family_swarm(request, tmp_path_factory):
    family = request.param
    with contextlib.ExitStack() as stack:
        if family == "bloom":  # conftest's, shared with test_backends_zeroshot_swarm.py (the same model)
            model, cache, swarm = request.getfixturevalue("bloom_swarm")
        else:
            model, cache, swarm = stack.enter_context(converted_family_swarm(tmp_path_factory, family, LAYOUT[family]))
        data = write_csv(str(tmp_path_factory.mktemp(f"data-{family}") / "data.csv"), ROWS, seed=3)
        assert swarm.model_dir.startswith(cache)  # served from the converted copy
        assert swarm.dht_prefix == f"dist_eval-tiny-{family}"  # named after the folder given
        # converted copies go to this test's cache (the CLI runs inherit it), not the user's
        with mock.patch.dict(os.environ, {"DIST_EVAL_CACHE": cache}):
            yield family, model, data, swarm


def run(family_swarm, out, checkpoint_args, nproc, backend="petals", peers=True, env=None, zygote=None):
    """The CLI's run: on ``nproc`` ranks forked by conftest's run_ranks (``env``: its environment's
    additions; the ranks' computing is tested here, not torchrun's launch), or with ``nproc=1`` and
    the local backend or the CLI's own swarm in this process (one thread: a torchrun rank's bits)."""
    family, model, data, swarm = family_swarm
    args = ["--model", model, "--data-files", data, *checkpoint_args, "--output-dir", str(out),
            "--batch-size", "8", "--save-logits", "--backend", backend, "--quiet"]
    if backend == "petals" and peers:
        args += ["--initial-peers", *swarm.initial_peers, "--dht-prefix", swarm.dht_prefix]
    elif backend == "petals":
        args += ["--local-servers", "1"]  # the CLI starts (and stops) its own swarm
    if nproc == 1 and (backend == "local" or not peers):  # the CLI's code in this process, one thread
        # its own swarm's servers compute with one thread too, as the module's do (bits)
        with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
            assert run_cli_in_process(args, hide_modules=("matplotlib",)) == 0  # no figure looked at
    else:
        proc = run_ranks(zygote, args, nproc=nproc, timeout=400, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    rows = read_jsonl(out / "predictions.jsonl")
    assert [r["index"] for r in rows] == list(range(ROWS))
    return rows


def petals_state_dict(path, family, tensors):
    """What model.state_dict() of petals' Distributed*ForSequenceClassification holds (trainable part)."""
    prefix = "transformer."
    torch.save({(k if k == "score.weight" else prefix + k): v for k, v in tensors.items()}, path)
    return path


def petals_268_export(ck, folder):
    """petals #268's form of ``ck``'s ptune prompts: torch.save(model.transformer.prompt_embeddings, f),
    the head in a second file (--head)."""
    tensors = torch.load(ck, weights_only=True)["state_dict"]
    prompts = torch.nn.Embedding(*tensors["prompt_embeddings.weight"].shape)
    prompts.weight.data.copy_(tensors["prompt_embeddings.weight"])
    torch.save(prompts, folder / "prompts.pt")
    torch.save({"score.weight": tensors["score.weight"]}, folder / "head.pt")
    return ["--checkpoint", str(folder / "prompts.pt"), "--head", str(folder / "head.pt")]


@pytest.mark.parametrize("tuning_mode", [None, "ptune", "deep_ptune"])
def test_petals_n2_equals_local_n1_bitwise(family_swarm, tmp_path, tuning_mode, no_figures, rank_zygote):
    """Petals N=2 == local N=1, bit for bit. For BLOOM's ptune also the predictions identical for
    N = 1, 2, 3 (merged here from test_predictions_identical_for_n_1_2_3, issue 46, whose N=2 run
    repeated this one's): N=1 on the CLI's own swarm (--local-servers 1), N=2 from petals #268's
    export form, N=3 on the module's swarm, all equal, and equal to the local run. N=1 runs in this
    process (a torchrun launch fewer: ~5 s), no run draws its figures (nobody looks at them: ~2 s a run)."""
    family = family_swarm[0]
    ck = build_checkpoint(str(tmp_path / "ck.pt"), tuning_mode=tuning_mode, pre_seq_len=3)
    petals_args = petals_268_export(ck, tmp_path) if tuning_mode == "ptune" else ["--checkpoint", ck]
    petals = run(family_swarm, tmp_path / "petals2", petals_args, nproc=2, env=no_figures, zygote=rank_zygote)
    if tuning_mode == "deep_ptune":  # the local run reads petals' own state dict form
        tensors = torch.load(ck, weights_only=True)["state_dict"]
        ck = petals_state_dict(str(tmp_path / "petals_sd.pt"), family, tensors)
    local = run(family_swarm, tmp_path / "local1", ["--checkpoint", ck], nproc=1, backend="local")
    assert petals == local  # labels, preds and the float32 logits, every row
    metrics = json.load(open(tmp_path / "petals2" / "metrics.json"))
    assert metrics["run"]["backend"] == "petals" and metrics["run"]["world_size"] == 2
    if tuning_mode == "ptune" and family == "bloom":
        # any N's equality is the batch plan's, not the family's (N = 1, 2 on the Llama swarm too:
        # tests/test_backends_petals.py): checked on one family (issue 46: Falcon's two runs, ~40 s, dropped)
        one = run(family_swarm, tmp_path / "n1", ["--checkpoint", ck], nproc=1, peers=False)  # the CLI's own swarm
        three = run(family_swarm, tmp_path / "n3", ["--checkpoint", ck], nproc=3, env=no_figures, zygote=rank_zygote)
        assert one == petals == three
