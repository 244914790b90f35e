"""The families after 2023 (Llama 3.x, Mistral, Qwen2, Qwen3, Qwen3-MoE, GLM-4.5, Mixtral, DeepSeek-V3, Llama 4,
Qwen3.5: against transformers 5.x alone) and tokenizers
saved since late 2024, checked against a reference nobody in this project wrote: a current transformers and
tokenizers, in their own environment (launch/install_reference.sh), make tiny models and
tokenizers and compute ids and logits (tests/reference/make_reference.py, run once per test
run, nothing stored). Here, in the project's environment:

- dist_eval's token ids equal the current tokenizers', row for row, on non-ASCII text, code and
  emoji (merges saved as pairs, Llama 3's ignore_merges, SentencePiece-style Llama/Mistral);
- ``--backend local`` logits are within 1e-4 of the current ``*ForSequenceClassification``
  (no prompts; and with prompts prepended, ptune); GLM-4.5, which has none, against its causal
  LM's last final hidden state times the head, given with ``head=`` (``--head``), with and
  without a checkpoint of prompts;
- on a local swarm started by the run, torchrun N=2, the logits equal local N=1 bit for bit
  (and so the reference within 1e-4), marked swarm; DeepSeek-V3's from its FP8 folder;
- DeepSeek-V3's FP8 folder (e4m3 weights, a scale per tile) gives the tensors and logits of the
  same model saved dequantized, bit for bit; gpt-oss's MXFP4 folder (its experts as released) too, as
  transformers' own reading of it does; gpt-oss's sinks, sliding window, clamp and router bias each count;
- dist_eval's own layers (Qwen3's head size and q/k norms, Qwen3-MoE's, GLM-4.5's and Mixtral's experts) hold
  exactly the tensors the current transformers saved, and give experts to the blocks it does;
  GLM-4.5's router options (groups, correction bias, scaling) and partial RoPE each move the logits,
  and so do DeepSeek-V3's yarn RoPE, its softmax scale and its interleaved rope layout;
- what no block computes is refused in one line, from config.json, before anything loads.
"""
import csv
import json
import os
import shutil
import subprocess
import types

import numpy as np
import pytest
import torch
from conftest import REPO, read_jsonl, run_ranks, stop_group, transformers_said
from float_promises import ACROSS_GENERATIONS as TOLERANCE
from float_promises import assert_same_bits, assert_within_rounding
from inprocess_cli import run_cli_in_process

from dist_eval.backends.blocks import SERVER_VERSION_MARK
from dist_eval.backends.families import FAMILIES

GENERATIONS = {"4": "4.57", "5": "5."}  # the transformers that made each reference (launch/install_reference.sh)
REFERENCE_FIXTURES = {"4": "reference", "5": "reference5"}  # each generation's reference, by fixture name
KINDS = ("llama3", "mistral", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "mixtral", "deepseek_v3", "llama4_text",
         "qwen3_5", "qwen3_5_moe", "qwen3_next", "minimax_m2", "gpt_oss", "kimi_k25", "glm_moe_dsa", "deepseek_v32",
         "deepseek_v4")
# the families only a later transformers has (Qwen3.5: 5.2 on): checked against that one alone; Qwen3-Next (4.57
# has it too) against 5.x alone, the transformers issue 72 names
MADE_BY = {"qwen3_5": ("5",), "qwen3_5_moe": ("5",), "qwen3_next": ("5",), "minimax_m2": ("5",),
           "gpt_oss": ("5",), "kimi_k25": ("5",), "glm_moe_dsa": ("5",),
           "deepseek_v32": ("5",), "deepseek_v4": ("5",)}
# on a swarm, end to end (torchrun N=2, the run's own one-server swarm, the config read in the server process):
# the 5.x-saved Llama 3 (rope_parameters with llama3 scaling) and Qwen3-MoE (num_local_experts), the 4.57-saved
# DeepSeek-V3 from its FP8 folder (the servers dequantize it as they load), and Qwen3.5-MoE (the hybrid blocks, in
# the vision-language layout). Every family's server blocks, from both generations' folders and from each
# quantized release, equal the local blocks bit for bit on the same hidden states
# (test_server_blocks_equal_the_local_blocks_on_the_same_hidden_states, in-process): a whole swarm run adds the
# client's load, the wire and the processes, which these four check. Every family of issue 72, each from its
# folder as released (Qwen3.5 dense and MoE, Qwen3-Next, MiniMax-M2 bf16 and FP8, GLM-5, DeepSeek-V3.2 FP8, gpt-oss
# MXFP4, Kimi K2.5 INT4, DeepSeek-V4 FP8 + FP4 with its head and with label words), runs end to end in
# benchmarks/families_swarm.py: local N=1, then torchrun N=2 on the run's own swarm of 2 servers, --audit 1,
# predictions.jsonl equal bit for bit (its figures: benchmarks/RESULTS.md, "issue 72's families on dist_eval's own
# swarm, end to end, as released"); about a minute a family on 2 cores, over the suite's time budget. What the
# runs found that no in-process test did is tested here on its own (the INT4 release's client load:
# test_the_petals_client_of_an_int4_release_needs_no_quantization_package)
SWARM_CASES = (("5", "llama3"), ("5", "qwen3_moe"), ("4", "deepseek_v3"), ("5", "qwen3_5_moe"))
SWARM_FOLDER = {"deepseek_v3": "deepseek_v3_fp8"}  # the servers dequantize the FP8 folder as they load
# every family of the family table (llama3: model_type llama; kimi_k2: DeepSeek-V3's block under its own name)
ALL_KINDS = ("bloom", "falcon", *KINDS, "kimi_k2")
# no *ForSequenceClassification in transformers: the head given apart (--head)
HEAD_ONLY = ("glm4_moe", "llama4_text", "minimax_m2", "kimi_k25", "glm_moe_dsa", "deepseek_v32", "deepseek_v4")
# prompts refused (DeepSeek-V4's first blocks route by token id, which a prompt position has not): no ptune reference
PROMPTS_REFUSED = ("deepseek_v4",)
# the servers read the release as shipped: gpt-oss's MXFP4 folder, Kimi K2.5's INT4 one, DeepSeek-V4's FP8 + FP4 one
# (dequantized as they load)
SERVED_FOLDER = {"gpt_oss": "gpt_oss_mxfp4", "kimi_k25": "kimi_k25_int4", "deepseek_v4": "deepseek_v4_fp8"}
# (generation, kind) of every family and each transformers generation that has it
CASES = [(generation, kind) for kind in ALL_KINDS for generation in sorted(GENERATIONS)
         if generation in MADE_BY.get(kind, GENERATIONS)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny models here compute on one thread, as a torchrun rank does: with more, on the 2-core
    test machine, the threads of the mixtures' many small products mostly waited on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def wanted_generations(session, module) -> list:
    """The generations whose reference the selected tests of ``module`` read (all of them in a whole run;
    a ``-k`` run of one generation's cases makes that one alone)."""
    wanted = set()
    for item in session.items:
        if getattr(item, "module", None) is not module:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        wanted.update(generation for generation, name in REFERENCE_FIXTURES.items() if name in item.fixturenames)
        if params.get("generation") in GENERATIONS:
            wanted.add(params["generation"])
    return sorted(wanted)


def start_reference(tmp_path_factory, generation: str) -> tuple:
    """Start making the reference of ``generation`` ("4": 4.57, "5": 5.x) in the background: its environment
    (launch/install_reference.sh), then tests/reference/make_reference.py in it (models, tokenizers, trainable
    tensors and reference.json). (the process, the folder, its log)."""
    from conftest import is_reference_here, reference_python

    # the environment made first, unless this one is it (the suite's own current stack is generation 5's)
    install = "true" if is_reference_here(generation) else os.path.join(REPO, "launch", "install_reference.sh")
    out = tmp_path_factory.mktemp(f"reference{generation}")
    log = out.with_name(out.name + ".log")
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            ["bash", "-c", 'set -e; "$1" "$2"; exec timeout 300 "$3" "$4" "$5"', "reference", install, generation,
             reference_python(generation, install=False), os.path.join(REPO, "tests", "reference", "make_reference.py"),
             str(out)],
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return proc, out, log


def finished_reference(started: tuple, generation: str) -> tuple:
    """(the folder, reference.json) of :func:`start_reference`'s run, once it ended well."""
    proc, out, log = started
    try:
        proc.wait(timeout=1200)
    except subprocess.TimeoutExpired:
        stop_group(proc.pid)
        proc.wait()
        pytest.fail(f"the reference of transformers {GENERATIONS[generation]} was not made in 20 minutes: "
                    + log.read_text()[-3000:])
    assert proc.returncode == 0, log.read_text()[-3000:]
    with open(out / "reference.json", encoding="utf-8") as f:
        ref = json.load(f)
    assert ref["versions"]["transformers"].startswith(GENERATIONS[generation]), ref["versions"]
    return out, ref


@pytest.fixture(scope="module", autouse=True)
def references_started(request, tmp_path_factory):
    """Every reference the module's selected tests read, started together before its first test: each spends much
    of its minute installing (the disk, not the CPU), which the other's work fills. Autouse, so that it starts in
    the first test's setup: tests ask for a generation's reference in their body (reference_of), and a process
    started there would be that test's, which the suite's leak check wants gone at its end."""
    started = {generation: start_reference(tmp_path_factory, generation)
               for generation in wanted_generations(request.session, request.module)}
    yield started
    for proc, _, _ in started.values():  # a run cut short: nothing left making them
        if proc.poll() is None:
            stop_group(proc.pid)
            proc.wait()


@pytest.fixture(scope="module")
def reference(references_started):
    """transformers 4.57's reference: config.json in the 4.x form."""
    return finished_reference(references_started["4"], "4")


@pytest.fixture(scope="module")
def reference5(references_started):
    """transformers 5.x's reference: config.json in the 5.x form (rope_parameters, renamed fields)."""
    return finished_reference(references_started["5"], "5")


def reference_of(request, generation: str):
    return request.getfixturevalue(REFERENCE_FIXTURES[generation])


def trained(reference, kind, mode) -> dict:
    """load_model's checkpoint= and head= for the reference's trained tensors: a dist_eval
    checkpoint of them; for a family without a sequence classifier (HEAD_ONLY) the head in a file
    of its own (``--head``) alone, or beside a file of the prompts alone (``--checkpoint``).
    """
    from safetensors.torch import load_file, save_file

    from dist_eval.backends.checkpoint import save_checkpoint

    out, _ = reference
    tensors = load_file(str(out / f"{kind}.trainable.safetensors"))
    if kind in HEAD_ONLY:
        head, prompts = str(out / f"{kind}.head.safetensors"), str(out / f"{kind}.prompts.safetensors")
        save_file({"score.weight": tensors["score.weight"]}, head)
        if mode == "head":
            return {"head": head}
        save_file({"prompt_embeddings.weight": tensors["prompt_embeddings.weight"]}, prompts)
        return {"checkpoint": prompts, "head": head}
    path = str(out / f"{kind}.{mode}.pt")
    if mode == "head":
        save_checkpoint(path, None, {"score.weight": tensors["score.weight"]})
    else:
        save_checkpoint(path, "ptune", tensors)
    return {"checkpoint": path}


def padded_batch(case) -> torch.Tensor:
    longest = max(map(len, case["ids"]))
    return torch.tensor([row + [case["pad_token_id"]] * (longest - len(row)) for row in case["ids"]])


@pytest.mark.parametrize("generation, kind", CASES)
def test_token_ids_equal_the_current_tokenizers(request, generation, kind):
    from datasets import Dataset

    from dist_eval.backends.tokenizer import load_tokenizer
    from dist_eval.data.labels import TaskColumns
    from dist_eval.data.tokenize import tokenize_rows

    out, ref = reference_of(request, generation)
    case = ref["cases"][kind]
    tokenizer = load_tokenizer(str(out / case["folder"]))
    data = Dataset.from_dict({"text": ref["corpus"], "label": [0] * len(ref["corpus"])})
    rows = np.arange(len(ref["corpus"]), dtype=np.int64)
    ids, truncated = tokenize_rows(tokenizer, data, rows, TaskColumns("text", "label"), 512, case["pad_token_id"])
    assert truncated == 0
    assert [list(map(int, row)) for row in ids] == case["ids"]


def test_ignore_merges_changes_the_ids_here(reference):
    """The Llama 3 tokenizer's vocabulary has whole words no merge makes: without
    ignore_merges (tokenizers 0.13) those rows split, so the test above can fail."""
    from tokenizers import Tokenizer

    out, ref = reference
    with open(out / "llama3" / "tokenizer.json", encoding="utf-8") as f:
        saved = json.load(f)
    saved["model"]["ignore_merges"] = False
    dropped = Tokenizer.from_str(json.dumps(saved))
    differ = [text for text, ids in zip(ref["corpus"], ref["cases"]["llama3"]["ids"])
              if dropped.encode(text).ids != ids]
    assert len(differ) >= 3, differ


@pytest.mark.parametrize("mode", ["head", "ptune"])
@pytest.mark.parametrize("generation, kind", CASES)
def test_local_logits_within_1e4_of_the_transformers_that_saved_the_folder(request, generation, kind, mode):
    """Every family, saved by transformers 4.57 and by 5.x (config.json in each one's form), computed by
    --backend local within 1e-4 of that transformers' own classes; its load says nothing of weights."""
    from dist_eval.backends import load_model

    reference = reference_of(request, generation)
    out, ref = reference
    case = ref["cases"][kind]
    if mode == "ptune" and kind in PROMPTS_REFUSED:  # refused in one line, before the weights are read
        from dist_eval.errors import UsageError, flag_names

        with pytest.raises(UsageError) as caught:
            load_model("local", str(out / case["folder"]), **trained(reference, kind, mode))
        with flag_names():
            assert str(caught.value).startswith("--tuning-mode ptune: ptune on deepseek_v4: blocks [0, 1] route each "
                                                "position by its token id") and "\n" not in str(caught.value)
        return
    with transformers_said() as seen:
        model = load_model("local", str(out / case["folder"]), **trained(reference, kind, mode))
    # a causal LM's head (a release's under its own name: DeepSeek-V4's head.weight) unread without a word (a tiny
    # save's multi-token-prediction block is said: transformers' own classes leave out only a release's, layer 61)
    rows = [row.split("|")[0].strip() for message in seen for row in message.splitlines()]
    assert not {"lm_head.weight", "head.weight"} & set(rows) and not [m for m in seen if "newly initialized" in m], seen
    with torch.no_grad():
        logits = model.module(padded_batch(case))
    expected = torch.tensor(case[f"logits_{mode}"])
    assert (logits - expected).abs().max().item() < TOLERANCE
    assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()


@pytest.mark.parametrize("generation, kind", CASES)
def test_server_blocks_equal_the_local_blocks_on_the_same_hidden_states(request, generation, kind, monkeypatch):
    """Each block as the servers dist_eval starts build it (petals' load_pretrained_block with dist_eval's
    block index, from the folder petals reads, its config read by petals' own classes) gives, on the local
    model's hidden states before it, the local model's hidden states after it, bit for bit (the last block's
    through the final norm): values, not shapes, for every family and both config.json forms (the quantized
    releases' blocks from their folders as shipped, SERVED_FOLDER; the local model from the dequantized one).
    DeepSeek-V4's blocks take and give the hc_mult streams, each through the servers' merged forward step with the
    row's token ids where the block routes by them (without them a hash-routed block fails its request)."""
    from dist_eval.backends import load_model
    from dist_eval.backends.blocks import register
    from dist_eval.backends.config_json import family_of_folder
    from dist_eval.backends.petals.shims import apply_server_bridges, import_petals
    from dist_eval.backends.petals_folder import petals_model_folder
    from dist_eval.swarm.blocks import server_block_replacements

    import_petals()
    apply_server_bridges()  # as a server does (transformers 5.x: petals' blocks on 5.x's; none on the pinned stack)
    register()
    from petals.utils.auto_config import AutoDistributedConfig

    reference = reference_of(request, generation)
    out, ref = reference
    case = ref["cases"][kind]
    folder = str(out / case["folder"])
    family = family_of_folder(folder)
    hf_model = load_model("local", folder, **trained(reference, kind, "head")).module.hf_model
    backbone, blocks = family.get(hf_model, family.backbone), family.get(hf_model, family.blocks)
    ids = torch.tensor([case["ids"][1]])
    routed = family.token_routed_blocks(hf_model.config)
    with torch.no_grad():  # DeepSeek-V4: called with the ids, the backbone's hooks hand them to its hash-routed blocks
        given = {"input_ids": ids} if routed else {"inputs_embeds": family.get(hf_model, family.embeddings)(ids)}
        hidden = backbone(**given, output_hidden_states=True, use_cache=False).hidden_states
    served = petals_model_folder(str(out / SERVED_FOLDER.get(kind, case["folder"])))
    config = AutoDistributedConfig.from_pretrained(served)
    replacements = server_block_replacements()
    load_block = dict(((owner.__name__, name), fn) for owner, name, fn in replacements)[
        ("petals.server.server", "load_pretrained_block")]
    for owner, name, fn in replacements:  # the tensors as the servers read them (FP8, INT4, MXFP4 dequantized)
        monkeypatch.setattr(owner, name, fn)
    final_norm = [module for name, module in backbone.named_children() if name in ("norm", "ln_f")]
    for index in range(len(blocks)):
        block = load_block(served, index, config=config, torch_dtype=torch.float32)
        with torch.no_grad():
            after = server_step(block, hidden[index], ids if index in routed else None) if routed else \
                block(hidden[index])[0]
            if index == len(blocks) - 1:  # transformers gives the last block's output through the final norm
                after = final_norm[0](after)
        assert_same_bits(after, hidden[index + 1], f"block {index} on a server and here")
        if index in routed:
            with pytest.raises(ValueError, match=r"routes each position by its token id; \d+ positions, token ids "
                                                 r"known: none"):
                server_step(block, hidden[index], None)
    assert sorted(routed) == ([0, 1] if kind == "deepseek_v4" else [])


def server_step(block, hidden_states: torch.Tensor, token_ids):
    """``block``'s output for ``hidden_states`` as a server dist_eval starts computes it: its merged forward's step
    (the request's token ids the blocks' ROW_TOKEN_IDS while they run)."""
    from petals.utils.misc import DUMMY

    from dist_eval.swarm.merged_forward import MergedForwardStep

    step = MergedForwardStep({"block": types.SimpleNamespace(forward=lambda states, adapter: block(states))})
    with torch.no_grad():
        return step(hidden_states.clone(), "", ("block",), (DUMMY,), token_ids)[0]


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "mixtral", "deepseek_v3",
                                  "llama4_text"])
def test_own_layers_hold_exactly_the_saved_tensors_and_route_as_transformers(reference, kind):
    """No tensor of the folder left unread, none made up (transformers 4.33 would initialise a
    missing one at random), but a multi-token-prediction layer after the last block (DeepSeek-V3's);
    which blocks have experts is transformers' rule."""
    from safetensors.torch import load_file

    from dist_eval.backends import load_model
    from dist_eval.backends.layers import is_sparse

    out, ref = reference
    model = load_model("local", str(out / kind), **trained(reference, kind, "head"))
    backbone = model.module.hf_model.model
    saved = load_file(str(out / kind / "model.safetensors"))
    held, blocks = backbone.state_dict(), len(backbone.layers)
    prediction_layer = f"model.layers.{blocks}."
    assert any(k.startswith(prediction_layer) for k in saved) == (kind == "deepseek_v3")
    saved = {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.") and
             not k.startswith(prediction_layer)}
    assert set(held) == set(saved)
    assert all(torch.equal(held[k], v) for k, v in saved.items())
    experts = [i for i, layer in enumerate(backbone.layers) if hasattr(layer.mlp, "experts")]
    # Qwen3-MoE: block 1 in mlp_only_layers; GLM-4.5, DeepSeek-V3: block 0 before first_k_dense_replace
    assert experts == {"qwen3_moe": [0, 2, 3], "glm4_moe": [1, 2, 3], "mixtral": [0, 1, 2, 3],
                       "deepseek_v3": [1, 2], "llama4_text": [1, 3]}.get(kind, [])
    mix = ref["sparse_layers"]
    config = types.SimpleNamespace(mixture_of_experts=True, **mix["settings"])
    assert [i for i in range(config.num_hidden_layers) if is_sparse(config, i)] == mix["sparse"] == [1, 5]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_reads_its_text_model_alone_and_mixes_its_blocks_as_released(reference5, kind):
    """Qwen3.5 and Qwen3.5-MoE as released (a vision-language save, config.json's text_config nested): the
    local model holds exactly the text model's tensors (model.language_model.* read as model.*); the vision
    tower's are in the folder and never read (left out of the converted copy too); blocks 0-2 Gated DeltaNet
    and block 3 gated full attention, as layer_types says; the MoE's every block a mixture with a gated
    shared expert."""
    from safetensors.torch import load_file

    from dist_eval.backends import load_model
    from dist_eval.backends.layers import GatedAttention, GatedDeltaNet, GatedSharedMoeMLP
    from dist_eval.backends.petals_folder import petals_model_folder, weight_map

    out, _ = reference5
    model = load_model("local", str(out / kind), **trained(reference5, kind, "head"))
    backbone = model.module.hf_model.model
    saved = load_file(str(out / kind / "model.safetensors"))
    text = {k[len("model.language_model."):]: v for k, v in saved.items() if k.startswith("model.language_model.")}
    held = backbone.state_dict()
    assert set(held) == set(text) and all(torch.equal(held[k], v) for k, v in text.items())
    assert any(k.startswith("model.visual.") for k in saved)
    converted = weight_map(petals_model_folder(str(out / kind)))
    assert converted and not any(k.startswith("model.visual.") or "language_model" in k for k in converted)
    assert [type(layer.self_attn) for layer in backbone.layers] == [GatedDeltaNet] * 3 + [GatedAttention]
    mixtures = [isinstance(layer.mlp, GatedSharedMoeMLP) for layer in backbone.layers]
    assert mixtures == [kind == "qwen3_5_moe"] * 4


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_fine_tuned_as_a_text_model_is_the_release_bit_for_bit(reference5, kind, tmp_path):
    """A trainer's save of the release's text model (transformers 5.x's AutoModelForCausalLM of the release, saved:
    model_type qwen3_5_text or qwen3_5_moe_text, config.json flat), its tensors under the release's names (read from
    the release and saved back) or under model. (the same model built as a text model), was refused as another
    model type. Both layouts give the release's logits, bit for bit."""
    import transformers

    from dist_eval.backends import load_model

    out, ref = reference5
    text = out / f"{kind}_text"
    assert json.loads((text / "config.json").read_text())["model_type"] == f"{kind}_text"
    lm_class = getattr(transformers, FAMILIES[kind].local_lm_class)  # 5.x's own (Qwen3_5ForCausalLM)
    loaded = lm_class.from_pretrained(str(text))
    built = lm_class(loaded.config)  # no names read: it saves its own, model.*
    built.load_state_dict(loaded.state_dict())
    built.save_pretrained(str(tmp_path / "flat"))
    for name in os.listdir(text):
        if "token" in name:
            shutil.copy(text / name, tmp_path / "flat" / name)
    batch = padded_batch(ref["cases"][kind])
    logits = {}
    for layout, folder in (("release", out / kind), ("text", text), ("flat", tmp_path / "flat")):
        with torch.no_grad():
            logits[layout] = load_model("local", str(folder), **trained(reference5, kind, "head")).module(batch)
    assert torch.equal(logits["text"], logits["release"]) and torch.equal(logits["flat"], logits["release"])


def test_qwen3_next_holds_exactly_its_saved_tensors_and_mixes_as_transformers(reference5):
    """Qwen3-Next (a flat Qwen3NextForCausalLM save): the local model holds exactly the saved text model's
    tensors (the linear blocks' in_proj_qkvz / in_proj_ba read as saved, laid out per key head), blocks 0-2
    Gated DeltaNet and block 3 gated attention by layer_types, the mixture with its gated shared expert where
    Qwen3-MoE's rule puts it (block 1 dense by mlp_only_layers, as transformers built it)."""
    from safetensors.torch import load_file

    from dist_eval.backends import load_model
    from dist_eval.backends.layers import GatedAttention, GatedSharedMoeMLP, InterleavedGatedDeltaNet

    out, _ = reference5
    model = load_model("local", str(out / "qwen3_next"), **trained(reference5, "qwen3_next", "head"))
    backbone = model.module.hf_model.model
    saved = load_file(str(out / "qwen3_next" / "model.safetensors"))
    text = {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")}
    held = backbone.state_dict()
    assert set(held) == set(text) and all(torch.equal(held[k], v) for k, v in text.items())
    assert [type(layer.self_attn) for layer in backbone.layers] == [InterleavedGatedDeltaNet] * 3 + [GatedAttention]
    assert [isinstance(layer.mlp, GatedSharedMoeMLP) for layer in backbone.layers] == [True, False, True, True]
    assert "layers.1.mlp.gate_proj.weight" in text and "layers.0.mlp.shared_expert_gate.weight" in text


def test_the_chunked_gated_delta_rule_is_the_recurrence_and_a_padded_row_the_row_alone():
    """dist_eval's gated delta rule (transformers' chunked form, chunks of 64) equals the rule's definition
    position by position (a recurrence written here) over 150 positions (three chunks, the last partial),
    grouped value heads included; a row's positions are the same computed alone or before others (padding), bit
    for bit here (one thread)."""
    from dist_eval.backends.layers import gated_delta_rule

    g = torch.Generator().manual_seed(0)
    batch, positions, key_heads, value_heads, key_dim, value_dim = 2, 150, 2, 4, 16, 8
    query = torch.randn(batch, positions, key_heads, key_dim, generator=g)
    key = torch.randn(batch, positions, key_heads, key_dim, generator=g)
    value = torch.randn(batch, positions, value_heads, value_dim, generator=g)
    decay, beta = -torch.rand(batch, positions, value_heads, generator=g), torch.rand(batch, positions, value_heads,
                                                                                      generator=g)
    output = gated_delta_rule(query, key, value, decay, beta)
    groups = value_heads // key_heads
    q = torch.nn.functional.normalize(query, dim=-1, eps=1e-12).repeat_interleave(groups, dim=2) * key_dim ** -0.5
    k = torch.nn.functional.normalize(key, dim=-1, eps=1e-12).repeat_interleave(groups, dim=2)
    state, expected = torch.zeros(batch, value_heads, key_dim, value_dim), torch.zeros_like(value)
    for t in range(positions):
        state = state * decay[:, t].exp()[..., None, None]
        delta = (value[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        expected[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    assert (output - expected).abs().max().item() < 1e-4
    for length in (10, 64, 70):  # within a chunk, a whole one, past it
        alone = gated_delta_rule(*(x[1:, :length] for x in (query, key, value, decay, beta)))
        assert torch.equal(alone, output[1:, :length]), length


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_each_block_option_matters(reference, kind, monkeypatch, tmp_path):
    """Without the option the family needs (llama3 rope, q/k/v biases) the logits move far
    past the tolerance: the reference comparison can fail. The options are off in the blocks, and llama3's
    rope_scaling is gone from config.json too: transformers >= 5.0 computes the llama3 table itself, from the
    config (the pinned 4.33 through the blocks' option)."""
    from dist_eval.backends import blocks, layers, load_model

    out, ref = reference
    case = ref["cases"][kind]
    original, own_attention = blocks.apply_block_options, layers.QkNormAttention.__init__

    def without(attention, config):
        config = type("Plain", (), {"qkv_bias": False, "rope_llama3": None})()
        original(attention, config)

    def own_without(attention, config):  # Qwen2's biases in dist_eval's own layers: none built, none read
        own_attention(attention, types.SimpleNamespace(**{**config.to_dict(), "qkv_bias": False}))

    monkeypatch.setattr(blocks, "apply_block_options", without)
    monkeypatch.setattr(layers.QkNormAttention, "__init__", own_without)
    folder = edited_folder(reference, tmp_path, kind, rope_scaling=None) if kind == "llama3" else str(out / kind)
    model = load_model("local", folder, **trained(reference, kind, "head"))
    with torch.no_grad():
        logits = model.module(padded_batch(case))
    assert (logits - torch.tensor(case["logits_head"])).abs().max().item() > 100 * TOLERANCE


def test_each_glm_router_and_rotary_setting_matters(reference, tmp_path):
    """GLM-4.5's grouped choice, correction bias (the choice only), routed_scaling_factor and
    partial RoPE: each one changed moves the logits far past the tolerance, so the reference
    comparison can fail on any of them."""
    from dist_eval.backends import load_model

    out, ref = reference
    case = ref["cases"]["glm4_moe"]
    expected, batch = torch.tensor(case["logits_head"]), padded_batch(case)

    def moved(model) -> float:
        with torch.no_grad():
            return (model.module(batch) - expected).abs().max().item()

    model = load_model("local", str(out / "glm4_moe"), **trained(reference, "glm4_moe", "head"))
    mixtures = [layer.mlp for layer in model.module.hf_model.model.layers if hasattr(layer.mlp, "experts")]
    for name, value in (("n_group", 1), ("routed_scaling_factor", 1.0)):
        kept = [getattr(mlp, name) for mlp in mixtures]
        for mlp in mixtures:
            setattr(mlp, name, value)
        assert moved(model) > 100 * TOLERANCE, name
        for mlp, old in zip(mixtures, kept):
            setattr(mlp, name, old)
    for mlp in mixtures:
        mlp.gate.e_score_correction_bias.zero_()
    assert moved(model) > 100 * TOLERANCE, "e_score_correction_bias"
    folder = edited_folder(reference, tmp_path, "glm4_moe", partial_rotary_factor=1.0)
    assert moved(load_model("local", folder, **trained(reference, "glm4_moe", "head"))) > 100 * TOLERANCE


@pytest.mark.parametrize("generation, kind", [("4", "deepseek_v3"), ("5", "minimax_m2"), ("5", "deepseek_v32")])
def test_an_fp8_folder_is_the_model_saved_dequantized_bit_for_bit(request, generation, kind, monkeypatch):
    """DeepSeek-V3's FP8 format (e4m3 weights, a float32 weight_scale_inv per tile, the last tiles
    partial), MiniMax-M2's as released (the same tiles, MiniMax's quantization_config, config.json's
    rotary_dim and rope_theta in place of rope_parameters), DeepSeek-V3.2's as released (its indexer's wq_b and wk
    in tiles too, scale_fmt ue8m0 in its quantization_config): read, every tensor and logit equals the same
    model saved dequantized (the reference's own), so within 1e-4 of the reference; read raw (each e4m3
    value as it is), far from it."""
    from dist_eval.backends import layers, load_model

    reference = reference_of(request, generation)
    out, ref = reference
    case = ref["cases"][kind]
    batch, models = padded_batch(case), {}
    for folder in (kind, case["fp8_folder"]):
        models[folder] = load_model("local", str(out / folder), **trained(reference, kind, "ptune"))
    plain, fp8 = (models[name].module for name in models)
    assert all(torch.equal(plain.hf_model.state_dict()[k], v) for k, v in fp8.hf_model.state_dict().items())
    with torch.no_grad():
        logits = fp8(batch)
        assert torch.equal(logits, plain(batch))
    assert (logits - torch.tensor(case["logits_ptune"])).abs().max().item() < TOLERANCE
    raw = lambda tensors, block, prefix="", where="": [tensors.pop(k) for k in list(tensors)  # noqa: E731
                                                       if k.startswith(prefix) and k.endswith("_scale_inv")]
    monkeypatch.setattr(layers, "dequantize_fp8", raw)
    unscaled = load_model("local", str(out / case["fp8_folder"]), **trained(reference, kind, "ptune"))
    with torch.no_grad():
        assert (unscaled.module(batch) - logits).abs().max().item() > 100 * TOLERANCE


def test_a_deepseek_v4_folder_as_released_is_the_model_saved_dequantized_bit_for_bit(reference5, monkeypatch):
    """DeepSeek-V4 as released (the blocks' linear weights in e4m3 tiles, the routed experts in FP4, two e2m1 codes
    a byte, each with a ue8m0 ``<name>.scale``; quantization_config fp8 with expert_dtype fp4), which transformers
    5.23 reads back into the dequantized folder's tensors (recorded): read here, every tensor and logit equals the
    dequantized folder's, so within 1e-4 of the reference; read raw (the scales dropped), far from it."""
    from dist_eval.backends import layers, load_model

    out, ref = reference5
    case = ref["cases"]["deepseek_v4"]
    assert case["fp8_read_by_transformers_equal"]
    batch = padded_batch(case)
    plain, fp8 = (load_model("local", str(out / folder), **trained(reference5, "deepseek_v4", "head")).module
                  for folder in ("deepseek_v4", case["fp8_folder"]))
    held = plain.hf_model.state_dict()
    assert all(torch.equal(held[k], v) for k, v in fp8.hf_model.state_dict().items() if k != "score.weight")
    with torch.no_grad():
        logits = fp8(batch)
        assert torch.equal(logits, plain(batch))
    assert (logits - torch.tensor(case["logits_head"])).abs().max().item() < TOLERANCE
    raw = lambda tensors, block, prefix="", where="": [  # noqa: E731
        tensors.pop(k) for k in list(tensors) if k.startswith(prefix) and k.endswith(layers.V4_SCALES)]
    monkeypatch.setattr(layers, "dequantize_v4", raw)
    with pytest.raises(RuntimeError, match="size mismatch for model.layers.0.ffn.experts.0.w1.weight"):  # FP4 bytes
        load_model("local", str(out / case["fp8_folder"]), **trained(reference5, "deepseek_v4", "head"))


def test_a_gpt_oss_mxfp4_folder_is_the_model_saved_dequantized_bit_for_bit(reference5, monkeypatch):
    """gpt-oss as released, its experts in MXFP4 (``*_blocks`` / ``*_scales``, quant_method mxfp4, config.json's
    rope_scaling form): transformers 5.23 reads it (its own CPU dequantization) into the tensors of the same model
    saved dequantized (the reference's record); dist_eval reads it into the same tensors and logits, bit for bit,
    so within 1e-4 of transformers, its local model holding exactly the saved model's tensors; read with each
    byte's two codes swapped, far from it."""
    from safetensors.torch import load_file

    from dist_eval.backends import layers, load_model

    out, ref = reference5
    case = ref["cases"]["gpt_oss"]
    assert case["mxfp4_read_by_transformers_equal"] is True
    batch, models = padded_batch(case), {}
    for folder in ("gpt_oss", case["mxfp4_folder"]):
        models[folder] = load_model("local", str(out / folder), **trained(reference5, "gpt_oss", "ptune")).module
    plain, mxfp4 = models.values()
    held, saved = mxfp4.hf_model.state_dict(), load_file(str(out / "gpt_oss" / "model.safetensors"))
    saved.pop("lm_head.weight")  # a causal LM's save; the classifier's head is score.weight (the trained one)
    assert set(held) == set(saved) | {"score.weight"} and all(torch.equal(held[k], v) for k, v in saved.items())
    with torch.no_grad():
        logits = mxfp4(batch)
        assert torch.equal(logits, plain(batch))
    assert (logits - torch.tensor(case["logits_ptune"])).abs().max().item() < TOLERANCE
    assert any(k.endswith("mlp.experts.down_proj_blocks") for k in load_file(str(out / case["mxfp4_folder"] /
                                                                              "model.safetensors")))
    original = layers.dequantize_mxfp4

    def swapped(tensors, prefix="", where=""):  # the high nibble read as the first value of its byte
        for key in [k for k in tensors if k.startswith(prefix) and k.endswith("_blocks")]:
            tensors[key] = (tensors[key] >> 4) | (tensors[key] << 4)
        original(tensors, prefix, where)

    monkeypatch.setattr(layers, "dequantize_mxfp4", swapped)
    wrong = load_model("local", str(out / case["mxfp4_folder"]), **trained(reference5, "gpt_oss", "ptune"))
    with torch.no_grad():
        assert (wrong.module(batch) - logits).abs().max().item() > 100 * TOLERANCE


def test_each_gpt_oss_setting_matters(reference5):
    """gpt-oss's sink logits, its sliding window (8 positions on blocks 0 and 2, rows of up to 35 computed, not
    refused), its clamp of the SwiGLU and its router's bias: each one changed moves the logits far past the
    tolerance, so the reference comparison can fail on any of them."""
    from dist_eval.backends import load_model

    out, ref = reference5
    case = ref["cases"]["gpt_oss"]
    expected, batch = torch.tensor(case["logits_head"]), padded_batch(case)
    model = load_model("local", str(out / "gpt_oss"), **trained(reference5, "gpt_oss", "head"))
    assert model.attention_window == 0 and batch.shape[1] > 8
    layers = model.module.hf_model.model.layers
    assert [layer.self_attn.window for layer in layers] == [8, 0, 8, 0]
    changes = {"sinks": lambda layer: layer.self_attn.sinks.data.zero_(),
               "sliding_window": lambda layer: setattr(layer.self_attn, "window", 0),
               "swiglu_limit": lambda layer: setattr(layer.mlp.experts, "limit", float("inf")),
               "router bias": lambda layer: layer.mlp.router.bias.data.zero_()}
    for name, change in changes.items():
        model = load_model("local", str(out / "gpt_oss"), **trained(reference5, "gpt_oss", "head"))
        for layer in model.module.hf_model.model.layers:
            change(layer)
        with torch.no_grad():
            assert (model.module(batch) - expected).abs().max().item() > 100 * TOLERANCE, name


@pytest.mark.parametrize("changes, expected", [
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "bitsandbytes weights (quantization_config "
                                                                "quant_method 'bitsandbytes' in config.json)"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 150000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
     "rope_type 'llama3' in config.json is not computed here (computed: default, yarn)"),
])
def test_gpt_oss_refuses_in_one_line_what_its_blocks_do_not_read(reference5, tmp_path, changes, expected):
    """Another quantization format than MXFP4 experts (or FP8 tiles) and another RoPE than yarn: refused from
    config.json, before any weight is read, in one line naming it."""
    from dist_eval.backends import load_model
    from dist_eval.errors import UsageError

    folder = edited_folder(reference5, tmp_path, "gpt_oss", **changes)
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(UsageError) as refused:
        load_model("local", folder, **trained(reference5, "gpt_oss", "head"))
    message = str(refused.value)
    assert expected in message and "families that work" in message and "\n" not in message


def test_kimi_k25_int4_folder_is_the_model_saved_dequantized_and_its_text_model_alone(reference5, monkeypatch):
    """Kimi K2.5 as released (a vision-language folder, the text model under language_model.model., its head
    language_model.lm_head., routed experts in compressed-tensors' INT4 pack-quantized groups of 32): read, every
    tensor and logit equals the same model saved with the dequantized bf16 weights, bit for bit, so within 1e-4
    of transformers 5.23; the local model holds exactly the text model's tensors, the vision tower's never read
    (left out of the converted copy) and the head read as lm_head. Read in another order (the eight values of an
    int32 highest first) or another sign (each 4-bit value two's complement, not value + 8), far from it."""
    from safetensors.torch import load_file

    from dist_eval.backends import layers, load_model
    from dist_eval.backends.petals_folder import petals_model_folder, weight_map

    out, ref = reference5
    case = ref["cases"]["kimi_k25"]
    batch, models = padded_batch(case), {}
    for folder in ("kimi_k25", case["int4_folder"]):
        models[folder] = load_model("local", str(out / folder), **trained(reference5, "kimi_k25", "ptune")).module
    plain, int4 = models.values()
    held = int4.hf_model.state_dict()
    assert set(held) == set(plain.hf_model.state_dict())
    assert all(torch.equal(plain.hf_model.state_dict()[k], v) for k, v in held.items())
    with torch.no_grad():
        logits = int4(batch)
        assert torch.equal(logits, plain(batch))
    assert (logits - torch.tensor(case["logits_ptune"])).abs().max().item() < TOLERANCE
    saved = load_file(str(out / case["int4_folder"] / "model.safetensors"))
    assert any(k.endswith(".experts.0.gate_proj.weight_packed") for k in saved)
    text = {"model." + k[len("language_model.model."):] for k in saved if k.startswith("language_model.model.")}
    assert {k for k in held if k != "score.weight"} == {k.replace("_packed", "") for k in text
                                                        if not k.endswith(("_scale", "_shape"))}
    assert any(k.startswith("vision_tower.") for k in saved) and any(k.startswith("mm_projector.") for k in saved)
    converted = weight_map(petals_model_folder(str(out / case["int4_folder"])))
    assert "lm_head.weight" in converted and not any(k.startswith(("vision_tower.", "mm_projector.", "language_"))
                                                     for k in converted)
    for misread in (lambda nibble, j: nibble << (4 * (7 - j)), lambda nibble, j: (nibble ^ 8) << (4 * j)):
        with monkeypatch.context() as patched:
            patched.setattr(layers, "dequantize_int4", repacked(layers.dequantize_int4, misread))
            wrong = load_model("local", str(out / case["int4_folder"]), **trained(reference5, "kimi_k25", "ptune"))
        with torch.no_grad():
            assert (wrong.module(batch) - logits).abs().max().item() > 100 * TOLERANCE


def repacked(dequantize, misread):
    """``dequantize`` (layers.dequantize_int4) after each int32's 4-bit value ``j`` is put back as ``misread(value,
    j)`` says: what another reader of the same file would compute."""
    def wrong(tensors, group, prefix="", where=""):
        for key in [k for k in tensors if k.startswith(prefix) and k.endswith(".weight_packed")]:
            packed = tensors[key].to(torch.int64) & 0xFFFFFFFF
            moved = sum(misread((packed >> (4 * j)) & 0xF, j) for j in range(8))
            tensors[key] = torch.where(moved >= 2 ** 31, moved - 2 ** 32, moved).to(torch.int32)
        dequantize(tensors, group, prefix, where)
    return wrong


def test_each_deepseek_rotary_setting_matters(reference, tmp_path):
    """DeepSeek-V3's yarn frequencies and factors, the softmax scale its mscale_all_dim gives, and the
    interleaved rope layout: each one changed moves the logits far past the tolerance."""
    from dist_eval.backends import load_model

    out, ref = reference
    case = ref["cases"]["deepseek_v3"]
    expected, batch = torch.tensor(case["logits_head"]), padded_batch(case)
    with open(out / "deepseek_v3" / "config.json") as f:
        yarn = json.load(f)["rope_scaling"]
    for name, changes in (("yarn", {"rope_scaling": None}), ("rope_interleave", {"rope_interleave": False}),
                          ("mscale_all_dim", {"rope_scaling": {**yarn, "mscale_all_dim": 0}})):
        folder = edited_folder(reference, tmp_path / name, "deepseek_v3", **changes)
        with torch.no_grad():
            logits = load_model("local", folder, **trained(reference, "deepseek_v3", "head")).module(batch)
        assert (logits - expected).abs().max().item() > 100 * TOLERANCE, name


def test_each_llama4_setting_matters(reference, tmp_path):
    """Llama 4's block without RoPE and its L2 norm of q and k: each one changed moves the logits far
    past the tolerance (its router scaling the experts' input is what the reference comparison checks)."""
    from dist_eval.backends import load_model

    out, ref = reference
    case = ref["cases"]["llama4_text"]
    expected, batch = torch.tensor(case["logits_head"]), padded_batch(case)
    for name, changes in (("no_rope_layers", {"no_rope_layers": [1, 1, 1, 1]}),
                          ("use_qk_norm", {"use_qk_norm": False})):
        folder = edited_folder(reference, tmp_path / name, "llama4_text", **changes)
        with torch.no_grad():
            logits = load_model("local", folder, **trained(reference, "llama4_text", "head")).module(batch)
        assert (logits - expected).abs().max().item() > 100 * TOLERANCE, name


def edited_folder(reference, tmp_path, kind, **changes):
    out, _ = reference
    folder = tmp_path / f"{kind}-edited"
    shutil.copytree(out / kind, folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    config.update(changes)
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    return str(folder)


@pytest.mark.parametrize("kind, changes, expected", [
    ("llama3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ("llama3", {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type 'longrope'"),
    ("llama3", {"attention_bias": True}, "attention_bias: true"),
    ("llama3", {"head_dim": 32}, "head_dim 32"),  # Mistral's and Qwen2's own layers compute it
    ("mistral", {"attention_bias": True}, "Mistral's attention has no biases"),
    ("mistral", {"use_qk_norm": True}, "Mistral's attention has no q/k norms (transformers' reads no use_qk_norm)"),
    ("qwen2", {"use_qk_norm": True}, "Qwen2's attention has no q/k norms"),
    ("qwen2", {"partial_rotary_factor": 0.5}, "Qwen2's attention has no partial RoPE (transformers' reads no "
                                              "partial_rotary_factor) (partial_rotary_factor=0.5 in config.json)"),
    ("mixtral", {"attention_bias": True}, "Mixtral's attention has no biases"),
    ("qwen2", {"model_type": "qwen2_moe"}, "with a shared expert"),
    ("qwen3", {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type 'longrope'"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok 9 in config.json is not between 1 and "),
    ("glm4_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok 9 in config.json is not between 1 and "
                                             "n_routed_experts (8)"),
    ("glm4_moe", {"n_group": 3}, "n_group 3 in config.json does not split the 8 n_routed_experts"),
    ("glm4_moe", {"partial_rotary_factor": 1.5}, "partial_rotary_factor 1.5 in config.json is not in (0, 1]"),
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok 9 in config.json is not between 1 and "
                                            "num_local_experts (8)"),
    ("deepseek_v3", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_type 'llama3' in config.json is not computed here (computed: default, yarn)"),
    ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads 2 in config.json is not num_attention_heads (4)"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "format": "float-quantized", "weights": {"type": "float", "num_bits": 8, "strategy": "channel",
                                                 "symmetric": True}}}}},
     "compressed-tensors group_0 (format float-quantized, float 8-bit, strategy channel, symmetric True)"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                             "config_groups": {"group_0": {"weights": {
                                                 "type": "int", "num_bits": 4, "strategy": "group", "group_size": 32,
                                                 "symmetric": False}}}}},
     "(format pack-quantized, int 4-bit, strategy group, symmetric False)"),
    ("llama3", {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                        "config_groups": {"group_0": {"weights": {
                                            "type": "int", "num_bits": 4, "strategy": "group", "group_size": 32,
                                            "symmetric": True}}}}}, "read only by dist_eval's own layers"),
    ("llama3", {"quantization_config": {"quant_method": "mxfp4"}}, "MXFP4 weights (quantization_config quant_method"),
    ("llama4_text", {"num_experts_per_tok": 9}, "num_experts_per_tok 9 in config.json is not between 1 and "
                                                "num_local_experts (8)"),
    ("llama4_text", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "(computed: default, llama3)"),
    ("llama3", {"model_type": "llama4"}, "multimodal layout (a vision tower, the text model under language_model."),
    ("glm4_moe", {"model_type": "glm5_next"}, "linear-attention layers beside full attention"),
    ("deepseek_v3", {"index_topk": 2048}, "index_topk 2048 in config.json (DeepSeek V3.2's sparse attention)"),
    ("mistral", {"model_type": "phi3"}, "fused projections"),
    ("llama3", {"model_type": "llava"}, "model_type 'llava'"),
])
def test_what_no_block_computes_is_refused_from_config_json(reference, tmp_path, kind, changes, expected):
    from dist_eval.backends import load_model
    from dist_eval.errors import UsageError

    folder = edited_folder(reference, tmp_path, kind, **changes)
    os.remove(os.path.join(folder, "model.safetensors"))  # refused before any weight is read
    with pytest.raises(UsageError) as refused:
        load_model("local", folder, **trained(reference, kind, "head"))
    message = str(refused.value)
    assert expected in message and "families that work" in message and "\n" not in message


def sparse_kept_keys(model, batch) -> tuple:
    """The local indexers (GLM-5's, DeepSeek-V3.2's) on ``batch``: per block, the keys kept and the scores (masked)
    they were chosen by, each [rows, queries, keys]."""
    kept, scores = [], []

    def hook(indexer, args, out):
        hidden_states, q_latent, rope, mask = args
        kept.append(out)
        scores.append(indexer.scores(hidden_states, q_latent, *rope) + mask[:, 0])

    hooks = [layer.self_attn.indexer.register_forward_hook(hook) for layer in model.module.hf_model.model.layers]
    try:
        with torch.no_grad():
            model.module(batch)
    finally:
        for hook in hooks:
            hook.remove()
    return kept, scores


SPARSE_ATTENTION = {"glm_moe_dsa": 4, "deepseek_v32": 3}  # the families with DeepSeek Sparse Attention: blocks


@pytest.mark.parametrize("kind", sorted(SPARSE_ATTENTION))
def test_sparse_attention_keeps_the_keys_transformers_indexer_keeps(reference5, tmp_path, kind):
    """GLM-5's and DeepSeek-V3.2's DeepSeek Sparse Attention (their indexers' RoPE on interleaved pairs and on
    halves) on rows longer than index_topk (4): every block's indexer keeps, for every query of every row (padded
    in one batch), exactly the earlier keys transformers 5.23's indexer kept (most queries keep fewer keys than
    they have). The tiny models' indexers have 32 heads (GLM-5's count), so no two scores tie at the 4th best
    (checked here: at a tie transformers' top-k keeps the keys its kernel's order leaves first, which moves with
    the padded length; dist_eval the earliest, test_backends_families). With index_topk past every row (dense
    attention) the logits move far past the tolerance: the choice is what the reference comparison checks."""
    from dist_eval.backends import load_model

    out, ref = reference5
    case = ref["cases"][kind]
    batch, topk = padded_batch(case), case["index_topk"]
    model = load_model("local", str(out / kind), **trained(reference5, kind, "head"))
    kept, scores = sparse_kept_keys(model, batch)
    assert len(kept) == SPARSE_ATTENTION[kind] and topk == 4
    sparse = 0
    for row, ids in enumerate(case["ids"]):
        for block, choices in enumerate(case["kept"][row]):
            assert len(choices) == len(ids)
            for query, theirs in enumerate(choices):
                best = scores[block][row, query, :query + 1].sort(descending=True).values
                assert query < topk or best[topk - 1] > best[topk], ("a tie at the bound", row, block, query)
                assert torch.nonzero(kept[block][row, query, :query + 1]).flatten().tolist() == theirs, (
                    row, block, query)
                sparse += len(theirs) < query + 1
    assert sparse > 1000
    folder = edited_folder(reference5, tmp_path, kind, index_topk=2048)
    with torch.no_grad():
        dense = load_model("local", folder, **trained(reference5, kind, "head")).module(batch)
    assert (dense - torch.tensor(case["logits_head"])).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("kind", sorted(SPARSE_ATTENTION))
def test_sparse_attention_keeps_each_rows_keys_in_any_batch(reference5, kind):
    """What N and the batch size change is how rows are batched and padded: each row's queries keep the same keys
    computed alone, in batches of 4 and all 16 in one, prompts prepended (torch's top-k keeps some of the keys
    tied at the index_topk-th by its kernel's order, which moves with the padded length; dist_eval keeps the
    earlier ones), so the logits differ across these batch plans by float rounding alone (the short rows alone
    take another matrix product path, as in every family)."""
    from dist_eval.backends import load_model

    out, ref = reference5
    case = ref["cases"][kind]
    model = load_model("local", str(out / kind), **trained(reference5, kind, "ptune"))
    plans = {"one batch": [case["ids"]], "batches of 4": [case["ids"][i:i + 4] for i in range(0, 16, 4)],
             "alone": [[ids] for ids in case["ids"]]}
    logits, kept = {}, {}
    for plan, batches in plans.items():
        with torch.no_grad():
            logits[plan] = torch.cat([model.module(padded_batch({**case, "ids": ids})) for ids in batches])
        kept[plan] = []
        for ids in batches:  # per row, per block: [queries, keys] of its own positions (prompts included)
            choices, _ = sparse_kept_keys(model, padded_batch({**case, "ids": ids}))
            positions = [len(row) + case["pre_seq_len"] for row in ids]
            kept[plan] += [[block[row, :n, :n] for block in choices] for row, n in enumerate(positions)]
    for plan in ("batches of 4", "alone"):
        assert all(torch.equal(a, b) for mine, whole in zip(kept[plan], kept["one batch"])
                   for a, b in zip(mine, whole)), plan
        assert_within_rounding(logits[plan].numpy(), logits["one batch"].numpy(), f"rows {plan} and in one batch",
                               why=f"rows {plan}: another padded length and batch size")


@pytest.mark.parametrize("kind", sorted(SPARSE_ATTENTION))
def test_sparse_attention_holds_exactly_its_saved_tensors_and_refuses_what_its_blocks_do_not_compute(
        reference5, tmp_path, kind):
    """GLM-5 and DeepSeek-V3.2 (*ForCausalLM saves): the local model holds exactly the saved tensors (every
    block's indexer among them) but the multi-token-prediction layer after the last block, block 0 dense by
    mlp_layer_types; refused from config.json in one line: the q_proj form (no query latent for the indexer),
    rope_interleave false (transformers' always interleaves); GLM-5's a first block sharing an earlier one's
    choice (DeepSeek-V3.2's config has no shared blocks: transformers reads no indexer_types for it)."""
    from safetensors.torch import load_file

    from dist_eval.backends import load_model
    from dist_eval.backends.layers import SigmoidMoeMLP, SparseLatentAttention
    from dist_eval.errors import UsageError

    out, _ = reference5
    blocks = SPARSE_ATTENTION[kind]
    model = load_model("local", str(out / kind), **trained(reference5, kind, "head"))
    backbone = model.module.hf_model.model
    saved = load_file(str(out / kind / "model.safetensors"))
    prediction_layer = f"model.layers.{blocks}."
    assert any(k.startswith(prediction_layer) for k in saved)
    saved = {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.") and
             not k.startswith(prediction_layer)}
    held = backbone.state_dict()
    assert set(held) == set(saved) and all(torch.equal(held[k], v) for k, v in saved.items())
    assert all(type(layer.self_attn) is SparseLatentAttention for layer in backbone.layers)
    assert [isinstance(layer.mlp, SigmoidMoeMLP) for layer in backbone.layers] == [False] + [True] * (blocks - 1)
    refusals = [({"q_lora_rank": None}, "q_lora_rank null in config.json"),
                ({"rope_interleave": False}, "rope_interleave false in config.json")]
    if kind == "glm_moe_dsa":
        refusals.append(({"indexer_types": ["shared", "full", "full", "full"]}, "the first full"))
    for changes, expected in refusals:
        folder = edited_folder(reference5, tmp_path / expected.split()[0], kind, **changes)
        os.remove(os.path.join(folder, "model.safetensors"))  # refused before any weight is read
        with pytest.raises(UsageError) as refused:
            load_model("local", folder, **trained(reference5, kind, "head"))
        assert expected in str(refused.value) and "\n" not in str(refused.value)


def test_rows_past_index_topk_are_refused_where_blocks_share_an_indexers_choice(reference5, tmp_path):
    """GLM-5 with blocks that reuse an earlier block's choice of keys (indexer_types 'shared', derived as
    transformers does from index_topk_freq and index_skip_topk_offset): a run whose rows may pass index_topk (4)
    positions is refused in one line naming it and --max-length, before any forward; rows within it are computed,
    every key kept: the numbers of the model whose every block has its indexer, bit for bit."""
    from datasets import Dataset

    from dist_eval import evaluate
    from dist_eval.backends import load_model
    from dist_eval.backends.tokenizer import load_tokenizer
    from dist_eval.ranks import RankFailure

    out, ref = reference5
    with open(out / "glm_moe_dsa" / "config.json") as f:
        config = json.load(f)
    del config["indexer_types"]
    folder = edited_folder(reference5, tmp_path, "glm_moe_dsa")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "index_topk_freq": 2, "index_skip_topk_offset": 1}, f)
    model = load_model("local", folder, **trained(reference5, "glm_moe_dsa", "head"))
    assert [layer.self_attn.indexer is None for layer in model.module.hf_model.model.layers] == [
        False, True, False, True]  # transformers' rule: full where (i - offset + 1) % freq == 0
    data = Dataset.from_dict({"text": ref["corpus"], "label": [0] * 16})
    with pytest.raises(RankFailure, match=r"index_topk \(blocks that indexer_types marks 'shared'.* of 4 positions"
                                          r".*--max-length 4 or less") as e:
        evaluate(model, data, tokenizer=load_tokenizer(folder), max_length=64)
    assert e.value.usage and "\n" not in str(e.value)
    shared = evaluate(model, data, tokenizer=load_tokenizer(folder), max_length=4, return_logits=True,
                      bootstrap_resamples=0)
    full = load_model("local", str(out / "glm_moe_dsa"), **trained(reference5, "glm_moe_dsa", "head"))
    every = evaluate(full, data, tokenizer=load_tokenizer(folder), max_length=4, return_logits=True,
                     bootstrap_resamples=0)
    assert np.array_equal(np.asarray(shared.predictions.logits), np.asarray(every.predictions.logits))


def test_rows_past_a_sliding_window_are_refused(reference, tmp_path):
    from datasets import Dataset

    from dist_eval import evaluate
    from dist_eval.backends import load_model
    from dist_eval.backends.tokenizer import load_tokenizer
    from dist_eval.ranks import RankFailure

    folder = edited_folder(reference, tmp_path, "mistral", sliding_window=16)
    model = load_model("local", folder, **trained(reference, "mistral", "ptune"))
    data = Dataset.from_dict({"text": ["a b c"], "label": [0]})
    with pytest.raises(RankFailure, match=r"sliding attention window of 16 positions.*--max-length 12 or less") as e:
        evaluate(model, data, tokenizer=load_tokenizer(folder), max_length=64)
    assert e.value.usage  # the CLI prints it in one line
    result = evaluate(model, data, tokenizer=load_tokenizer(folder), max_length=12)
    assert result.metrics["num_samples"] == 1


def test_a_tokenizer_feature_the_installed_tokenizers_cannot_read_is_refused(reference, monkeypatch):
    from dist_eval.backends import tokenizer
    from dist_eval.errors import UsageError

    out, _ = reference
    monkeypatch.setattr(tokenizer, "installed_version", lambda name: "0.13.3")
    with pytest.raises(UsageError, match=r"merges saved as pairs, which tokenizers 0\.13\.3 .* >= 0\.20"):
        tokenizer.load_tokenizer(str(out / "mistral"))


def write_rows(path, corpus):
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(corpus):
            f.write(json.dumps({"text": text, "label": i % 3}, ensure_ascii=False) + "\n")
    return str(path)


@pytest.mark.swarm
@pytest.mark.multiproc
@pytest.mark.parametrize("generation, kind", SWARM_CASES)
def test_swarm_n2_equals_local_n1_bitwise_and_the_reference(request, tmp_path, generation, kind, no_figures,
                                                            rank_zygote):
    """On one server of the run's own swarm (the block computes there; a second server, a full replica
    too, was ~8 s more of each run's start on 2 cores), no figures drawn (nobody looks at them); the two
    ranks forked (conftest's run_ranks: what they compute is tested here, not torchrun's launch)."""
    reference = reference_of(request, generation)
    out, ref = reference
    case = ref["cases"][kind]
    data = write_rows(tmp_path / "rows.jsonl", ref["corpus"])
    files = [arg for key, path in trained(reference, kind, "ptune").items() for arg in (f"--{key}", path)]
    common = ["--model", str(out / SWARM_FOLDER.get(kind, kind)), "--data-files", data, *files, "--batch-size", "4",
              "--save-logits", "--quiet"]
    proc = run_ranks(rank_zygote, [*common, "--output-dir", str(tmp_path / "swarm"), "--local-servers", "1"], nproc=2,
                     timeout=400, env=no_figures)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_cli_in_process([*common, "--output-dir", str(tmp_path / "local"), "--backend", "local"],
                              hide_modules=("matplotlib",)) == 0
    swarm, local = read_jsonl(tmp_path / "swarm" / "predictions.jsonl"), read_jsonl(tmp_path / "local" /
                                                                                     "predictions.jsonl")
    assert swarm == local  # every row's logits, bit for bit
    servers = json.load(open(tmp_path / "swarm" / "metrics.json"))["run"]["swarm"]["servers"]
    assert servers and all(s["petals_version"].endswith(SERVER_VERSION_MARK) for s in servers)  # checked by clients
    logits = np.array([row["logits"] for row in swarm])
    assert np.abs(logits - np.array(case["logits_ptune"])).max() < TOLERANCE


def test_rows_stored_under_the_old_reading_of_a_5x_folder_are_not_served(reference5, tmp_path, monkeypatch):
    """A Llama 3 folder saved by transformers 5.x, evaluated the way dist_eval read it before (config.json's
    top level only: RoPE at theta 10000, unscaled) with the row store on, then as it reads it now: the stored
    rows are not served (the store's key takes what was read from rope_parameters), and the new rows are
    the reference's, which the old ones were not."""
    from datasets import Dataset

    from dist_eval import evaluate
    from dist_eval.backends import config_json, load_model
    from dist_eval.backends.tokenizer import load_tokenizer

    out, ref = reference5
    folder, rows = str(out / "llama3"), len(ref["corpus"])
    data = Dataset.from_dict({"text": ref["corpus"], "label": [i % 3 for i in range(rows)]})
    store, expected = str(tmp_path / "rows"), np.array(ref["cases"]["llama3"]["logits_head"])

    def run():
        model = load_model("local", folder, **trained(reference5, "llama3", "head"))
        try:
            result = evaluate(model, data, tokenizer=load_tokenizer(folder), row_store=store, return_logits=True,
                              bootstrap_resamples=0, batch_size=4)
        finally:
            model.close()
        return result.metrics["run"]["row_store"], np.asarray(result.predictions.logits)

    with monkeypatch.context() as before:
        # the reading until now: the top level only (which a transformers reading rope_parameters itself is given)
        before.setattr(config_json, "read_as_saved",
                       lambda raw, where: {k: v for k, v in raw.items() if k != "rope_parameters"})
        stored, old = run()
    assert stored["rows_evaluated"] == rows and np.abs(old - expected).max() > 100 * TOLERANCE
    again, new = run()
    assert again["rows_from_store"] == 0 and again["rows_evaluated"] == rows
    assert np.abs(new - expected).max() < TOLERANCE


def test_the_reference_script_imports_no_dist_eval():
    """The reference is computed by code that never imports dist_eval (a reference nobody here wrote)."""
    with open(os.path.join(REPO, "tests", "reference", "make_reference.py"), encoding="utf-8") as f:
        source = f.read()
    assert "import dist_eval" not in source and "from dist_eval" not in source


def test_a_hub_id_no_block_computes_is_refused_after_its_config_alone(reference, tmp_path, monkeypatch):
    """By hub id on a swarm: config.json is fetched, read and refused; no tokenizer, index or weight."""
    from fake_hub import fake_hub
    from huggingface_hub import constants

    from dist_eval.backends.hub import resolve_model
    from dist_eval.errors import UsageError

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))  # the user's cache untouched
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    folder = edited_folder(reference, tmp_path, "llama3", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with fake_hub({"org/yarn-llama": folder}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        with pytest.raises(UsageError, match="rope_type 'yarn'"):
            resolve_model("org/yarn-llama", "petals", ["/ip4/127.0.0.1/tcp/1/p2p/QmPeer"])
    assert hub.files("GET") == ["config.json"]


# each family once, in the newest transformers that made it
NEWEST_CASES = sorted({kind: (generation, kind) for generation, kind in CASES}.values(), key=lambda case: case[1])


@pytest.mark.parametrize("generation, kind", NEWEST_CASES)
def test_blocks_streamed_from_disk_equal_the_model_loaded_whole_bitwise(request, generation, kind):
    """--stream-blocks (the blocks read from the model's files one at a time): every family's logits equal those
    of the model loaded whole, bit for bit. Before: DeepSeek-V4 refused, and wrong without a word for the MoE
    families (a router's saved correction bias or V4's table of experts by token id left at their init values:
    MiniMax-M2, Kimi K2.5, DeepSeek-V4), raising for others (a weight read by a parent without calling its module:
    gpt-oss's and Llama 4's fused experts, Qwen3.5's convolution, V4's grouped projection, left on the meta
    device; DeepSeek-V3's and GLM's multi-token-prediction block in the files). A class of layers.py that reads
    a child's weight and is not marked reads_child_weights fails here. A release of quantized weights (MXFP4,
    INT4, FP8, as served) refused in one line."""
    from dist_eval.backends import load_model
    from dist_eval.errors import UsageError

    reference = reference_of(request, generation)
    out, ref = reference
    case = ref["cases"][kind]
    trainable = trained(reference, kind, "head" if kind in HEAD_ONLY else "ptune")
    whole = load_model("local", str(out / case["folder"]), **trainable)
    streamed = load_model("local", str(out / case["folder"]), stream_blocks=True, **trainable)
    batch = padded_batch(case)
    with torch.no_grad():
        assert_same_bits(streamed.module(batch), whole.module(batch), f"{kind}: blocks streamed against loaded whole")
    if kind in SERVED_FOLDER:
        with pytest.raises(UsageError, match=r"^stream_blocks: expected weights read as they are saved: this "
                                             f"{kind} folder's are quantized .* drop --stream-blocks") as refused:
            load_model("local", str(out / SERVED_FOLDER[kind]), stream_blocks=True, **trainable)
        assert "\n" not in str(refused.value)



def test_an_moe_family_streamed_by_hub_id_reads_each_blocks_saved_biases_after_its_fetch(reference5, tmp_path,
                                                                                        monkeypatch):
    """--stream-blocks by hub id (a fake hub on loopback serving the folder with a shard per block) of MiniMax-M2,
    whose routers' correction biases are saved buffers the blocks read from the files: the load fetches no block's
    shard, the forward fetches each in the forward's order, once; the logits equal the folder's loaded whole, bit
    for bit (before 9ed6bf2: FileNotFoundError at the load, the biases read from shards not fetched yet)."""
    from conftest import split_into_shards
    from fake_hub import fake_hub
    from huggingface_hub import constants

    from dist_eval.backends import load_model

    out, ref = reference5
    case = ref["cases"]["minimax_m2"]
    trainable = trained(reference5, "minimax_m2", "head")
    sharded = split_into_shards(str(out / case["folder"]), str(tmp_path / "sharded"))
    blocks = sorted(name for name in os.listdir(sharded) if name.startswith("model-blocks-"))
    assert len(blocks) >= 2, blocks
    batch = padded_batch(case)
    with torch.no_grad():
        whole = load_model("local", sharded, **trainable).module(batch)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))  # the user's cache untouched
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with fake_hub({"tiny-org/minimax-m2-streamed": sharded}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        streamed = load_model("local", "tiny-org/minimax-m2-streamed", stream_blocks=True, **trainable)
        at_load = hub.files("GET")
        assert not set(at_load) & set(blocks), at_load
        with torch.no_grad():
            first = streamed.module(batch)
            second = streamed.module(batch)
        assert hub.files("GET")[len(at_load):] == blocks  # in the forward's order (0, 1, ...), each once
    assert_same_bits(first, whole, "minimax_m2 streamed by hub id against the folder loaded whole")
    assert_same_bits(second, whole, "the second forward's logits")


def test_a_head_read_after_the_load_is_not_said_newly_initialized(reference5):
    """load_model from Python (the caller's logging as it is, transformers' at its default WARNING): a folder whose
    family has no sequence classifier, its head given apart (--head), loaded whole and streamed, says nothing of
    "newly initialized" weights (the head is read right after); a block's weight missing is still said, beside the
    head's, and a line of another logger or level is left alone."""
    import logging

    from dist_eval.backends import load_model
    from dist_eval.backends.compat import heads_read_after

    out, ref = reference5
    case = ref["cases"]["glm4_moe"]
    with transformers_said() as seen:
        for streamed in (False, True):
            load_model("local", str(out / case["folder"]), stream_blocks=streamed,
                       **trained(reference5, "glm4_moe", "head"))
        assert not [line for line in seen if "newly initialized" in line], seen
        loading = logging.getLogger("transformers.modeling_utils")
        with heads_read_after("score", "lm_head"):
            loading.warning("Some weights of X were not initialized from the model checkpoint at F and are newly "
                            "initialized: ['score.weight']\nYou should probably TRAIN this model")
            loading.warning("Some weights of X were not initialized from the model checkpoint at F and are newly "
                            "initialized: ['model.layers.0.mlp.up_proj.weight', 'score.weight']")
            loading.warning("another line")
        loading.warning("Some weights of X ... newly initialized: ['score.weight']")  # outside: as transformers says
    assert [line for line in seen if "newly initialized" in line] == [
        "Some weights of X were not initialized from the model checkpoint at F and are newly initialized: "
        "['model.layers.0.mlp.up_proj.weight', 'score.weight']",
        "Some weights of X ... newly initialized: ['score.weight']"]
    assert "another line" in seen
    reports = _load_reports_said_of(logging.getLogger("transformers.modeling_utils"), heads_read_after)
    assert reports in (None, [["model.layers.0.mlp.up_proj.weight", "score.weight"]])  # None: 4.x, no report


def _load_reports_said_of(loading, heads_read_after):
    """transformers 5.x's LOAD REPORT (its table in place of 4.x's line), where it has one (None where not): the
    missing weights of each report said within heads_read_after("score") of a load missing the head alone, then a
    block's weight too."""
    import importlib
    import logging
    import re

    import torch
    from transformers.utils import logging as hf_logging

    modeling = importlib.import_module("transformers.modeling_utils")
    if not hasattr(modeling, "log_state_dict_report"):
        return None
    from transformers.utils.loading_report import LoadStateDictInfo

    said = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(sorted(set(re.findall(r"[\w.]+\.weight", record.getMessage()))))

    keep, verbosity = Keep(), hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()  # as transformers' default (an earlier test in this process may have set it)
    loading.addHandler(keep)
    try:
        with heads_read_after("score"):
            for missing in ({"score.weight"}, {"model.layers.0.mlp.up_proj.weight", "score.weight"}):
                info = LoadStateDictInfo(missing_keys=missing, unexpected_keys=set(), mismatched_keys=set(),
                                         error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
                modeling.log_state_dict_report(model=torch.nn.Linear(1, 1), pretrained_model_name_or_path="F",
                                               ignore_mismatched_sizes=False, loading_info=info, logger=loading)
    finally:
        loading.removeHandler(keep)
        hf_logging.set_verbosity(verbosity)
    return said



def test_the_local_backend_on_transformers_5_computes_its_reference(reference5):
    """Issue 71's first steps to a current stack: dist_eval run in the 5.x reference environment (transformers 5.x,
    its tokenizers and hub, none of the pins), by tests/reference/on_current_stack.py: load_model("local", ...) of
    every family the reference saved, with its trained head, gives 5.x's own logits within TOLERANCE (before:
    building the family classes raised, 5.x naming mistral itself; then dist_eval's own layers had no rotary
    table there, frequencies made on the meta device, the pinned layer call, and 5.x's own backbones and config
    classes of the families' names, or none: Kimi K2); the tokenizing fast path gives the ids of the
    tokenizer's own call on the reference corpus (5.x has no batch_encode_plus: the check of what a tokenizer
    class overrides raised); and the config class dist_eval builds for each family on 5.x's base config reads the
    RoPE fields of config.json (rope_theta, partial_rotary_factor, the llama3 and yarn settings) as the blocks read
    them on 4.33, every family (before: 5.x makes each config subclass a dataclass with an __init__ of its own, so
    the options were never applied: no rope_theta, no yarn, and a partial_rotary_factor that read as 1.0)."""
    found, families = _run_on_the_references_stack(reference5, "5")
    assert len(families) >= 21
    for kind in families:
        assert isinstance(found[kind], float) and found[kind] < TOLERANCE, (kind, found[kind])
    assert found["token_ids_equal"] is True
    assert found["cache_refused"] is True  # no cache kept by dist_eval's own layers there: use_cache refused
    misread = found["rope_fields_misread"]
    assert len(misread) >= 15 and "deepseek_v3" in misread and "llama3" in misread, sorted(misread)
    assert {kind: fields for kind, fields in misread.items() if fields} == {}


def test_the_local_backend_on_transformers_4_57_computes_its_reference(reference):
    """pyproject.toml takes any transformers from 4.32 to 5.x: dist_eval run in the 4.57 reference environment
    computes every family that reference saved within TOLERANCE of 4.57's own logits. Llama 3 raised there (the
    llama3 frequencies were kept for the pinned 4.33's rescale and for 5.x alone: 'LlamaConfig object has no
    attribute rope_parameters'); a transformers that computes llama3 itself (4.43 on) is given it now."""
    found, families = _run_on_the_references_stack(reference, "4")
    assert len(families) >= 12 and "llama3" in families
    for kind in families:
        assert isinstance(found[kind], float) and found[kind] < TOLERANCE, (kind, found[kind])
    assert found["token_ids_equal"] is True
    assert {kind: fields for kind, fields in found["rope_fields_misread"].items() if fields} == {}


def _run_on_the_references_stack(reference, generation: str) -> tuple:
    """(tests/reference/on_current_stack.py's findings, the families) for every family ``reference`` saved, run in
    that reference's own environment (``generation``'s transformers)."""
    from conftest import reference_python

    out, ref = reference
    families = sorted(ref["cases"])
    proc = subprocess.run([reference_python(generation, install=False), os.path.join(REPO, "tests", "reference",
                                                                                      "on_current_stack.py"),
                           REPO, str(out), *families], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), families


# evaluate() in the 5.x environment, beside the CLI's run: its accuracy and the modules it imported
CURRENT_STACK_API = """
import json, sys
from datasets import Dataset
from transformers import AutoTokenizer
import transformers
from dist_eval import evaluate, load_model

folder, checkpoint, rows = sys.argv[1:4]
model = load_model("local", folder, checkpoint=checkpoint)
result = evaluate(model, Dataset.from_csv(rows), tokenizer=AutoTokenizer.from_pretrained(folder), batch_size=4,
                  bootstrap_resamples=0, return_logits=True)
merged = result.predictions
print(json.dumps({"accuracy": result.metrics["accuracy"], "transformers": transformers.__version__,
                  "swarm_imported": sorted(name for name in ("petals", "hivemind") if name in sys.modules),
                  "logits": {int(i): [float(x) for x in row] for i, row in zip(merged.indices, merged.logits)}}))
"""


@pytest.mark.multiproc
def test_the_cli_and_evaluate_run_on_transformers_5_without_the_swarm(reference5, tmp_path):
    """Issue 71: a user of a current stack (transformers 5.23 and its hub: launch/install_reference.sh 5's
    environment, which is the suite's own where launch/install.sh made it). There, on a family of dist_eval's own
    layers (Qwen3): ``python -m dist_eval --backend local`` under torchrun N=2 gives each row's logits within
    TOLERANCE of transformers 5.x's own (the reference's, on the same token ids); evaluate() in one process, the
    same batch size, gives N=2's logits bit for bit and its accuracy, and imports neither petals nor hivemind (a
    training loop's API call starts no swarm code). Before: pyproject.toml pinned transformers<4.35, and every
    family of these layers failed to build on 5.x."""
    from conftest import free_port, reference_python, run_env, run_in_own_group

    out, ref = reference5
    case = ref["cases"]["qwen3"]
    venv_python = reference_python("5", install=False)  # made for reference5 (or this one)
    folder = os.path.join(out, case["folder"])
    checkpoint = trained(reference5, "qwen3", "head")["checkpoint"]  # the trained head, no prompts
    rows = tmp_path / "rows.csv"  # the reference's corpus, whose ids its logits were computed on
    with open(rows, "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows([("text", "label")] + [(text, i % case["num_labels"])
                                                        for i, text in enumerate(ref["corpus"])])
    env = run_env({"DIST_EVAL_ROW_STORE": "off"})
    run = tmp_path / "n2"
    launch = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    proc = run_in_own_group([venv_python, *launch, "-m", "dist_eval", "--model", folder, "--checkpoint", checkpoint,
                             "--data-files", str(rows), "--backend", "local", "--output-dir", str(run),
                             "--batch-size", "4", "--save-logits", "--bootstrap-resamples", "0"], timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Loading weights" not in proc.stderr + proc.stdout  # 5.x's bar at each load: quiet in a job's log
    predictions = sorted(read_jsonl(str(run / "predictions.jsonl")), key=lambda row: row["index"])
    assert len(predictions) == len(case["logits_head"]) == len(ref["corpus"])
    found = max(abs(a - b) for row, expected in zip(predictions, case["logits_head"])
                for a, b in zip(row["logits"], expected))
    assert found < TOLERANCE, found
    proc = run_in_own_group([venv_python, "-c", CURRENT_STACK_API, folder, checkpoint, str(rows)], timeout=300,
                            env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    api = json.loads(proc.stdout.strip().splitlines()[-1])
    assert api.pop("logits") == {str(row["index"]): row["logits"] for row in predictions}  # one process: N=2's bits
    with open(run / "metrics.json", encoding="utf-8") as f:
        assert api == {"accuracy": json.load(f)["accuracy"], "transformers": "5.23.0", "swarm_imported": []}


def test_deepseek_v4_settings_each_matter(reference5):
    """DeepSeek-V4 (checked against transformers 5.x above, head only): the indexer's choice (index_topk 3 of up to 9
    entries), the heavily compressed entries, the sliding window, the sinks, the hash routing's table and the
    clamp each move the logits; a row alone gives its batch's logits within float rounding; the older config.json
    keys read as 5.x folds them in; another quantization_config refused in one line (its blocks streamed from disk:
    test_blocks_streamed_from_disk_equal_the_model_loaded_whole_bitwise)."""
    from dist_eval.backends import load_model
    from dist_eval.errors import UsageError

    out, ref = reference5
    case = ref["cases"]["deepseek_v4"]
    folder = str(out / case["folder"])
    model = load_model("local", folder, **trained(reference5, "deepseek_v4", "head"))
    batch = padded_batch(case)
    layers = model.module.hf_model.model.layers
    with torch.no_grad():
        base = model.module(batch)
        alone = torch.cat([model.module(torch.tensor([row])) for row in case["ids"][-3:]])
        assert_within_rounding(alone, base[-3:], "rows alone and in their batch", why="other batches, padded")
        changes = {"index_topk": (layers[1].attn.indexer, "index_topk", 100),
                   "heavily compressed entries": (layers[2].attn.compressor, "rate", 10 ** 6),
                   "window": (layers[0].attn, "window", 10 ** 6),
                   "clamp": (layers[2].ffn.shared_experts, "limit", 10.0)}
        for name, (module, attribute, value) in changes.items():
            before = getattr(module, attribute)
            setattr(module, attribute, value)
            try:
                moved = (model.module(batch) - base).abs().max().item()
            finally:
                setattr(module, attribute, before)
            assert moved > 1e-2, name
        for name, tensor in {"sinks": layers[0].attn.attn_sink, "tid2eid": layers[0].ffn.gate.tid2eid}.items():
            kept = tensor.clone()
            tensor.copy_(tensor.roll(1, 0))
            try:
                assert (model.module(batch) - base).abs().max().item() > 1e-2, name
            finally:
                tensor.copy_(kept)
    legacy = str(out / "deepseek_v4_legacy_config")  # the older config.json keys, read as 5.x folds them in
    shutil.copytree(folder, legacy)
    with open(os.path.join(legacy, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    rope, ratios = config.pop("rope_parameters"), {"sliding_attention": 0, "compressed_sparse_attention": 4,
                                                   "heavily_compressed_attention": 128}  # (the kinds' codes)
    config.update(rope_theta=rope["main"]["rope_theta"], compress_rope_theta=rope["compress"]["rope_theta"],
                  rope_scaling={k: v for k, v in rope["compress"].items() if k not in ("rope_theta",
                                                                                       "partial_rotary_factor")},
                  compress_ratios=[ratios[kind] for kind in config.pop("layer_types")], num_hash_layers=2,
                  compress_rate_csa=4, compress_rate_hca=8, qk_rope_head_dim=config.pop("partial_rotary_factor") * 32)
    for key in ("mlp_layer_types", "compress_rates"):
        config.pop(key)
    with open(os.path.join(legacy, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    with torch.no_grad():
        assert_same_bits(load_model("local", legacy, **trained(reference5, "deepseek_v4", "head")).module(batch), base,
                         "the older config.json keys")
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "expert_dtype": "int4"}
    with open(os.path.join(legacy, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    with pytest.raises(UsageError, match=r"^model_dir='[^']*': quantization_config \{\"quant_method\": \"fp8\", "
                                         r"\"fmt\": \"e4m3\", \"expert_dtype\": \"int4\"\} in config.json is not "
                                         r"read for deepseek_v4 here \(read: the release's FP8"):
        load_model("local", legacy, **trained(reference5, "deepseek_v4", "head"))


def test_the_petals_client_of_an_int4_release_needs_no_quantization_package(reference5):
    """petals' client of Kimi K2.5's INT4 folder as released (compressed-tensors in config.json's
    quantization_config) loads with the project's packages alone: the quantized weights are the experts', which the
    servers read and dequantize; the client holds the embeddings, the final norm and the head. Before: transformers
    5.x set up the compressed-tensors quantizer for the client's load, ImportError ("compressed-tensors>=0.15.0 is
    required"), so no swarm run of Kimi K2.5 as released could start (found by benchmarks/families_swarm.py). Here
    an address nobody answers: the load gets as far as the swarm."""
    import importlib.util

    from dist_eval.backends import load_model
    from dist_eval.errors import UsageError

    # the case the test is about (launch/install.sh's environment): with the package, the quantizer would load
    assert importlib.util.find_spec("compressed_tensors") is None, "compressed-tensors is installed: nothing to check"
    out, ref = reference5
    with pytest.raises(UsageError, match=r"no swarm answered"):
        load_model("petals", str(out / SERVED_FOLDER["kimi_k25"]), **trained(reference5, "kimi_k25", "head"),
                   initial_peers=["/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDA7N9X7VLQrcdrk2ozrFjzVngzs7LggiY8c5nUnNMpeR"],
                   dht_prefix="nobody", swarm_timeout=3)


def test_deepseek_v4_label_words_within_1e4_of_its_causal_lm_as_saved_and_as_released(reference5, tmp_path):
    """DeepSeek-V4 zero-shot (--label-words): its LM head as transformers 5.23 saves it and as released
    (``head.weight``), after hc_head's collapse of the streams and the final norm, scores each row's words within 1e-4
    of 5.23's own DeepseekV4ForCausalLM (the reference's summed log-probabilities, one forward per row and word), the
    words' tokens the reference's; from the folder saved dequantized and from the FP8 + FP4 one as released, bit for
    bit the same; with its blocks streamed from disk (--stream-blocks) too (before cae6bbe / f0ec899 its first forward
    raised "Cannot copy out of meta tensor" in the attention's wo_b: the grouped projection reads wo_a's weight
    without calling wo_a, so the offload never brought it in). Prompts stay refused (hash-routed blocks); a folder
    without the head (untied) is refused naming both names, before any weight is read."""
    from safetensors.torch import load_file, save_file

    from dist_eval.backends import load_model
    from dist_eval.errors import UsageError, flag_names

    out, ref = reference5
    case = ref["cases"]["deepseek_v4"]
    words, expected = case["label_words"], torch.tensor(case["logits_label_words"])
    batch, scores = padded_batch(case), {}
    for folder in ("deepseek_v4", case["fp8_folder"]):
        model = load_model("local", str(out / folder), label_words=words)
        assert model.label_words == tuple(words) and model.num_labels == len(words)
        assert [list(ids) for ids in model.module.label_words.token_ids] == case["label_word_ids"]
        with torch.no_grad():
            scores[folder] = model.module(batch)
    assert_same_bits(scores[case["fp8_folder"]], scores["deepseek_v4"], "label word scores, as released and as saved")
    streamed = load_model("local", str(out / "deepseek_v4"), label_words=words, stream_blocks=True)
    with torch.no_grad():
        assert_same_bits(streamed.module(batch), scores["deepseek_v4"], "label word scores, blocks streamed")
    assert (scores["deepseek_v4"] - expected).abs().max().item() < TOLERANCE
    assert scores["deepseek_v4"].argmax(-1).tolist() == expected.argmax(-1).tolist()
    assert len(set(expected.argmax(-1).tolist())) > 1  # the head decides: not one word for every row
    with pytest.raises(UsageError, match=r"ptune on deepseek_v4: blocks \[0, 1\] route each position by its token id"):
        load_model("local", str(out / "deepseek_v4"), label_words=words,
                   checkpoint=trained(reference5, "deepseek_v4", "ptune")["checkpoint"])
    headless = tmp_path / "deepseek_v4_headless"
    shutil.copytree(out / "deepseek_v4", headless)
    tensors = load_file(str(headless / "model.safetensors"))
    del tensors["head.weight"]
    save_file(tensors, str(headless / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UsageError) as caught:
        load_model("local", str(headless), label_words=words)
    with flag_names():
        assert str(caught.value) == (
            f"--model {headless}: the folder holds no language-model head ('lm_head.weight' or 'head.weight') and "
            "config.json does not tie it to the embeddings, so label words cannot be scored (the head would be "
            "random). Pass the folder of the causal LM (a *ForCausalLM save), not of a classifier or a base model.")
