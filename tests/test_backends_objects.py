"""dist_eval.backends.objects: ``evaluate`` on the model object a training loop holds.

A transformers ``*ForSequenceClassification`` of each family, and petals'
``Distributed*ForSequenceClassification`` with trained prompts and head on a real private
swarm (marked `swarm`), give the same metrics and logits, bit for bit, as ``load_model``
on the same weights (the folder + a checkpoint of the same prompts/head); the object
comes back in the mode it was in; objects that cannot classify are refused in one line.
N=2 (gloo, the object inside DistributedDataParallel) equals N=1 (marked `multiproc`)."""
import json
import os
import sys
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import build_tiny_model, forking_from, run_ranks, write_csv
from float_promises import assert_same_bits
from inprocess_cli import one_thread

from dist_eval import evaluate, load_model
from dist_eval.backends.blocks import family_class
from dist_eval.backends.checkpoint import save_checkpoint
from dist_eval.backends.families import FAMILIES
from dist_eval.backends.objects import evaluation_model
from dist_eval.errors import UsageError

HIDDEN, LAYERS, LABELS = 32, 4, 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("object_models")
    return {f: build_tiny_model(str(root / f), family=f, layout="seq_cls") for f in FAMILIES}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    import datasets

    csv = write_csv(str(tmp_path_factory.mktemp("object_data") / "data.csv"), 23, seed=5)
    return datasets.load_dataset("csv", data_files=csv, split="train")


def trained(mode=None, pre_seq_len=0, seed=7):
    """Prompts and head as a training loop leaves them (short names, any family)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {"score.weight": torch.randn(LABELS, HIDDEN, generator=g)}
    if mode:
        tensors["prompt_embeddings.weight"] = torch.randn(pre_seq_len, HIDDEN, generator=g)
    if mode == "deep_ptune":
        tensors["intermediate_prompt_embeddings.weight"] = 0.1 * torch.randn(pre_seq_len, LAYERS * HIDDEN, generator=g)
    return tensors


def set_trained(model, family, tensors):
    spec = FAMILIES[family]
    with torch.no_grad():
        spec.get(model, spec.head).weight.copy_(tensors["score.weight"])
        if "prompt_embeddings.weight" in tensors:
            spec.get(model, spec.prompts).weight.copy_(tensors["prompt_embeddings.weight"])
        if "intermediate_prompt_embeddings.weight" in tensors:
            spec.get(model, spec.deep_prompts).weight.copy_(tensors["intermediate_prompt_embeddings.weight"])


def run(model, data, tokenizer):
    """(metrics without the run's timings, logits) of evaluate, with one thread (the servers' summation order)."""
    with one_thread():
        result = evaluate(model, data, tokenizer=tokenizer, batch_size=8, return_logits=True, bootstrap_resamples=50)
    assert result.predictions.indices.tolist() == list(range(len(data)))
    return {k: v for k, v in result.metrics.items() if k != "run"}, result.predictions.logits


def modes(model):
    return [m.training for m in model.modules()]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_object_equals_load_model_bitwise(folders, dataset, tmp_path, family):
    from dist_eval import load_tokenizer

    folder = folders[family]
    # dist_eval's reading of the folder's tokenizer: transformers 5.x's AutoTokenizer reads config.json too, with its
    # own class of a vision-language family (kimi_k25), which this flat text-model folder is not
    tokenizer = load_tokenizer(folder)
    tensors = trained()
    save_checkpoint(str(tmp_path / "ck.pt"), None, tensors)
    reference = run(load_model("local", folder, checkpoint=str(tmp_path / "ck.pt")), dataset, tokenizer)

    model = family_class(FAMILIES[family].local_class, in_petals=False).from_pretrained(folder)
    set_trained(model, family, tensors)
    model.train()  # right after an epoch; one part frozen in eval mode by the loop
    FAMILIES[family].get(model, FAMILIES[family].embeddings).eval()
    before = modes(model)
    got = run(model, dataset, tokenizer)
    assert modes(model) == before  # every module's own flag back
    assert_same_bits(got, reference, f"{family}: every metric and the logits, the object against load_model")
    assert_same_bits(run(model, dataset, tokenizer)[0]["accuracy"], got[0]["accuracy"],
                     "the accuracy again (eval mode: no dropout draw)")
    assert not any(p.grad is not None for p in model.parameters())


def test_another_architectures_classifier_is_called_as_it_is(dataset, folders):
    from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=62, n_positions=64, n_embd=16, n_layer=1, n_head=2, num_labels=LABELS,
                        pad_token_id=0, resid_pdrop=0.5)
    model = GPT2ForSequenceClassification(config).train()
    metrics, logits = run(model, dataset, AutoTokenizer.from_pretrained(folders["llama"]))
    assert model.training and logits.shape == (len(dataset), LABELS)
    assert_same_bits(run(model, dataset, AutoTokenizer.from_pretrained(folders["llama"]))[1], logits,
                     "the logits again (eval mode: no dropout draw)")


def refusal(model, dataset, folders):
    from transformers import AutoTokenizer

    with pytest.raises(UsageError) as caught:
        evaluate(model, dataset, tokenizer=AutoTokenizer.from_pretrained(folders["llama"]))
    message = str(caught.value)
    assert "\n" not in message and caught.value.param == "model"
    return message


def test_causal_lm_is_refused_in_one_line(folders, dataset):
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(folders["llama"]).train()
    message = refusal(model, dataset, folders)
    assert message.startswith("model=<LlamaForCausalLM>: not a sequence classifier")
    assert "DistributedLlamaForSequenceClassification" in message and "LlamaForSequenceClassification" in message
    assert "load_model" in message and model.training


def test_unusable_head_and_missing_pad_token_are_refused(folders, dataset):
    import transformers

    model = transformers.BloomForSequenceClassification.from_pretrained(folders["bloom"])
    model.score = torch.nn.Identity()
    assert refusal(model, dataset, folders).startswith("model=<BloomForSequenceClassification>: no usable classifier "
                                                       "head ('score': Identity)")
    model = transformers.FalconForSequenceClassification.from_pretrained(folders["falcon"])
    model.config.pad_token_id = None
    assert "model.config.pad_token_id = tokenizer.pad_token_id" in refusal(model, dataset, folders)
    other = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2))
    assert "a petals Distributed*ForSequenceClassification" in refusal(other, dataset, folders)


# ---- petals objects on a real private swarm --------------------------------------------------

SWARM_FAMILIES = {"llama": "causal_lm", "bloom": "base"}  # layouts petals' client reads as they are


@pytest.fixture(scope="module")
def swarm(request, tmp_path_factory):
    from dist_eval.swarm import LocalSwarm

    family = request.param
    if family == "llama":  # the tiny Llama of this layout is conftest's tiny_model: its swarm serves (issue 46)
        tiny_swarm = request.getfixturevalue("tiny_swarm")
        assert tiny_swarm.model_dir == request.getfixturevalue("tiny_model")
        yield family, tiny_swarm
        return
    root = tmp_path_factory.mktemp(f"object-swarm-{family}")
    folder = build_tiny_model(str(root / f"tiny-{family}"), family=family, layout=SWARM_FAMILIES[family])
    swarm = LocalSwarm(folder, num_servers=1, dht_prefix=f"objects-{family}")
    try:  # its server forked from tiny_swarm's fork server (conftest.forking_from: its imports once)
        with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}), \
                forking_from(request.getfixturevalue("tiny_swarm")):  # one thread: the client's summation order
            swarm.start()
        assert swarm.model_dir == folder
        yield family, swarm
    finally:
        swarm.stop()


def petals_object(family, swarm, mode, pre_seq_len):
    """The family's class for Llama; petals' Auto class (which builds the family's) for the others."""
    from dist_eval.backends.petals.shims import import_petals

    import_petals()
    import petals
    from petals.utils.auto_config import AutoDistributedModelForSequenceClassification

    cls = getattr(petals, FAMILIES[family].petals_class) if family == "llama" else \
        AutoDistributedModelForSequenceClassification
    return cls.from_pretrained(
        swarm.model_dir, initial_peers=swarm.initial_peers, dht_prefix=swarm.dht_prefix, num_labels=LABELS,
        tuning_mode=mode, pre_seq_len=pre_seq_len, torch_dtype=torch.float32,
    )


@pytest.mark.swarm
@pytest.mark.parametrize("swarm, mode", [("bloom", "ptune"), ("llama", "ptune"), ("llama", "deep_ptune")],
                         indirect=["swarm"])  # one swarm per family; one mode for the extra family
def test_petals_object_equals_load_model_bitwise(swarm, dataset, tmp_path, mode):
    from transformers import AutoTokenizer

    from dist_eval.backends.petals.helpers import shutdown_petals_client

    family, swarm = swarm
    tokenizer = AutoTokenizer.from_pretrained(swarm.model_dir)
    tensors = trained(mode, pre_seq_len=3)
    checkpoint = str(tmp_path / "ck.pt")
    save_checkpoint(checkpoint, mode, tensors)
    local = run(load_model("local", swarm.model_dir, checkpoint=checkpoint), dataset, tokenizer)
    loaded = load_model("petals", swarm.model_dir, checkpoint=checkpoint, initial_peers=swarm.initial_peers,
                        dht_prefix=swarm.dht_prefix)
    try:
        via_load_model = run(loaded, dataset, tokenizer)
    finally:
        loaded.close()

    model = petals_object(family, swarm, mode, 3)
    assert type(model).__name__ == FAMILIES[family].petals_class
    blocks = FAMILIES[family].get(model, FAMILIES[family].blocks)
    try:
        set_trained(model, family, tensors)
        model.train()
        with evaluation_model(model) as adapted:  # what evaluate computes with
            assert (adapted.backend, adapted.prompt_tokens, adapted.num_labels) == ("petals", 3, LABELS)
            assert not model.training and "forward" in vars(blocks)  # bounded by --swarm-timeout meanwhile
        got = run(model, dataset, tokenizer)
        assert model.training and all(modes(model))  # back in train mode
        assert "forward" not in vars(blocks)  # the adapter's bounded forward is gone
        assert_same_bits(got, via_load_model, f"{family} {mode}: petals' object against load_model")
        assert_same_bits(got, local, f"{family} {mode}: petals' object against the local backend")
        ids = tokenizer(["w1 w2 w3"], return_tensors="pt")["input_ids"]
        with torch.no_grad():  # the caller's client still works
            assert model.eval()(input_ids=ids).logits.shape == (1, LABELS)
    finally:
        shutdown_petals_client(blocks.sequence_manager)


# ---- N=2 under gloo, the object inside DistributedDataParallel ---------------------------------

WORKER = r"""
import json, os, sys
import numpy as np, torch, torch.distributed as dist, datasets, transformers
from dist_eval import evaluate
folder, csv, out = sys.argv[1:4]
if "RANK" in os.environ:
    dist.init_process_group("gloo")
model = transformers.BloomForSequenceClassification.from_pretrained(folder).train()
if dist.is_initialized():
    model = torch.nn.parallel.DistributedDataParallel(model)
tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
data = datasets.load_dataset("csv", data_files=csv, split="train")
result = evaluate(model, data, tokenizer=tokenizer, batch_size=4, return_logits=True, bootstrap_resamples=50)
assert model.training
if not dist.is_initialized() or dist.get_rank() == 0:
    np.save(os.path.join(out, "logits.npy"), result.predictions.logits)
    metrics = {k: v for k, v in result.metrics.items() if k != "run"}
    facts = {"metrics": metrics, "world": result.metrics["run"]["world_size"]}
    json.dump(facts, open(os.path.join(out, "m.json"), "w"))
if dist.is_initialized():
    # the group must end here, its gloo threads joined: one left to the interpreter's teardown (held by
    # DistributedDataParallel, or by torch.distributed.nn's defaults when DDP imports it after the group's
    # init: dist_eval imports it first, see dist_eval.ranks.group) aborts the rank at exit, now and then
    del model
    import gc; gc.collect()
    dist.destroy_process_group()
    tasks = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    assert not [t for t in tasks if "gloo" in t], f"the gloo group outlived destroy_process_group: {tasks}"
"""


@pytest.mark.multiproc
def test_object_under_gloo_n2_equals_n1(folders, tmp_path, rank_zygote):
    """The worker script on 2 ranks in a gloo group (forked: conftest's run_ranks; what the object
    computes is tested, not the launch); N=1 is the same script run in this process (no process
    group; one thread, as a launched rank computes: the same bits)."""
    csv = write_csv(str(tmp_path / "data.csv"), 13, seed=2)
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    outs = {}
    for world in (1, 2):
        out = tmp_path / f"n{world}"
        out.mkdir()
        argv = [str(worker), folders["bloom"], csv, str(out)]
        if world == 1:
            assert "RANK" not in os.environ and not torch.distributed.is_initialized()
            with one_thread(), mock.patch.object(sys, "argv", argv):
                exec(compile(WORKER, str(worker), "exec"), {"__name__": "__main__"})
        else:
            proc = run_ranks(rank_zygote, argv[1:], nproc=2, script=argv[0])
            assert proc.returncode == 0, proc.stderr[-3000:]
        outs[world] = json.load(open(out / "m.json")), np.load(out / "logits.npy")
    assert outs[2][0]["world"] == 2
    assert_same_bits(outs[2][0]["metrics"], outs[1][0]["metrics"], "every metric, N=2 against 1")
    assert_same_bits(outs[2][1], outs[1][1], "the logits, N=2 against 1")


LEFT_ALONE = ("HF_HUB_OFFLINE", "HF_DATASETS_DISABLE_PROGRESS_BARS", "DATASETS_VERBOSITY", "TOKENIZERS_PARALLELISM",
              "BITSANDBYTES_NOWELCOME")


@pytest.mark.swarm
def test_evaluate_on_a_petals_object_leaves_the_callers_process_as_found(tiny_swarm, dataset, monkeypatch):
    """A training process that evaluates a petals model keeps its environment, and datasets and
    transformers behave as before (before: HF_HUB_OFFLINE=1 stayed set, and no hub download worked)."""
    import datasets
    import transformers
    from transformers import AutoTokenizer

    from dist_eval.backends.petals import helpers, shims

    for name in LEFT_ALONE:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(shims, "_quieted", False)  # as in a process that never imported petals through dist_eval
    before, bars = dict(os.environ), datasets.is_progress_bar_enabled()
    verbosity = transformers.logging.get_verbosity()
    petals = shims.import_petals()
    assert dict(os.environ) == before, {k: os.environ.get(k) for k in set(os.environ) ^ set(before)}
    model = petals.DistributedLlamaForSequenceClassification.from_pretrained(
        tiny_swarm.model_dir, initial_peers=tiny_swarm.initial_peers, dht_prefix=tiny_swarm.dht_prefix,
        num_labels=LABELS, torch_dtype=torch.float32)
    before = dict(os.environ)  # what the caller's own from_pretrained set stays (torch sets TORCHINDUCTOR_CACHE_DIR)
    try:
        result = evaluate(model, dataset, tokenizer=AutoTokenizer.from_pretrained(tiny_swarm.model_dir), batch_size=8,
                          bootstrap_resamples=0)
    finally:
        helpers.shutdown_petals_client(model.model.layers.sequence_manager)
    assert result.metrics["num_samples"] == len(dataset)
    assert dict(os.environ) == before, {k: os.environ.get(k) for k in set(os.environ) ^ set(before)}
    assert datasets.is_progress_bar_enabled() == bars and transformers.logging.get_verbosity() == verbosity
