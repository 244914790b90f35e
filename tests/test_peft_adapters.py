"""PEFT's prompt-learning adapters (issue 70; dist_eval/backends/peft_adapter.py), checked against PEFT
itself: a current PEFT in the reference environment (``launch/install_reference.sh 5``) draws adapters on
tiny models of four families and computes its own forward (tests/reference/make_peft_reference.py, run
once per test run, nothing stored). Here, in the project's environment:

- PROMPT_TUNING and P_TUNING, SEQ_CLS and CAUSAL_LM (label words), on Llama 3, Qwen2, BLOOM and Falcon:
  ``--backend local`` logits of a right-padded batch within 1e-4 of PEFT's forward of each row alone;
- the folder, the weights file, an older PEFT's ``adapter_model.bin`` and a hub id read the same
  tensors; a hub id fetches adapter_config.json and the weights only;
- PREFIX_TUNING, LoRA, IA3 (saved by PEFT) and the other methods and tasks refused from
  adapter_config.json before any weight is read or fetched; the base model, hidden size, layers and
  prompt count checked; nothing of a refused adapter applied to a loaded model;
- a folder given for a file, and the reverse, named as what it is;
- docs/models-and-checkpoints.md's worked example: its PEFT snippet run in the reference environment,
  its command on two forked ranks against the shared tiny swarm equal to one local rank bit for bit, and
  both within 1e-4 of PEFT's forward (marked swarm).
"""
import dataclasses
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from conftest import REPO, read_jsonl, run_ranks, write_csv
from float_promises import ACROSS_GENERATIONS as TOLERANCE
from test_cli import fails_in_process

from dist_eval.errors import UsageError

FAMILIES = ("llama3", "qwen2", "bloom", "falcon")
ADAPTERS = ("PROMPT_TUNING.SEQ_CLS", "PROMPT_TUNING.CAUSAL_LM", "P_TUNING.SEQ_CLS", "P_TUNING.CAUSAL_LM")
DOC = os.path.join(REPO, "docs", "models-and-checkpoints.md")
SCRIPT = os.path.join(REPO, "tests", "reference", "make_peft_reference.py")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny models compute on one thread here, as a torchrun rank does."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def doc_example() -> tuple:
    """(the PEFT snippet, the first dist_eval command) of the page's worked example."""
    section = open(DOC, encoding="utf-8").read().split("### PEFT adapters", 1)[1].split("\n## ", 1)[0]
    (snippet,) = [s for s in re.findall(r"```python\n(.*?)```", section, flags=re.S) if "get_peft_model" in s]
    bash = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[0]
    return snippet, bash.splitlines()[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model):
    """(the folder, reference.json): PEFT's adapters and logits (make_peft_reference.py in the reference
    venv), and the worked example's folder (``worked``: ./my-llama, val.csv, the adapter and PEFT's logits)."""
    from conftest import reference_python

    python = reference_python("5")
    out, worked = tmp_path_factory.mktemp("peft_reference"), tmp_path_factory.mktemp("worked_example")
    os.symlink(tiny_model, worked / "my-llama")
    write_csv(str(worked / "val.csv"), 23, seed=7)
    (worked / "snippet.py").write_text(doc_example()[0], encoding="utf-8")
    made = subprocess.run([python, SCRIPT, str(out), "--worked-example", str(worked)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert made.returncode == 0, made.stderr[-3000:]
    with open(out / "reference.json", encoding="utf-8") as f:
        ref = json.load(f)
    assert ref["versions"]["peft"].startswith("0.") and ref["versions"]["transformers"].startswith("5."), ref
    return out, ref, worked


def padded(case) -> torch.Tensor:
    longest = max(map(len, case["ids"]))
    return torch.tensor([row + [case["pad_token_id"]] * (longest - len(row)) for row in case["ids"]])


def load(out, ref, kind, adapter, checkpoint=None, **kwargs):
    from dist_eval.backends import load_model

    case = ref["cases"][kind]
    words = {"label_words": ref["label_words"]} if adapter.endswith("CAUSAL_LM") else {}
    return load_model("local", str(out / case["folder"]),
                      checkpoint=checkpoint or str(out / case["adapters"][adapter]["folder"]), **words, **kwargs)


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("kind", FAMILIES)
def test_local_logits_within_1e4_of_peft(reference, kind, adapter):
    """Right-padded in one batch here, each row alone in PEFT (its SEQ_CLS head reads a padded batch's
    last position, a pad: the reference's padded_batch); the label words' tokens are the reference's."""
    out, ref, _ = reference
    case = ref["cases"][kind]
    model = load(out, ref, kind, adapter)
    assert (model.tuning_mode, model.prompt_tokens, model.num_labels) == ("ptune", ref["num_virtual_tokens"], 3)
    if adapter.endswith("CAUSAL_LM"):
        assert [list(ids) for ids in model.module.label_words.token_ids] == case["word_ids"]
    with torch.no_grad():
        logits = model.module(padded(case))
    expected = torch.tensor(case["adapters"][adapter]["logits"])
    assert (logits - expected).abs().max().item() < TOLERANCE
    assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()


def test_the_reference_shows_what_is_compared(reference):
    """P_TUNING: PEFT's model before the save (its encoder computing the prompts) is its loaded adapter
    (the saved prompts), exactly; PEFT's SEQ_CLS forward on a padded batch differs from the rows alone
    but for the longest row, which is why the rows are compared alone."""
    _, ref, _ = reference
    assert all(case["ptuning_encoder_vs_saved"] == 0.0 for case in ref["cases"].values())
    case = ref["cases"]["llama3"]
    batch, alone = case["padded_batch"], np.array(case["adapters"]["PROMPT_TUNING.SEQ_CLS"]["logits"])
    longest = max(batch["lengths"])
    far = [np.abs(np.array(b) - a).max() > 100 * TOLERANCE for b, a, n in zip(batch["logits"], alone, batch["lengths"])
           if n < longest]
    assert far and all(far)


def adapter_forms(out, ref, tmp_path):
    """{form: --checkpoint}: the folder, its weights file, an older PEFT's .bin folder, a copy elsewhere."""
    name = ref["cases"]["llama3"]["adapters"]["PROMPT_TUNING.SEQ_CLS"]["folder"]
    copy = shutil.copytree(out / name, tmp_path / "copied-adapter")
    return {"folder": str(out / name), "file": str(out / name / "adapter_model.safetensors"),
            "bin": str(out / (name + ".bin")), "bin file": str(out / (name + ".bin") / "adapter_model.bin"),
            "copy": str(copy) + "/"}


def test_every_form_reads_the_same_tensors(reference, tmp_path, monkeypatch):
    from fake_hub import fake_hub
    from huggingface_hub import constants

    from dist_eval.backends.checkpoint import checkpoint_digest, load_checkpoint
    from dist_eval.backends.families import FAMILIES as TABLE
    from dist_eval.backends.provenance import tensors_digest

    out, ref, _ = reference
    forms = adapter_forms(out, ref, tmp_path)
    assert not any(n.endswith(".safetensors") for n in os.listdir(forms["bin"]))
    states = {form: load_checkpoint(path, TABLE["llama"]) for form, path in forms.items()}
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))  # the user's cache untouched
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with fake_hub({"org/llama3-adapter": forms["folder"]}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        states["hub"] = load_checkpoint("org/llama3-adapter", TABLE["llama"])
        hub_digest = checkpoint_digest("org/llama3-adapter")
    assert hub.files("GET") == ["adapter_config.json", "adapter_model.safetensors"]
    config_only = tmp_path / "config_only"  # a hub copy holding adapter_config.json alone
    config_only.mkdir()
    shutil.copy(os.path.join(forms["folder"], "adapter_config.json"), config_only)
    with fake_hub({"org/config-only": str(config_only)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        with pytest.raises(UsageError, match="a PEFT adapter without its weights"):
            load_checkpoint("org/config-only", TABLE["llama"])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the config in the cache, the weights never fetched
    with pytest.raises(UsageError) as caught:
        load_checkpoint("org/config-only", TABLE["llama"])
    assert "is not in the HF cache, and HF_HUB_OFFLINE=1 forbids downloading it" in str(caught.value), caught.value
    assert {tensors_digest(s.tensors) for s in states.values()} == {tensors_digest(states["folder"].tensors)}
    assert {(s.tuning_mode, s.pre_seq_len, s.num_labels, s.adapter.task_type) for s in states.values()} == {
        ("ptune", 8, 3, "SEQ_CLS")}
    # the run key's digest: the two files' content, whatever the form
    assert hub_digest == checkpoint_digest(forms["file"]) == checkpoint_digest(forms["copy"])
    assert checkpoint_digest(forms["bin"]) != checkpoint_digest(forms["folder"])


@pytest.mark.parametrize("method", ["PREFIX_TUNING", "LORA", "IA3"])
def test_adapters_that_change_the_blocks_are_refused_before_any_weight(reference, tmp_path, method, monkeypatch):
    """PEFT's own saves; the weights file removed (so never read), and by hub id only adapter_config.json
    fetched."""
    from fake_hub import fake_hub
    from huggingface_hub import constants

    from dist_eval.backends.checkpoint import load_checkpoint

    out, ref, _ = reference
    folder = tmp_path / "adapter"
    shutil.copytree(out / ref["refused"][method], folder)
    os.remove(folder / "adapter_model.safetensors")
    with pytest.raises(UsageError) as refused:
        load_checkpoint(str(folder))
    message = str(refused.value)
    assert "\n" not in message and f"a PEFT {method} adapter: " in message and "not read" in message
    if method == "PREFIX_TUNING":
        assert "keys and values inside the blocks' attention" in message and "PeftModel.from_pretrained" in message
    else:
        assert "changes the blocks' weights" in message and "merge_and_unload().save_pretrained(DIR)" in message
    assert "the blocks run on the swarm's servers" in message and "PROMPT_TUNING and P_TUNING" in message
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with fake_hub({"org/adapter": str(out / ref["refused"][method])}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        with pytest.raises(UsageError, match=f"a PEFT {method} adapter: "):
            load_checkpoint("org/adapter")
    assert hub.files("GET") == ["adapter_config.json"]


def edited(out, ref, tmp_path, adapter="PROMPT_TUNING.SEQ_CLS", kind="llama3", **changes) -> str:
    """A copy of a reference adapter with adapter_config.json's ``changes``."""
    folder = shutil.copytree(out / ref["cases"][kind]["adapters"][adapter]["folder"], tmp_path / "edited")
    with open(folder / "adapter_config.json", encoding="utf-8") as f:
        config = json.load(f)
    config.update(changes)
    with open(folder / "adapter_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f)
    return str(folder)


@pytest.mark.parametrize("changes, expected", [
    ({"peft_type": "MULTITASK_PROMPT_TUNING"}, "its prompts depend on a task id given with each row"),
    ({"peft_type": "CPT"}, "a PEFT CPT adapter: its prompts are built from context examples' tokens"),
    ({"peft_type": "ADAPTION_PROMPT"}, "keys and values inside the blocks' attention"),
    ({"peft_type": "LOHA"}, "changes the blocks' weights"),
    ({"task_type": "TOKEN_CLS"}, "for task_type TOKEN_CLS: read are SEQ_CLS .* and CAUSAL_LM"),
    ({"num_transformer_submodules": 2}, "encoder-decoder model"),
    ({"num_virtual_tokens": 7}, "num_virtual_tokens 7 in adapter_config.json, but prompt_embeddings holds 8"),
])
def test_what_is_not_read_is_refused_in_one_line(reference, tmp_path, changes, expected):
    from dist_eval.backends.checkpoint import load_checkpoint

    out, ref, _ = reference
    with pytest.raises(UsageError) as refused:
        load_checkpoint(edited(out, ref, tmp_path, **changes))
    assert re.search(expected, str(refused.value)) and "\n" not in str(refused.value), str(refused.value)


def test_the_base_model_is_checked_against_the_model(reference, tmp_path):
    """Another family's model of the same shape (the name tells), another hidden size; a copy of the base
    under its own name, or the base named by a hub id of that name, is the model."""
    out, ref, _ = reference
    qwen = str(out / "qwen2")
    with pytest.raises(UsageError) as refused:
        load(out, ref, "qwen2", "PROMPT_TUNING.SEQ_CLS", checkpoint=str(out / "llama3.PROMPT_TUNING.SEQ_CLS"))
    base = os.path.join(str(out), "llama3")
    assert str(refused.value).startswith(f"checkpoint='{out / 'llama3.PROMPT_TUNING.SEQ_CLS'}': a PEFT adapter "
                                         f"trained on {base} (base_model_name_or_path in adapter_config.json), and "
                                         f"model_dir='{qwen}' is another model. Pass model_dir='{base}';")
    with pytest.raises(UsageError, match=r"token_dim 128, num_layers 4 in adapter_config.json\), and model_dir="
                                         r"'.*' has hidden size 64 and 4 layers"):
        load(out, ref, "llama3", "", checkpoint=edited(out, ref, tmp_path, token_dim=128))
    copy = shutil.copytree(out / "llama3", tmp_path / "elsewhere" / "llama3")
    from dist_eval.backends import load_model

    assert load_model("local", str(copy), checkpoint=str(out / "llama3.PROMPT_TUNING.SEQ_CLS")).num_labels == 3
    hub_named = edited(out, ref, tmp_path / "hub", base_model_name_or_path="meta-llama/llama3")
    assert load_model("local", str(copy), checkpoint=hub_named).num_labels == 3


def test_a_model_read_by_hub_id_is_named_by_it_where_the_base_differs(tmp_path):
    """The review's finding: the refusal named the HF cache's snapshot folder (models--org--name/snapshots/<commit>),
    not the hub id the user gave, in its text and in the fix it proposed."""
    from types import SimpleNamespace

    from dist_eval.backends.peft_adapter import Adapter, check_base

    snapshot = tmp_path / "hub" / "models--org--qwen-small" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    adapter = Adapter(source="org/adapter", weights="", peft_type="PROMPT_TUNING", task_type="SEQ_CLS",
                      num_virtual_tokens=8, token_dim=64, num_layers=4, base="org/llama-small")
    with pytest.raises(UsageError) as refused:
        check_base(adapter, SimpleNamespace(hidden_size=64, num_hidden_layers=4), str(snapshot))
    message = str(refused.value)
    assert "model_dir='org/qwen-small' is another model" in message and "base_model_name_or_path in " \
        "adapter_config.json to org/qwen-small." in message and "snapshots" not in message, message
    check_base(adapter, SimpleNamespace(hidden_size=64, num_hidden_layers=4),  # the base's own snapshot: its model
               str(tmp_path / "hub" / "models--org--llama-small" / "snapshots" / ("0" * 40)))
    trained_on_a_snapshot = dataclasses.replace(  # a trainer that loaded snapshot_download()'s folder
        adapter, base=str(tmp_path / "hub" / "models--org--llama-small" / "snapshots" / ("1" * 40)))
    with pytest.raises(UsageError) as refused:
        check_base(trained_on_a_snapshot, SimpleNamespace(hidden_size=64, num_hidden_layers=4), str(snapshot))
    message = str(refused.value)
    assert "trained on org/llama-small (" in message and "Pass model_dir='org/llama-small'" in message and \
        "name its folder llama-small" in message and "snapshots" not in message, message


def test_nothing_of_a_refused_adapter_is_applied(reference, tmp_path):
    """A loaded model asked to swap to a refused adapter (LoRA; one whose weights hold another module
    of modules_to_save) keeps its own prompts and head: the same logits bit for bit; then a P_TUNING
    adapter swaps in and gives PEFT's."""
    from safetensors.torch import load_file, save_file

    from dist_eval.backends.classifier import swap_checkpoint
    from dist_eval.ranks import RankFailure

    out, ref, _ = reference
    case = ref["cases"]["llama3"]
    model = load(out, ref, "llama3", "PROMPT_TUNING.SEQ_CLS")
    first = model.checkpoint
    with torch.no_grad():
        before = model.module(padded(case))
    extra = edited(out, ref, tmp_path)
    weights = load_file(os.path.join(extra, "adapter_model.safetensors"))
    weights["base_model.model.embed_tokens.weight"] = torch.zeros(8, 64)
    save_file(weights, os.path.join(extra, "adapter_model.safetensors"))
    for bad, expected in ((str(out / ref["refused"]["LORA"]), "a PEFT LORA adapter: "),
                          (extra, "hold base_model.model.embed_tokens.weight, which are not read")):
        with pytest.raises(RankFailure, match=expected) as refused:  # the phase's failure: a usage error
            swap_checkpoint(model, bad)
        assert refused.value.usage
        assert model.checkpoint == first
        with torch.no_grad():
            assert torch.equal(model.module(padded(case)), before)
    swap_checkpoint(model, str(out / case["adapters"]["P_TUNING.SEQ_CLS"]["folder"]))
    with torch.no_grad():
        after = model.module(padded(case))
    assert (after - torch.tensor(case["adapters"]["P_TUNING.SEQ_CLS"]["logits"])).abs().max().item() < TOLERANCE


def test_a_causal_lm_adapter_without_label_words_says_how_to_score(reference):
    out, ref, _ = reference
    from dist_eval.backends import load_model

    with pytest.raises(UsageError, match=r"task_type CAUSAL_LM: prompts for the language model, no classifier head. "
                                         r"Score the classes with label_words W0 W1 \.\.\."):
        load_model("local", str(out / "llama3"), checkpoint=str(out / "llama3.PROMPT_TUNING.CAUSAL_LM"))


def test_folders_and_files_are_named_as_what_they_are(reference, tmp_path, capfd):
    """On the command line (one rank in this process): each mistake in one line naming the flag."""
    out, ref, worked = reference
    data, model = str(worked / "val.csv"), str(out / "llama3")
    adapter = str(out / "llama3.PROMPT_TUNING.SEQ_CLS")
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(os.path.join(adapter, "adapter_model.safetensors"), lone / "trained.safetensors")
    (tmp_path / "runs").mkdir()
    torch.save({}, tmp_path / "runs" / "ck.pt")
    cases = [
        (["--model", model, "--checkpoint", model], r"--checkpoint \S+: a model folder \(config.json\), not a "
         r"checkpoint file. Pass it as --model, or as --head"),
        (["--model", model, "--checkpoint", str(tmp_path / "runs")], r"a folder, not a checkpoint file, and no PEFT "
         r"adapter \(no adapter_config.json in it; it holds ck.pt\)"),
        (["--model", adapter, "--checkpoint", adapter], r"--model \S+: a PEFT adapter's folder \(adapter_config.json"
         r"\), not a model. Pass it as --checkpoint, and its base model \(\S+llama3\) as --model"),
        (["--model", os.path.join(adapter, "adapter_model.safetensors")], r"--model \S+: a PEFT adapter's weights "
         r"file, not a model folder"),
        (["--model", model, "--head", adapter], r"--head \S+: a PEFT adapter's folder, not a head: pass it as "
         r"--checkpoint"),
        (["--model", model, "--checkpoint", str(lone / "trained.safetensors")], r"holds a PEFT adapter's weights "
         r"\(prompt_embeddings\) without the adapter_config.json"),
        (["--model", model, "--checkpoint", str(tmp_path / "no" / "ck.pt")], r"no such file or folder"),
    ]
    for args, pattern in cases:
        fails_in_process([*args, "--data-files", data, "--backend", "local", "--output-dir", str(tmp_path / "o")],
                         capfd, pattern)


def test_the_reference_script_imports_no_dist_eval():
    with open(SCRIPT, encoding="utf-8") as f:
        source = f.read()
    assert "import dist_eval" not in source and "from dist_eval" not in source


@pytest.mark.swarm
@pytest.mark.multiproc
def test_the_worked_example_on_a_swarm_equals_local_and_peft(reference, tiny_swarm, rank_zygote, no_figures,
                                                             tmp_path):
    """The page's command as written (its folders here), on two forked ranks against the shared tiny
    swarm (its peers added) and in this process with --backend local: the same logits bit for bit, each
    row within 1e-4 of PEFT's forward of the adapter the page's PEFT snippet saved."""
    from inprocess_cli import run_cli_in_process

    _, _, worked = reference
    command = doc_example()[1].split()
    nproc, args = int(command[1].split("=")[1]), command[command.index("dist_eval") + 1:]
    args = [str(worked / a[2:]) if a.startswith("./") else str(worked / a) if a == "val.csv" else a for a in args]
    common = [*args, "--save-logits", "--quiet"]
    swarm = [*common, "--output-dir", str(tmp_path / "swarm"), "--initial-peers", *tiny_swarm.initial_peers,
             "--dht-prefix", tiny_swarm.dht_prefix]
    proc = run_ranks(rank_zygote, swarm, nproc=nproc, env=no_figures)
    assert nproc == 2 and proc.returncode == 0, proc.stderr[-3000:]
    assert run_cli_in_process([*common, "--output-dir", str(tmp_path / "local"), "--backend", "local"],
                              hide_modules=("matplotlib",)) == 0
    on_swarm, local = (read_jsonl(tmp_path / name / "predictions.jsonl") for name in ("swarm", "local"))
    assert on_swarm == local and len(local) == 23  # every row's logits, bit for bit
    with open(worked / "peft_logits.json", encoding="utf-8") as f:
        peft = np.array(json.load(f)["logits"])
    logits = np.array([row["logits"] for row in sorted(local, key=lambda row: row["index"])])
    assert np.abs(logits - peft).max() < TOLERANCE


def test_a_prompt_learning_peft_model_in_memory_is_refused_naming_the_model(tiny_model):
    """PEFT's model object with a prompt-tuning adapter, given to evaluate() as it is (a training loop's): PEFT hands
    the base model its prompts and rows as embeddings without the ids, so each row shorter than the batch's longest
    had the head read at a pad (other logits, no error): refused in one line naming ``model`` and saying how to
    evaluate the adapter (saved, as a checkpoint). A LoRA model computes from its ids: not refused."""
    import peft
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification

    from dist_eval import evaluate
    from dist_eval.backends.objects import as_loaded_model
    from dist_eval.backends.tokenizer import load_tokenizer

    def base():
        model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=3)
        model.config.pad_token_id = 0
        return model

    tuned = peft.get_peft_model(base(), peft.PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=4))
    data = Dataset.from_dict({"text": ["a short row", "a row of a few more words than the other"], "label": [0, 1]})
    with pytest.raises(UsageError) as caught:
        evaluate(tuned, data, tokenizer=load_tokenizer(tiny_model))
    said = str(caught.value)
    assert caught.value.param == "model" and said.startswith("model=<PeftModelForSequenceClassification>: a PEFT "
                                                             "model with a PROMPT_TUNING adapter"), said
    assert "model.save_pretrained(ADAPTER_DIR)" in said and "checkpoint=ADAPTER_DIR" in said, said
    lora = peft.get_peft_model(base(), peft.LoraConfig(task_type="SEQ_CLS", target_modules=["q_proj"]))
    assert as_loaded_model(lora) is lora  # called as it is


def test_a_prompt_learning_peft_model_inside_distributed_data_parallel_is_refused(tiny_model, tmp_path):
    """A training loop's model is often wrapped: DistributedDataParallel(PeftModel) is refused as the PeftModel is (the
    check ran before the unwrap, once). One process's gloo group, made and destroyed here."""
    import peft
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForSequenceClassification

    from dist_eval.backends.objects import as_loaded_model

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=3)
    model.config.pad_token_id = 0
    tuned = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=4))
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with pytest.raises(UsageError) as caught:
            as_loaded_model(DistributedDataParallel(tuned))
    finally:
        dist.destroy_process_group()
    assert caught.value.param == "model" and "a PEFT model with a PROMPT_TUNING adapter" in str(caught.value)


@pytest.mark.parametrize("typed", ["runs/my adapter", "runs/adapter--v2"])
def test_a_mistyped_folder_that_is_no_hub_name_is_not_there_not_fetched(tiny_model, typed):
    """``org/name`` with a space or a ``--`` is no name the hub allows: a mistyped folder, said to be missing in one
    line naming checkpoint (it was asked of the hub: huggingface_hub's HFValidationError, an internal failure)."""
    from dist_eval.backends import load_model

    with pytest.raises(UsageError) as caught:
        load_model("local", tiny_model, checkpoint=typed)
    assert caught.value.param == "checkpoint" and "no such file or folder" in str(caught.value), str(caught.value)
