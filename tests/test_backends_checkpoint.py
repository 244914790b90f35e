"""dist_eval.backends.checkpoint: every checkpoint form users hold, for every family; refusals
name the keys. Fast: no models, no processes."""
import os

import pytest
import torch
from torch import nn

from dist_eval.backends.checkpoint import load_checkpoint, save_checkpoint
from dist_eval.backends.families import FAMILIES
from dist_eval.errors import UsageError, flag_names

P, H, L, K = 3, 8, 2, 4
PREFIX = {"llama": "model.", "bloom": "transformer.", "falcon": "transformer.", "mistral": "model.", "qwen2": "model.",
          "qwen3": "model.", "qwen3_moe": "model.", "glm4_moe": "model.", "mixtral": "model.", "deepseek_v3": "model.",
          "kimi_k2": "model.", "kimi_k25": "model.", "llama4_text": "model.", "qwen3_5": "model.",
          "qwen3_5_moe": "model.", "qwen3_next": "model.",
          "minimax_m2": "model.", "gpt_oss": "model.", "glm_moe_dsa": "model.", "deepseek_v32": "model.",
          "deepseek_v4": "model."}
FROZEN = {  # a few keys of each family's full state dict
    "llama": ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"],
    "bloom": ["transformer.word_embeddings.weight", "transformer.word_embeddings_layernorm.weight",
              "transformer.word_embeddings_layernorm.bias", "transformer.ln_f.weight", "transformer.ln_f.bias"],
    "falcon": ["transformer.word_embeddings.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"],
}
for _name in ("mistral", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "mixtral", "deepseek_v3", "kimi_k2", "kimi_k25",
              "llama4_text",
              "qwen3_5", "qwen3_5_moe", "qwen3_next", "minimax_m2", "gpt_oss", "glm_moe_dsa", "deepseek_v32"):
    FROZEN[_name] = FROZEN["llama"]  # Llama's layout
FROZEN["deepseek_v4"] = FROZEN["llama"] + ["model.hc_head.hc_fn"]  # and the streams' last collapse


def trained(mode):
    g = torch.Generator().manual_seed(0)
    t = {"score.weight": torch.randn(K, H, generator=g)}
    if mode:
        t["prompt_embeddings.weight"] = torch.randn(P, H, generator=g)
    if mode == "deep_ptune":
        t["intermediate_prompt_embeddings.weight"] = torch.randn(P, L * H, generator=g)
    return t


def as_petals_state_dict(family, mode, full):
    """What model.state_dict() of a petals Distributed<Family>ForSequenceClassification holds."""
    t = trained(mode)
    sd = {("" if k == "score.weight" else PREFIX[family]) + k: v for k, v in t.items()}
    if full:
        sd.update({k: torch.zeros(2, H) for k in FROZEN[family]})
    return sd


def check(state, mode):
    expected = trained(mode)
    assert state.tuning_mode == mode
    assert state.pre_seq_len == (P if mode else 0)
    assert state.num_labels == K
    assert sorted(state.tensors) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(state.tensors[k], v), k


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("mode", [None, "ptune", "deep_ptune"])
@pytest.mark.parametrize("full", [False, True])
def test_petals_state_dicts(tmp_path, family, mode, full):
    path = str(tmp_path / "sd.pt")
    torch.save(as_petals_state_dict(family, mode, full), path)
    check(load_checkpoint(path, FAMILIES[family]), mode)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_unprefixed_and_safetensors_state_dicts(tmp_path, family):
    from safetensors.torch import save_file

    torch.save(trained("deep_ptune"), tmp_path / "sd.pt")
    check(load_checkpoint(str(tmp_path / "sd.pt"), FAMILIES[family]), "deep_ptune")
    save_file(as_petals_state_dict(family, "ptune", full=True), str(tmp_path / "sd.safetensors"))
    check(load_checkpoint(str(tmp_path / "sd.safetensors"), FAMILIES[family]), "ptune")


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("mode", [None, "ptune", "deep_ptune"])
def test_dist_eval_format_reads_back_for_every_family(tmp_path, family, mode):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, mode, trained(mode))
    check(load_checkpoint(path, FAMILIES[family]), mode)


def test_a_checkpoint_saved_for_a_familys_alias_is_its_familys(tmp_path):
    """A Qwen3.5 text fine-tune's config keeps model_type qwen3_5_text (Family.model_type_aliases): a training loop's
    save_checkpoint(family=model.config.model_type) was refused; it is stored as its family and read back for it."""
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, "ptune", trained("ptune"), family="qwen3_5_text")
    assert torch.load(path, weights_only=False)["family"] == "qwen3_5"
    check(load_checkpoint(path, FAMILIES["qwen3_5"]), "ptune")
    with pytest.raises(ValueError, match="family='qwen3_6_text': expected one of"):
        save_checkpoint(path, "ptune", trained("ptune"), family="qwen3_6_text")


def test_dist_eval_format_with_another_family_is_refused(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    torch.save({"format": "dist_eval.checkpoint/1", "family": "bloom", "state_dict": trained("ptune")}, path)
    check(load_checkpoint(path, FAMILIES["bloom"]), "ptune")
    with pytest.raises(UsageError, match="saved for a bloom model; the model is llama"):
        load_checkpoint(path, FAMILIES["llama"])


def embeddings(mode):
    t = trained(mode)
    prompts = nn.Embedding(P, H)
    prompts.weight.data.copy_(t["prompt_embeddings.weight"])
    if mode == "ptune":
        return prompts
    deep = nn.Embedding(P, L * H)
    deep.weight.data.copy_(t["intermediate_prompt_embeddings.weight"])
    return (prompts, deep)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("mode", ["ptune", "deep_ptune"])
@pytest.mark.parametrize("head_in", ["file", "petals_file", "folder"])
def test_issue_268_embedding_export(tmp_path, family, mode, head_in):
    """torch.save(model.transformer.prompt_embeddings, f) (a tuple of two for deep_ptune),
    with the head from a second file or from the model folder."""
    path = str(tmp_path / "prompts.pt")
    torch.save(embeddings(mode), path)
    head = trained(mode)["score.weight"]
    if head_in == "file":
        head_source = str(tmp_path / "head.pt")
        torch.save({"score.weight": head}, head_source)
    elif head_in == "petals_file":
        head_source = str(tmp_path / "head.pt")
        torch.save(as_petals_state_dict(family, None, full=True), head_source)
    else:
        from safetensors.torch import save_file

        head_source = str(tmp_path / "model")
        os.makedirs(head_source)
        save_file({"score.weight": head, PREFIX[family] + "x.weight": torch.zeros(1)},
                  os.path.join(head_source, "model.safetensors"))
    check(load_checkpoint(path, FAMILIES[family], head=head_source), mode)


def test_issue_268_tuple_order_does_not_matter(tmp_path):
    prompts, deep = embeddings("deep_ptune")
    torch.save([deep, prompts], tmp_path / "p.pt")
    torch.save({"score.weight": trained(None)["score.weight"]}, tmp_path / "h.pt")
    state = load_checkpoint(str(tmp_path / "p.pt"), FAMILIES["bloom"], head=str(tmp_path / "h.pt"))
    check(state, "deep_ptune")


def test_prompts_without_a_head_are_refused(tmp_path):
    torch.save(embeddings("ptune"), tmp_path / "p.pt")
    with pytest.raises(UsageError, match="no classifier head"):
        load_checkpoint(str(tmp_path / "p.pt"), FAMILIES["bloom"])


def test_two_heads_are_refused(tmp_path):
    torch.save(trained("ptune"), tmp_path / "a.pt")
    torch.save({"score.weight": torch.zeros(K, H)}, tmp_path / "h.pt")
    with pytest.raises(UsageError, match="pass only one"):
        load_checkpoint(str(tmp_path / "a.pt"), FAMILIES["bloom"], head=str(tmp_path / "h.pt"))


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_arbitrary_pickled_code_is_refused_and_not_run(tmp_path):
    path, marker = str(tmp_path / "evil.pt"), tmp_path / "ran"
    torch.save({"score.weight": torch.zeros(K, H), "x": Evil(marker)}, path)
    with pytest.raises(UsageError, match="pickles classes that are not read.*system"):
        load_checkpoint(path, FAMILIES["llama"])
    assert not marker.exists()


def test_another_module_class_is_refused(tmp_path):
    path = str(tmp_path / "linear.pt")
    torch.save(nn.Linear(H, K), path)
    with pytest.raises(UsageError, match="torch.nn.modules.linear.Linear"):
        load_checkpoint(path, FAMILIES["llama"])


@pytest.mark.parametrize("family,key,pattern", [
    # a prompt under another family's prefix: the family does not match
    ("llama", "transformer.prompt_embeddings.weight", "those of a bloom or falcon model, and the model is llama"),
    ("bloom", "model.prompt_embeddings.weight", "those of a llama model, and the model is bloom"),
    # a model tensor of another family
    ("bloom", "model.embed_tokens.weight", "those of a llama model"),
    ("falcon", "transformer.word_embeddings_layernorm.weight", "those of a bloom model, and the model is falcon"),
    ("bloom", "transformer.h.0.ln_attn.weight", "those of a falcon model, and the model is bloom"),
    # prompt-looking keys that are not petals' names
    ("bloom", "transformer.prompt_encoder.weight", "not recognised for a bloom model: transformer.prompt_encoder"),
    ("llama", "prompts", "not recognised for a llama model: prompts"),
    ("falcon", "transformer.intermediate_prompts.weight", "not recognised.*intermediate_prompts"),
    # anything else unknown
    ("llama", "optimizer_step", "not recognised for a llama model: optimizer_step"),
])
def test_unknown_or_foreign_keys_are_refused_by_name(tmp_path, family, key, pattern):
    sd = as_petals_state_dict(family, "ptune", full=False)
    sd[key] = torch.zeros(P, H)
    torch.save(sd, tmp_path / "sd.pt")
    with pytest.raises(UsageError, match=pattern):
        load_checkpoint(str(tmp_path / "sd.pt"), FAMILIES[family])


def test_training_checkpoint_with_non_tensors_is_refused(tmp_path):
    torch.save({"model": as_petals_state_dict("llama", "ptune", False), "step": 3}, tmp_path / "t.pt")
    with pytest.raises(UsageError, match="not tensors: model, step"):
        load_checkpoint(str(tmp_path / "t.pt"), FAMILIES["llama"])


def test_mismatched_prompt_lengths_are_refused(tmp_path):
    sd = trained("deep_ptune")
    sd["intermediate_prompt_embeddings.weight"] = torch.zeros(P + 1, L * H)
    torch.save(sd, tmp_path / "sd.pt")
    with pytest.raises(UsageError, match="3 prompt vectors but intermediate_prompt_embeddings.weight has 4"):
        load_checkpoint(str(tmp_path / "sd.pt"), FAMILIES["falcon"])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_checkpoint_of_prefixed_tensors_reads_back_for_its_family(tmp_path, family):
    path = str(tmp_path / "ck.pt")
    save_checkpoint(path, "deep_ptune", as_petals_state_dict(family, "deep_ptune", full=False), family=family)
    check(load_checkpoint(path, FAMILIES[family]), "deep_ptune")
    check(load_checkpoint(path), "deep_ptune")
    other = next(name for name in sorted(FAMILIES) if name != family)
    with pytest.raises(UsageError, match=f"saved for a {family} model; the model is {other}"):
        load_checkpoint(path, FAMILIES[other])


def test_errors_name_the_flag_in_one_line(tmp_path):
    torch.save(embeddings("ptune"), tmp_path / "p.pt")
    with pytest.raises(UsageError) as caught:
        load_checkpoint(str(tmp_path / "p.pt"), FAMILIES["bloom"])
    with flag_names():
        text = str(caught.value)
    assert text.startswith(f"--checkpoint {tmp_path / 'p.pt'}: no classifier head") and "--head" in text
    assert "\n" not in text
