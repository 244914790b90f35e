"""dist_eval.backends.petals_folder: model folders converted to the layout petals' server and
client read. No swarm here (the real swarm check is tests/test_families_swarm.py)."""
import json
import os
import re

import pytest
import torch
from conftest import build_tiny_model

from dist_eval.backends.blocks import family_class
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
    model.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    assert os.path.isfile(tmp_path / "bin" / "pytorch_model.bin")
    served = petals_model_folder(str(tmp_path / "bin"), cache_dir=str(tmp_path / "cache"))
    assert "h.1.self_attention.dense.weight" in weight_map(served)
    a = transformers.BloomModel.from_pretrained(src).state_dict()
    b = transformers.BloomModel.from_pretrained(served).state_dict()
    assert all(torch.equal(v, b[k]) for k, v in a.items())


@pytest.mark.parametrize("family", ["bloom", "falcon"])
def test_base_layout_with_a_head_is_converted(tmp_path, family):
    """A base-model layout plus score.weight: transformers (so petals' client) raises "The state
    dictionary of the model you are trying to load is corrupted"; the converted copy loads."""
    from safetensors.torch import load_file, save_file

    spec = FAMILIES[family]
    folder = build_tiny_model(str(tmp_path / "m"), family=family, layout="base", num_layers=2)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors["score.weight"] = torch.ones(3, 32)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    cls = family_class(spec.local_class, in_petals=False)
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
