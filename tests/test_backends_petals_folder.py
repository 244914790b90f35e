"""dist_eval.backends.petals_folder: model folders converted to the layout petals' server and
client read. No swarm here (the real swarm check is tests/test_families_swarm.py)."""
import json
import os
import re

import pytest
import torch
from conftest import build_tiny_model

from dist_eval.backends.blocks import family_class
from dist_eval.backends.compat import configs_are_dataclasses
from dist_eval.backends.families import FAMILIES
from dist_eval.backends.petals_folder import detect_layout, petals_model_folder, weight_map
from dist_eval.errors import UsageError

LAYOUTS = ["causal_lm", "base", "seq_cls"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("family_folders")
    out = {}
    for family in FAMILIES:
        for layout in LAYOUTS:
            out[family, layout] = build_tiny_model(str(root / f"{family}-{layout}"), family=family, layout=layout)
    return out


# (family, layout) -> (block prefix found, petals reads it as it is)
EXPECTED = {
    ("llama", "causal_lm"): ("model.layers", True),
    ("llama", "base"): ("layers", False),
    ("llama", "seq_cls"): ("model.layers", True),
    ("bloom", "causal_lm"): ("transformer.h", False),
    ("bloom", "base"): ("h", True),
    ("bloom", "seq_cls"): ("transformer.h", False),
    ("falcon", "causal_lm"): ("transformer.h", True),
    ("falcon", "base"): ("h", False),
    ("falcon", "seq_cls"): ("transformer.h", True),
}


@pytest.mark.parametrize("family,layout", sorted(EXPECTED))
def test_layout_and_conversion(folders, tmp_path, family, layout):
    from safetensors import safe_open

    spec = FAMILIES[family]
    folder = folders[family, layout]
    found = detect_layout(folder)
    assert found.family is spec and found.num_blocks == 4
    prefix, ready = EXPECTED[family, layout]
    assert found.block_prefix == prefix
    served = petals_model_folder(folder, cache_dir=str(tmp_path))
    assert (served == folder) == ready
    if ready:
        return
    # what petals' server looks up: <block_prefix>.<i>.<name>, through the index
    mapping = weight_map(served)
    for i in range(4):
        keys = [k for k in mapping if k.startswith(f"{spec.server_blocks}.{i}.")]
        assert keys, (i, sorted(mapping)[:8])
        for key in keys:
            with safe_open(os.path.join(served, mapping[key]), framework="pt") as f:
                assert key in f.keys()  # noqa: SIM118 - a safe_open handle is not iterable
    # one layout for every tensor: the hub's (BLOOM: BloomModel's, no head; others prefixed, heads kept)
    client = [k for k, f in mapping.items() if f == "client.safetensors"]
    if family == "bloom":
        assert not any(k.startswith(("transformer.", "score.")) for k in mapping)
    else:
        assert all(k.startswith(spec.checkpoint_prefix) or k.startswith(("score.", "lm_head.")) for k in client)
        assert ("score.weight" in mapping) == (layout == "seq_cls")
    for name in ("config.json", "tokenizer.json"):
        assert os.path.isfile(os.path.join(served, name))
    # the same weights: a transformers classifier loads both folders identically
    cls = family_class(spec.local_class, in_petals=False)
    a = cls.from_pretrained(folder, num_labels=3).state_dict()
    b = cls.from_pretrained(served, num_labels=3).state_dict()
    for key, value in a.items():
        if key != "score.weight" or (layout == "seq_cls" and family != "bloom"):
            assert torch.equal(value, b[key]), key
    # converted once, then reused
    mtime = os.stat(os.path.join(served, "model.safetensors.index.json")).st_mtime_ns
    assert petals_model_folder(folder, cache_dir=str(tmp_path)) == served
    assert os.stat(os.path.join(served, "model.safetensors.index.json")).st_mtime_ns == mtime
    assert [e for e in os.listdir(tmp_path) if e.startswith(".tmp")] == []


def test_changed_source_is_converted_again(tmp_path):
    folder = build_tiny_model(str(tmp_path / "bloom"), family="bloom", num_layers=2)
    first = petals_model_folder(folder, cache_dir=str(tmp_path / "cache"))
    build_tiny_model(folder, family="bloom", num_layers=2, seed=5)
    os.utime(os.path.join(folder, "model.safetensors"), ns=(1, 1))
    assert petals_model_folder(folder, cache_dir=str(tmp_path / "cache")) != first


def test_folder_without_blocks_is_refused(tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bloom"}))
    save_file({"model.layers.0.x": torch.zeros(1)}, str(folder / "model.safetensors"))
    expected = re.escape("under 'transformer.h.<i>.' or 'h.<i>.'; this one has neither")
    with pytest.raises(UsageError, match=expected):
        detect_layout(str(folder))
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UsageError, match="the families that work: bloom, deepseek_v3, "):  # (the list grows)
        detect_layout(str(folder))


def test_pytorch_bin_folder_is_converted(tmp_path):
    """A folder saved with safe_serialization=False (pytorch_model.bin) converts the same way."""
    import transformers

    src = build_tiny_model(str(tmp_path / "st"), family="bloom", num_layers=2)
    model = transformers.BloomForCausalLM.from_pretrained(src)
    # what save_pretrained(safe_serialization=False) writes (the pinned transformers; 5.x writes safetensors whatever
    # it is told): the config and the state dict, pickled
    model.config.save_pretrained(str(tmp_path / "bin"))
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    assert sorted(os.listdir(tmp_path / "bin")) == ["config.json", "pytorch_model.bin"]
    served = petals_model_folder(str(tmp_path / "bin"), cache_dir=str(tmp_path / "cache"))
    assert "h.1.self_attention.dense.weight" in weight_map(served)
    a = transformers.BloomModel.from_pretrained(src).state_dict()
    b = transformers.BloomModel.from_pretrained(served).state_dict()
    assert all(torch.equal(v, b[k]) for k, v in a.items())


@pytest.mark.parametrize("family", ["bloom", "falcon"])
def test_base_layout_with_a_head_is_converted(tmp_path, family):
    """A base-model layout plus score.weight: the pinned transformers (so petals' client) raises "The state
    dictionary of the model you are trying to load is corrupted" (5.x reads it); the converted copy loads."""
    from safetensors.torch import load_file, save_file

    spec = FAMILIES[family]
    folder = build_tiny_model(str(tmp_path / "m"), family=family, layout="base", num_layers=2)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors["score.weight"] = torch.ones(3, 32)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    cls = family_class(spec.local_class, in_petals=False)
    if configs_are_dataclasses():  # transformers 5.x reads it itself, the head with it
        assert torch.equal(cls.from_pretrained(folder, num_labels=3).score.weight, torch.ones(3, 32))
    else:
        with pytest.raises(ValueError, match="corrupted"):
            cls.from_pretrained(folder, num_labels=3)
    layout = detect_layout(folder)
    assert not layout.client_ready and layout.server_ready == (family == "bloom")
    served = petals_model_folder(folder, cache_dir=str(tmp_path / "cache"))
    loaded = cls.from_pretrained(served, num_labels=3)
    # Falcon keeps the head (prefixed layout); BLOOM's copy leaves it out (dist_eval reads it from the source)
    assert torch.equal(loaded.score.weight, torch.ones(3, 32)) == (family == "falcon")


def test_a_converted_copy_of_a_private_folder_stays_private(tmp_path):
    """Issue 50. Before: the converted copy was made 0777 & ~umask, its weights 0666 & ~umask (readable
    by everyone), whatever the source folder's permissions."""
    import stat

    folder = build_tiny_model(str(tmp_path / "bloom"), family="bloom", num_layers=2)  # converted (EXPECTED)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o600)
    os.chmod(folder, 0o700)
    served = petals_model_folder(folder, cache_dir=str(tmp_path / "cache"))
    assert served != folder
    modes = {name: stat.S_IMODE(os.stat(os.path.join(served, name)).st_mode) for name in os.listdir(served)}
    assert stat.S_IMODE(os.stat(served).st_mode) == 0o700
    assert "client.safetensors" in modes and any(name.startswith("blocks-") for name in modes)
    assert set(modes.values()) == {0o600}, modes
    # a group-readable source: the copy as readable, no more
    other = build_tiny_model(str(tmp_path / "shared"), family="bloom", num_layers=2)
    for name in os.listdir(other):
        os.chmod(os.path.join(other, name), 0o640)
    os.chmod(other, 0o750)
    shared = petals_model_folder(other, cache_dir=str(tmp_path / "cache"))
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o750
    assert {stat.S_IMODE(os.stat(os.path.join(shared, n)).st_mode) for n in os.listdir(shared)} == {0o640}


# DeepSeek-V4's release (deepseek-ai's model.safetensors.index.json; transformers 5.x's conversion mapping reads the
# same names): no model. prefix, its own names for the embeddings, the attention's kv norm and the streams' last
# collapse, the head as head.weight, a multi-token-prediction layer (mtp.<k>.) beside the blocks
V4_AS_RELEASED = ((r"^model\.", ""), (r"^embed_tokens\.", "embed."), (r"^hc_head\.hc_", "hc_head_"),
                  (r"\.attn\.norm\.", ".attn.kv_norm."), (r"^lm_head\.", "head."))
V4_TILE = 16  # config.json's weight_block_size (the release's 128)
FP4_CODES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def v4_fp8(weight: torch.Tensor) -> tuple:
    """(e4m3 weight, ue8m0 scale per V4_TILE x V4_TILE tile, the value they stand for)."""
    rows, cols = weight.shape
    tiles = weight.reshape(rows // V4_TILE, V4_TILE, cols // V4_TILE, V4_TILE)
    exponent = torch.ceil(torch.log2(tiles.abs().amax((1, 3)) / 448.0)).to(torch.int32)
    scale = torch.ldexp(torch.ones(exponent.shape), exponent)[:, None, :, None]
    codes = (tiles / scale).to(torch.float8_e4m3fn)
    value = (codes.float() * scale).reshape(rows, cols)
    return codes.reshape(rows, cols), (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu), value


def v4_fp4(weight: torch.Tensor) -> tuple:
    """(two e2m1 codes a byte, the even column low, as int8; ue8m0 scale per 32 values of a row; their value)."""
    rows, cols = weight.shape
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (rows, cols), generator=g)
    exponent = torch.randint(-6, -2, (rows, cols // 32), generator=g, dtype=torch.int32)
    value = FP4_CODES[codes] * torch.ldexp(torch.ones(exponent.shape), exponent).repeat_interleave(32, 1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu), value


def write_v4_release(saved: str, released: str) -> dict:
    """``saved`` (dist_eval's tiny DeepSeek-V4 causal LM) as transformers 5.x saves it (the head as head.weight), two of
    its weights replaced by the value of their FP8 / FP4 form; ``released`` the same model as DeepSeek ships it (those
    two quantized, each with its .scale; quantization_config fp8 and expert_dtype fp4 as config.json has them; the
    hash routing's tid2eid in int32; two shards and their index; an MTP layer). Returns the release's tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(saved, "model.safetensors"))
    tensors["head.weight"] = tensors.pop("lm_head.weight")
    g = torch.Generator().manual_seed(3)
    for key in [k for k in tensors if k.endswith(".tid2eid")]:  # a routing table of its own (built: all expert 0)
        rows, chosen = tensors[key].shape
        tensors[key] = torch.stack([torch.randperm(4, generator=g)[:chosen] for _ in range(rows)])
    release = {}
    for key, tensor in tensors.items():
        for pattern, replacement in V4_AS_RELEASED:
            key = re.sub(pattern, replacement, key)
        release[key] = tensor
    for key, quantize in (("layers.0.attn.wq_a", v4_fp8), ("layers.1.ffn.experts.0.w1", v4_fp4)):
        release[key + ".weight"], release[key + ".scale"], value = quantize(release[key + ".weight"])
        tensors["model." + key + ".weight"] = value
    save_file(tensors, os.path.join(saved, "model.safetensors"), metadata={"format": "pt"})
    for key in [k for k in release if k.endswith(".tid2eid")]:  # int32 in DeepSeek's own code (5.x saves int64)
        release[key] = release[key].to(torch.int32)
    release.update({"mtp.0.e_proj.weight": torch.ones(32, 32), "mtp.0.hc_head_fn": torch.ones(4, 128),
                    "mtp.0.attn.kv_norm.weight": torch.ones(16)})
    os.makedirs(released)
    for name in os.listdir(saved):
        if name != "model.safetensors":
            shutil.copy(os.path.join(saved, name), released)
    shards = {key: "model-00002-of-00002.safetensors" if key.startswith(("layers.2.", "mtp.")) else
              "model-00001-of-00002.safetensors" for key in release}
    for shard in set(shards.values()):
        save_file({k: v for k, v in release.items() if shards[k] == shard}, os.path.join(released, shard))
    with open(os.path.join(released, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": shards}, f)
    with open(os.path.join(released, "config.json")) as f:
        config = json.load(f)
    config.update(expert_dtype="fp4", quantization_config={
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
        "weight_block_size": [V4_TILE, V4_TILE]})
    with open(os.path.join(released, "config.json"), "w") as f:
        json.dump(config, f)
    return release


def test_a_deepseek_v4_folder_under_the_release_names_is_the_saved_model_bit_for_bit(tmp_path, monkeypatch):
    """DeepSeek-V4 as deepseek-ai ships it (embed.weight, layers.<i>.attn.kv_norm, hc_head_fn, head.weight, norm.weight,
    no model. prefix; FP8 / FP4 weights beside their .scale; an MTP layer) is read into the same tensors, logits and
    label-word scores as the model saved with transformers 5.x's names: through a converted copy under those names
    (what petals' server and client read too), the MTP layer left out, the head kept apart."""
    from dist_eval.backends import load_model
    from dist_eval.backends.checkpoint import TrainableState
    from dist_eval.backends.local import load_local

    monkeypatch.setenv("DIST_EVAL_CACHE", str(tmp_path / "cache"))
    saved = build_tiny_model(str(tmp_path / "saved"), family="deepseek_v4", num_layers=3)
    release = write_v4_release(saved, str(tmp_path / "released"))
    layout = detect_layout(str(tmp_path / "released"))
    assert layout.released and not layout.client_ready and not layout.server_ready
    served = petals_model_folder(str(tmp_path / "released"))
    with open(os.path.join(served, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(weight_map(saved)) | {
        "model.layers.0.attn.wq_a.scale", "model.layers.1.ffn.experts.0.w1.scale"}
    assert index["metadata"]["left_out"] == sorted(k for k in release if k.startswith("mtp."))
    head = {"score.weight": torch.randn(3, 32, generator=torch.Generator().manual_seed(1))}
    batch = torch.tensor([[5, 9, 3, 7, 2, 8, 4, 6, 11], [12, 3, 5, 0, 0, 0, 0, 0, 0]])
    got = {}
    for folder in (saved, str(tmp_path / "released")):
        model = load_local(folder, TrainableState(None, 0, 3, dict(head)), FAMILIES["deepseek_v4"]).eval()
        words = load_model("local", folder, label_words=["w3", "w7", "w12"])
        with torch.no_grad():
            got[folder] = model.hf_model.state_dict(), model(batch), words.module(batch)
    (state, logits, scores), (state_r, logits_r, scores_r) = got.values()
    assert any(tensor.dtype == torch.int32 for tensor in release.values())  # the hash routing's table, as released
    assert set(state) == set(state_r) and all(torch.equal(state[k], state_r[k]) for k in state)
    assert all(state[k].dtype == state_r[k].dtype for k in state)  # read into the int64 buffer
    assert torch.equal(logits, logits_r) and torch.equal(scores, scores_r)
