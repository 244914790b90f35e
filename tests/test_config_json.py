"""config.json read in either transformers generation's form (dist_eval.backends.config_json): the moved
fields where the blocks read them, nothing guessed (a form not read, a RoPE key not computed, a layer type no
block computes, the two forms disagreeing: refused in one line naming the field and the file), the same
reading in every reader (the transformers config classes, the family check, the swarm's placement and
device sizing), and the row store's key taking what was read from the 5.x form. The logits of folders saved
by each generation are checked against that transformers in tests/test_families_reference.py."""
import copy
import json
import os

import pytest

from dist_eval.backends.config_json import READ_AS, read_as_saved, read_config_json
from dist_eval.backends.families import FAMILIES
from dist_eval.errors import UsageError

WHERE = "/m/config.json"
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
LLAMA_4X = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
            "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3_ROPE}, "torch_dtype": "float32"}
LLAMA_5X = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
            "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", **LLAMA3_ROPE}, "dtype": "float32"}


def refused(raw: dict) -> str:
    with pytest.raises(UsageError) as caught:
        read_as_saved(raw, WHERE)
    message = str(caught.value)
    assert WHERE in message and "\n" not in message
    return message


def without_marker(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != READ_AS}


def test_the_5x_form_reads_as_the_4x_form_and_says_what_it_moved():
    read = read_as_saved(LLAMA_5X, WHERE)
    assert without_marker(read) == {**LLAMA_4X, "dtype": "float32"}
    assert read[READ_AS] == {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3_ROPE}}
    assert READ_AS not in read_as_saved(LLAMA_4X, WHERE)  # the 4.x form: nothing moved, read as it is
    assert read_as_saved(read, WHERE) == read  # idempotent (a config read back after it was saved here)


def test_a_default_rope_and_a_partial_rotary_share_come_out_of_rope_parameters():
    read = read_as_saved({"model_type": "glm4_moe", "rope_parameters": {
        "rope_theta": 1e6, "rope_type": "default", "partial_rotary_factor": 0.5}}, WHERE)
    assert (read["rope_theta"], read["rope_scaling"], read["partial_rotary_factor"]) == (1e6, None, 0.5)


def test_a_renamed_field_of_the_family_is_read_under_either_name():
    read = read_as_saved({"model_type": "qwen3_moe", "num_local_experts": 8, "rope_theta": 1e6}, WHERE)
    assert read["num_experts"] == 8 and "num_local_experts" not in read and read[READ_AS] == {"num_experts": 8}
    # another family's field of that name is its own (Mixtral's expert count is num_local_experts in both)
    assert read_as_saved({"model_type": "mixtral", "num_local_experts": 8}, WHERE)["num_local_experts"] == 8
    assert "num_experts 4 and num_local_experts (transformers 5.x's name for num_experts) 8 differ" in refused(
        {"model_type": "qwen3_moe", "num_local_experts": 8, "num_experts": 4})


def test_rope_parameters_of_each_attention_type_are_read_when_alike_and_refused_when_not():
    same = {"rope_theta": 1e4, "rope_type": "default"}
    read = read_as_saved({"model_type": "llama", "rope_parameters": {"full_attention": same,
                                                                     "sliding_attention": same}}, WHERE)
    assert read["rope_theta"] == 1e4
    message = refused({"model_type": "llama", "rope_parameters": {
        "full_attention": same, "sliding_attention": {**same, "rope_theta": 1e6}}})
    assert "gives each attention type its own RoPE (full_attention, sliding_attention)" in message


@pytest.mark.parametrize("raw, expected", [
    ({"model_type": "llama", "rope_parameters": 10000.0}, "rope_parameters is 10000.0, not an object"),
    ({"model_type": "llama", "rope_theta": 10000.0, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}},
     "rope_theta 10000.0 and rope_parameters' rope_theta 500000.0 differ"),
    ({**LLAMA_5X, "rope_parameters": {**LLAMA_5X["rope_parameters"], "beta": 2}},
     "rope_parameters of rope_type 'llama3' has beta, which its computation here does not read"),
    ({**LLAMA_4X, "rope_scaling": {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 8}},
     "rope_scaling of rope_type 'linear' has original_max_position_embeddings"),
    ({"model_type": "llama", "layer_types": ["full_attention", "sliding_attention"]},
     "layer_types has sliding_attention, which the llama blocks here do not compute"),
    ({"model_type": "qwen2", "layer_types": ["linear_attention"]}, "layer_types has linear_attention"),
])
def test_a_form_or_a_setting_not_read_here_is_refused_in_one_line(raw, expected):
    assert expected in refused(raw)


# the families whose own transformers 5.x config class is not CONFIG_MAPPING's: the text model's of a
# vision-language release; Kimi K2's (none in 5.x) is DeepSeek-V3's
OWN_CONFIG_CLASS = {"qwen3_5": "Qwen3_5TextConfig", "qwen3_5_moe": "Qwen3_5MoeTextConfig",
                    "kimi_k25": "DeepseekV3Config", "kimi_k2": "DeepseekV3Config"}


def _as_read(config, family) -> dict:
    """The fields the blocks read that a config.json may leave out, as ``config`` (a transformers 5.x config) has
    them: its RoPE (the first of DeepSeek-V4's kinds), norm epsilon, the window it attends in and length."""
    rope = dict(config.rope_parameters or {})
    if family.rope_labels:
        rope = dict(rope.get(family.rope_labels[0], rope))
    return {"rope": {key: value for key, value in rope.items() if key != "partial_rotary_factor"},
            "window": getattr(config, "sliding_window", None) if _window_on(config, family) else None,
            **{name: getattr(config, name, None) for name in ("rms_norm_eps", "max_position_embeddings")}}


def _window_on(config, family) -> bool:
    switch = family.sliding_window[1] if family.sliding_window else ""  # "": the window alone says it
    return bool(getattr(config, switch, False)) if switch else True


# files that leave fields out: the type alone; a window's switch on without its window; an empty RoPE setting
LEFT_OUT = ({}, {"use_sliding_window": True}, {"rope_scaling": {}})


@pytest.mark.parametrize("given", LEFT_OUT, ids=("type_alone", "switch_alone", "empty_rope"))
@pytest.mark.parametrize("name", sorted(name for name, family in FAMILIES.items() if family.built_on))
def test_a_field_config_json_leaves_out_takes_the_default_of_the_familys_own_transformers_class(name, given):
    """The review's finding: the config classes built here subclass Llama's, whose defaults a file that leaves a
    field out took (Mixtral's RoPE at theta 1e4, not 1e6; gpt-oss's without yarn; Llama 4's and MiniMax-M2's
    theta; a 1e-6 norm epsilon for 1e-5): another model, without a word. Read here, such a file has what
    transformers 5.x's own class of the family gives it, field for field."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from dist_eval.backends.blocks import family_class
    from dist_eval.backends.compat import configs_are_dataclasses

    assert configs_are_dataclasses(), "the README's install has transformers 5.x, whose classes this compares with"
    family = FAMILIES[name]
    own = getattr(transformers, OWN_CONFIG_CLASS[name]) if name in OWN_CONFIG_CLASS else CONFIG_MAPPING[name]
    read = read_as_saved({"model_type": name, **copy.deepcopy(given)}, WHERE)
    ours = family_class(family.local_class, in_petals=False).config_class(**read)
    assert _as_read(ours, family) == _as_read(own(**copy.deepcopy(given)), family)  # 5.x's from_dict edits its dicts


def test_rope_parameters_without_a_base_or_null_take_the_familys_as_transformers_5_reads_them():
    read = read_as_saved({"model_type": "llama", "rope_parameters": {"rope_type": "default"}}, WHERE)
    assert (read["rope_theta"], read["rope_scaling"]) == (10000.0, None)
    assert read_as_saved({"model_type": "mixtral", "rope_parameters": {"rope_type": "default"}},
                         WHERE)["rope_theta"] == 1e6
    gpt_oss = read_as_saved({"model_type": "gpt_oss", "rope_parameters": None, "rope_theta": 5e4}, WHERE)
    assert (gpt_oss["rope_theta"], gpt_oss["rope_scaling"]["rope_type"]) == (5e4, "yarn")
    # a default RoPE said in the file stays one (transformers 5.x's gpt-oss reads it so too)
    said = read_as_saved({"model_type": "gpt_oss", "rope_parameters": {"rope_type": "default"}}, WHERE)
    assert (said["rope_theta"], said["rope_scaling"]) == (150000.0, None)


def test_the_defaults_filled_in_are_in_the_row_stores_key_but_a_window_alone_is_not():
    """A row computed under a filled RoPE base is another row than before (its key differs); a window filled in only
    refuses longer rows, so the key of a Mistral folder saved by the classes here (no sliding_window) is as it was."""
    from types import SimpleNamespace

    from dist_eval.backends.config_json import DEFAULTS_FILLED, config_reading

    mixtral = read_as_saved({"model_type": "mixtral", "max_position_embeddings": 128}, WHERE)
    assert config_reading(SimpleNamespace(**mixtral)) == {
        "config_defaults_filled": {"rope_theta": 1e6, "rms_norm_eps": 1e-5}}
    mistral = read_as_saved({"model_type": "mistral", "max_position_embeddings": 128, "rope_theta": 1e4}, WHERE)
    assert mistral["sliding_window"] == 4096 and DEFAULTS_FILLED not in mistral
    assert config_reading(SimpleNamespace(**mistral)) == {}
    assert read_as_saved(mixtral, WHERE) == mixtral  # idempotent


def test_a_sliding_layer_turns_the_window_on_as_transformers_5_reads_it():
    read = read_as_saved({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": False,
                          "layer_types": ["full_attention", "sliding_attention"]}, WHERE)
    assert read["use_sliding_window"] is True  # rows longer than the window are then refused (families)


def test_a_layer_type_under_its_earlier_name_is_read_as_transformers_5_reads_it():
    """The GPU run's finding (benchmarks/RESULTS.md, issue 75): GLM-5 and DeepSeek-V3.2 folders saved by transformers
    5.17 say deepseek_sparse_attention where 5.23 says indexed_attention (5.23's own reading renames it); they were
    refused here. The earlier names are read as 5.23 reads them; a name no block computes is still refused."""
    for model_type in ("glm_moe_dsa", "deepseek_v32"):
        older = read_as_saved({"model_type": model_type, "layer_types": ["deepseek_sparse_attention"] * 2}, WHERE)
        assert older["layer_types"] == ["indexed_attention"] * 2
    assert read_as_saved({"model_type": "llama", "layer_types": ["attention"]}, WHERE)["layer_types"] == [
        "full_attention"]
    assert "qwen_sparse_attention" in refused({"model_type": "glm_moe_dsa", "layer_types": ["qwen_sparse_attention"]})


def test_every_reader_reads_the_5x_form(tmp_path):
    """The family check (no transformers), the transformers config classes (client and servers), the swarm's
    block sizes and the weights' dtype: one reading."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from dist_eval.backends.blocks import family_class, register
    from dist_eval.backends.compat import configs_are_dataclasses
    from dist_eval.backends.config_json import family_of_folder
    from dist_eval.backends.families import FAMILIES, rope_type
    from dist_eval.swarm.devices import model_weights
    from dist_eval.swarm.status import model_block_parameters

    folder = tmp_path / "qwen3moe5"
    folder.mkdir()
    raw = {"model_type": "qwen3_moe", "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 8, "num_hidden_layers": 2, "intermediate_size": 32, "moe_intermediate_size": 8,
           "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 32, "dtype": "bfloat16",
           "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    (folder / "config.json").write_text(json.dumps(raw))
    assert family_of_folder(str(folder)) is FAMILIES["qwen3_moe"]
    register()
    # dist_eval's config class of the family (what it reads a folder with; AutoConfig's on the pinned stack, where
    # transformers has no qwen3_moe: on 5.x AutoConfig gives 5.x's own class, which keeps rope_theta in
    # rope_parameters)
    config = family_class(FAMILIES["qwen3_moe"].local_class, in_petals=False).config_class.from_pretrained(str(folder))
    assert (config.num_experts, config.rope_theta) == (4, 1e6)
    assert rope_type(config.rope_scaling) in (None, "default")  # no scaling (5.x: rope_scaling is rope_parameters)
    assert configs_are_dataclasses() or type(AutoConfig.from_pretrained(str(folder))) is type(config)
    four = {**{k: v for k, v in raw.items() if k not in ("num_local_experts", "rope_parameters", "dtype")},
            "num_experts": 4, "rope_theta": 1e6}
    (tmp_path / "four").mkdir()
    (tmp_path / "four" / "config.json").write_text(json.dumps(four))
    assert model_block_parameters(str(folder)) == model_block_parameters(str(tmp_path / "four"))
    assert model_weights(str(folder))[1] == "bfloat16"  # dtype, 5.x's name of torch_dtype
    assert getattr(SimpleNamespace(**read_config_json(str(folder))), READ_AS) == {
        "rope_theta": 1e6, "rope_scaling": None, "num_experts": 4}


def test_a_config_json_that_is_not_an_object_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(UsageError, match=r"config\.json: expected a JSON object, found list"):
        read_config_json(str(tmp_path))
    os.remove(tmp_path / "config.json")
    with pytest.raises(UsageError, match="cannot read its config.json"):
        read_config_json(str(tmp_path))


def test_the_rope_a_client_compares_with_its_servers_is_the_rope_the_blocks_read():
    """rope_settings, which a client compares with each server's announcement (leave_out_other_rope): the same
    RoPE in either generation's form (5.x writes a yarn's original length in) or with a length its kind does not
    read compares equal; an added scaling, another base, factor or original length differs; a setting one file
    leaves out (its class's default) is not compared."""
    from dist_eval.backends.config_json import rope_differences, rope_settings

    def settings(**fields):
        return rope_settings(read_as_saved({"model_type": "qwen2", "max_position_embeddings": 32768, **fields}, "x"))

    hub = settings(rope_theta=1000000.0)
    assert hub == {"rope_theta": 1000000.0, "rope_scaling": None}
    assert rope_differences(hub, settings(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})) == []
    assert rope_differences(hub, settings(rope_theta=1000000.0, rope_scaling={"type": "default"})) == []
    assert rope_differences(hub, settings(rope_theta=1000000.0, max_position_embeddings=131072)) == []
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    long = settings(rope_theta=1000000.0, rope_scaling=yarn, max_position_embeddings=131072)
    assert rope_differences(hub, long) == ["rope_scaling"]
    assert long["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert rope_differences(long, settings(rope_parameters={**yarn, "rope_theta": 1000000.0, "rope_type": "yarn"},
                                           max_position_embeddings=131072)) == []
    # a yarn factor and original length given: the length is not read (the card's file beside the hub's length)
    assert rope_differences(long, settings(rope_theta=1000000.0, rope_scaling=yarn)) == []
    unfactored = {"type": "yarn", "original_max_position_embeddings": 32768}
    assert rope_differences(settings(rope_scaling=unfactored), settings(
        rope_scaling=unfactored, max_position_embeddings=131072)) == ["max_position_embeddings"]
    # a 4.x file's yarn without its original length, saved again by 5.x (which writes the length in): the same;
    # a top-level original length (read before the settings' own) on one side only: not
    bare = {"type": "yarn", "factor": 4.0}
    assert rope_differences(settings(rope_scaling=bare), settings(
        rope_parameters={**bare, "original_max_position_embeddings": 32768, "rope_theta": 10000.0})) == []
    assert rope_differences(long, settings(rope_theta=1000000.0, rope_scaling=yarn, max_position_embeddings=131072,
                                           original_max_position_embeddings=4096)) == ["rope_scaling"]
    assert rope_differences(hub, settings(rope_theta=10000.0)) == ["rope_theta"]
    assert rope_differences(hub, settings()) == ["rope_theta"]  # qwen2's default base: transformers' 10000
    half = settings(rope_theta=1000000.0, partial_rotary_factor=0.5)
    assert rope_differences(hub, half) == [] and rope_differences(
        half, settings(rope_theta=1000000.0, partial_rotary_factor=1.0)) == ["partial_rotary_factor"]
