"""dist_eval.backends.local: without prompts it equals the family's transformers classifier
bit for bit; with prompts it does what petals' client + servers do (checked against a
step-by-step re-implementation here; against a real swarm through the CLI in
tests/test_families_swarm.py)."""
import pytest
import torch
from conftest import build_tiny_model
from float_promises import assert_same_bits, assert_within_rounding

from dist_eval.backends.blocks import family_class
from dist_eval.backends.checkpoint import TrainableState
from dist_eval.backends.families import FAMILIES
from dist_eval.backends.local import PromptTunedClassifier, load_local

EMBEDDINGS_NORM = {"bloom": "word_embeddings_layernorm"}  # applied after the prompts are prepended
FINAL_NORM = {"llama": "norm", "bloom": "ln_f", "falcon": "ln_f"}
FINAL_NORM.update(mistral="norm", qwen2="norm", qwen3="norm", qwen3_moe="norm", glm4_moe="norm",  # Llama's backbone
                  mixtral="norm", deepseek_v3="norm", kimi_k2="norm", kimi_k25="norm", llama4_text="norm",
                  qwen3_5="norm",
                  qwen3_5_moe="norm", qwen3_next="norm", minimax_m2="norm", gpt_oss="norm", glm_moe_dsa="norm",
                  deepseek_v32="norm", deepseek_v4="norm")


def load_local_reference(folder, spec, mode, pre_seq_len, tensors):
    state = TrainableState(mode, pre_seq_len if mode else 0, int(tensors["score.weight"].shape[0]), tensors)
    return load_local(folder, state, spec).eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny models compute on one thread, as a torchrun rank does: with more, on the 2-core test
    machine, the mixtures' many small products mostly waited (what is compared runs alike either way)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref_models")
    return {f: build_tiny_model(str(root / f), family=f, layout="seq_cls") for f in FAMILIES}


def batch():
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in (1, 6, 9, 4):
        rows.append(torch.randint(2, 62, (n,), generator=g).tolist() + [0] * (9 - n))
    return torch.tensor(rows)


def trained(mode, hidden=32, layers=4):
    g = torch.Generator().manual_seed(1)
    t = {"score.weight": torch.randn(3, hidden, generator=g)}
    if mode:
        t["prompt_embeddings.weight"] = torch.randn(2, hidden, generator=g)
    if mode == "deep_ptune":
        t["intermediate_prompt_embeddings.weight"] = torch.randn(2, layers * hidden, generator=g)
    return t


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_prompts_equals_transformers_classifier(models, family):
    """The local backend without prompts is transformers' classifier of the family, bit for bit: built with the
    attention load_model asks for where transformers offers a choice (Family.local_attention; 5.x's default rounds
    otherwise), called without a cache as dist_eval calls it (5.x copies keys and values into its cache, and the
    product of the copies rounds otherwise: 1.5e-08 in a padded batch)."""
    from dist_eval.backends.compat import attention_choice

    spec = FAMILIES[family]
    hf = family_class(spec.local_class, in_petals=False).from_pretrained(models[family], **attention_choice(spec))
    hf = hf.eval()
    ref = load_local_reference(models[family], spec, None, 0, {"score.weight": hf.score.weight.detach().clone()})
    with torch.no_grad():
        assert_same_bits(ref(batch()), hf(input_ids=batch(), use_cache=False).logits,
                         f"{family}: the logits, against transformers'")


def petals_steps(hf, spec, mode, tensors, input_ids):
    """petals 2.2.0's forward written out: client embeddings + prompts (+ BLOOM's embedding
    layernorm), server blocks with intermediate prompts added before each, client prefix
    removal + final norm + head + the family's pooling."""
    base = spec.get(hf, spec.backbone)
    config = hf.config
    embeds = spec.get(hf, spec.embeddings)(input_ids)
    b, p = input_ids.shape[0], tensors["prompt_embeddings.weight"].shape[0] if mode else 0
    if mode:
        embeds = torch.cat([tensors["prompt_embeddings.weight"].unsqueeze(0).expand(b, -1, -1), embeds], dim=1)
    norm = EMBEDDINGS_NORM.get(spec.model_type)
    hidden = getattr(base, norm)(embeds) if norm else embeds
    seq = hidden.shape[1]
    for i, block in enumerate(spec.get(hf, spec.blocks)):
        if mode == "deep_ptune":
            inter = tensors["intermediate_prompt_embeddings.weight"].view(p, config.num_hidden_layers, -1)[:, i]
            hidden = hidden.clone()
            hidden[:, :p] += inter
        hidden = _run_block(spec, base, block, hidden, seq)
    hidden = getattr(base, FINAL_NORM[spec.model_type])(hidden[:, p:])
    logits = hidden @ tensors["score.weight"].T
    return logits[torch.arange(b), spec.last_token_index(input_ids, config.pad_token_id)]


def _run_block(spec, base, block, hidden, seq):
    """One server block over prompts + tokens as petals' server runs it: causal attention, no padding mask,
    positions 0..seq-1; the block called as the installed transformers calls its layers."""
    from dist_eval.backends.layers import layers_return_tensors

    if layers_return_tensors():
        return _run_current_block(spec, base, block, hidden, seq)
    b = hidden.shape[0]
    mask = torch.ones(b, seq)
    if (spec.built_on or spec.model_type) == "llama":
        from transformers.models.llama.modeling_llama import LlamaModel

        causal = LlamaModel._prepare_decoder_attention_mask(base, mask, (b, seq), hidden, 0)
        return block(hidden, attention_mask=causal, position_ids=torch.arange(seq).unsqueeze(0))[0]
    if spec.model_type == "bloom":
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor

        causal = base._prepare_attn_mask(mask, (b, seq), 0)
        return block(hidden, build_alibi_tensor(mask, base.num_heads, hidden.dtype), causal)[0]
    causal = base._prepare_attn_mask(mask, (b, seq), 0)
    return block(hidden, None, causal)[0]


def _run_current_block(spec, base, block, hidden, seq):
    """:func:`_run_block` where layers take the model's rotary table (``position_embeddings``) and an additive mask
    (4.5x, 5.x; the pinned 4.33's masks are built by model methods that are gone): the causal mask written out as
    4.33 built it (0 on and below the diagonal, finfo.min above), the rotary table of the model's own; a Llama-built
    layer returns its hidden states alone, the alibi and Falcon blocks (hidden states, attention weights)."""
    b = hidden.shape[0]
    above = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    causal = torch.zeros(b, 1, seq, seq, dtype=hidden.dtype).masked_fill(above, torch.finfo(hidden.dtype).min)
    positions = torch.arange(seq).unsqueeze(0)
    if spec.model_type == "bloom":
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor

        return block(hidden, build_alibi_tensor(torch.ones(b, seq), base.num_heads, hidden.dtype), causal)[0]
    rotary = base.rotary_emb(hidden, positions)
    if (spec.built_on or spec.model_type) == "llama":
        out = block(hidden, attention_mask=causal, position_ids=positions, position_embeddings=rotary)
        assert torch.is_tensor(out), f"{spec.model_type}: a layer here returns its hidden states alone"
        return out
    return block(hidden, None, causal, position_ids=positions, position_embeddings=rotary)[0]


# (DeepSeek-V4 aside: its prompts are refused, Family.prompts_refusal, tests/test_families_reference.py)
@pytest.mark.parametrize("family", sorted(name for name in FAMILIES if name != "deepseek_v4"))
@pytest.mark.parametrize("mode", ["ptune", "deep_ptune"])
def test_prompts_as_petals_applies_them(models, family, mode):
    """The local backend with prompts computes petals' client and server steps: those steps run here on
    transformers' blocks of the family, built with the attention petals' server block computes
    (Family.local_attention; 5.x's default sdpa rounds otherwise)."""
    from dist_eval.backends.compat import attention_choice

    spec = FAMILIES[family]
    tensors = trained(mode)
    ref = load_local_reference(models[family], spec, mode, 2, tensors)
    with torch.no_grad():
        got = ref(batch())

        hf = family_class(spec.local_class, in_petals=False).from_pretrained(models[family],
                                                                    **attention_choice(spec)).eval()
        expected = petals_steps(hf, spec, mode, tensors, batch())
        plain = load_local_reference(models[family], spec, None, 0, tensors)(batch())
    assert_within_rounding(got, expected, f"{family} {mode}: the logits, against petals' steps",
                           why="another implementation of the same forward: petals' client and server steps, by hand")
    assert not torch.allclose(got, plain)  # the prompts matter


def test_pooling_rules():
    ids = torch.tensor([[5, 0, 7, 0], [5, 6, 7, 8]])
    assert FAMILIES["llama"].last_token_index(ids, 0).tolist() == [0, 3]
    assert FAMILIES["bloom"].last_token_index(ids, 0).tolist() == [1, 3]  # a pad inside the text counts differently
    assert FAMILIES["falcon"].last_token == "non_pad_count"


def test_unknown_tuning_mode(models):
    import transformers

    hf = transformers.BloomForSequenceClassification.from_pretrained(models["bloom"])
    with pytest.raises(ValueError, match="tuning_mode='prefix'"):
        PromptTunedClassifier(hf, "prefix", 2, FAMILIES["bloom"])


@pytest.mark.parametrize("family", ["bloom", "falcon"])
def test_base_layout_with_a_head_is_read_from_its_converted_copy(tmp_path, monkeypatch, family):
    """transformers refuses a base-model layout that holds score.weight ("corrupted"); the
    local backend reads the converted copy, and the head from the folder itself."""
    import os

    from safetensors.torch import load_file, save_file

    from dist_eval.backends import load_model

    monkeypatch.setenv("DIST_EVAL_CACHE", str(tmp_path / "cache"))
    folder = build_tiny_model(str(tmp_path / "m"), family=family, layout="base", num_layers=2)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors["score.weight"] = torch.ones(3, 32)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    loaded = load_model("local", folder)
    spec = FAMILIES[family]
    assert torch.equal(spec.get(loaded.module.hf_model, spec.head).weight, torch.ones(3, 32))
    assert loaded.module(batch()).shape == (4, 3)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_a_tokens_experts_and_their_sum_do_not_depend_on_its_batch(router):
    """Qwen3-MoE's and GLM-4.5's mixtures (dist_eval's own layers): a row alone, in a batch, or
    beside padding rows gets the same bits; the router picks 2 of 8 experts per token, several per
    row (GLM-4.5's: within the best of 2 groups, its choice shifted by the correction bias)."""
    import types

    from dist_eval.backends.layers import SigmoidMoeMLP, SparseMoeMLP

    config = types.SimpleNamespace(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, hidden_size=64,
                                   moe_intermediate_size=32, hidden_act="silu", n_routed_experts=8, n_shared_experts=1,
                                   n_group=2, topk_group=1, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    moe = SparseMoeMLP(config) if router == "softmax" else SigmoidMoeMLP(config)
    if router == "sigmoid":  # a router far from uniform, a bias that shifts the choice (the reference's)
        moe.gate.weight.data.normal_(0.0, 0.3)
        moe.gate.e_score_correction_bias.normal_(0.0, 0.3)
    rows = torch.randn(5, 7, 64)
    with torch.no_grad():
        together = moe(rows)
        padded = moe(torch.cat([rows, torch.zeros(3, 7, 64)]))[:5]
        for i in range(5):
            assert torch.equal(moe(rows[i:i + 1])[0], together[i]) and torch.equal(padded[i], together[i])
        logits = moe.gate(rows[0])
        chosen = torch.topk(logits, 2, dim=-1).indices if router == "softmax" else moe.choose(logits.sigmoid())
    assert len(set(chosen.flatten().tolist())) > 2


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}


def test_fp8_weights_the_local_blocks_would_read_without_their_scales_are_refused(tiny_model, tiny_checkpoint,
                                                                                 tmp_path):
    """A newcomer's review: an FP8 folder of a family whose blocks are transformers' (Llama) was computed by
    the local backend from its e4m3 values without their scales (logits 8 away from the dequantized model's, no
    error); dist_eval's servers dequantize them. Refused in one line naming --backend, before any weight is read,
    streamed too; a family of dist_eval's own layers (which dequantize on load) is not refused for it."""
    import json
    import shutil

    from dist_eval.backends import load_model
    from dist_eval.errors import UsageError, flag_names

    folder = shutil.copytree(tiny_model, tmp_path / "fp8")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": FP8}))
    for stream in (False, True):
        with pytest.raises(UsageError) as refused:
            load_model("local", str(folder), checkpoint=tiny_checkpoint, stream_blocks=stream)
        with flag_names():
            said = str(refused.value)
        assert said.startswith("--backend local: FP8 weights") and "without their scales" in said, said


def test_a_quantized_folder_of_a_family_computed_otherwise_before_has_another_row_key(tiny_checkpoint):
    """Mistral's and Qwen2's blocks were the pinned Llama block, which read FP8 weights without their scales on the
    local backend; their own layers dequantize them. The rows an earlier dist_eval stored for such a folder are not
    served: its key names the change. An unquantized folder's key, and every other family's, is as it was."""
    from types import SimpleNamespace

    from dist_eval.backends.checkpoint import load_checkpoint
    from dist_eval.backends.classifier import _identity

    state = load_checkpoint(tiny_checkpoint)
    where = ("local", "cpu", None)
    for family in ("mistral", "qwen2"):
        folder = f"dist_eval/demo_assets/{family}/model"
        plain = _identity(folder, SimpleNamespace(), state, FAMILIES[family], where)["model"]
        quantized = _identity(folder, SimpleNamespace(quantization_config=FP8), state, FAMILIES[family], where)
        assert "computation" not in plain and quantized["model"]["computation"] == {
            "quantized_weights": "dequantized by dist_eval's layers"}
    assert "computation" not in _identity(folder, SimpleNamespace(quantization_config=FP8), state, FAMILIES["llama"],
                                          where)["model"]
