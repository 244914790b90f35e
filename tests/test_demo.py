"""The built-in demo assets (dist_eval.demo): shipped with the package, made by dist_eval.demo_build,
written into the cache once by two concurrent processes.

Nothing is mocked: the fixture starts two Python processes that call ``demo_assets`` on the
same empty cache at the same time (as two torchrun ranks do); one must write the files, the
other must wait and then read the finished folder. The shipped assets must be those the build
code in the repository makes (``test_the_shipped_assets_are_made_by_the_build_code_here``): the
bits of a build differ by CPU, so that test compares what they were made from, not bytes.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from float_promises import assert_within_rounding

from dist_eval import demo, demo_build
from dist_eval.atomic import cache_folder, file_sha256
from dist_eval.demo import DEMO_VERSION, DemoAssets, demo_assets, shipped_families, shipped_manifest


@pytest.fixture(scope="module")
def built(demo_build):
    """(cache, each process's output, the DemoAssets each returned): see conftest.demo_build."""
    return demo_build


@pytest.fixture(scope="module")
def assets(built) -> DemoAssets:
    return built[2][0]


@pytest.fixture(scope="module")
def manifest(assets):
    with open(os.path.join(os.path.dirname(assets.model_dir), "manifest.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def dataset(assets):
    import datasets

    return datasets.load_from_disk(assets.data_dir)


@pytest.fixture(scope="module")
def tokenizer(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets.model_dir, local_files_only=True)


def test_concurrent_callers_write_once_and_agree(built):
    cache, outputs, returned = built
    builders = [out for out in outputs if "LOG writing the built-in demo's files" in out]
    assert len(builders) == 1, outputs
    assert returned[0] == returned[1]
    final = os.path.join(cache, f"demo-v{DEMO_VERSION}")
    assert returned[0].model_dir == os.path.join(final, "model")
    # Only the finished folder and the lock file are left: no temporary build folder.
    assert sorted(os.listdir(cache)) == sorted([f"demo-v{DEMO_VERSION}", f"demo-v{DEMO_VERSION}.lock"])
    # The writer logged one short line, without progress bars.
    log_lines = [line for line in builders[0].splitlines() if line.startswith("LOG ")]
    assert len(log_lines) == 1 and len(log_lines[0]) < 160, log_lines
    assert "\r" not in builders[0]


def test_manifest(assets, manifest):
    assert manifest == shipped_manifest("llama")  # the shipped assets, copied
    assert manifest["num_labels"] == assets.num_labels == len(assets.label_names)
    assert tuple(manifest["label_names"]) == assets.label_names
    assert manifest["tuning_mode"] == assets.tuning_mode == "ptune"
    assert manifest["pre_seq_len"] == assets.pre_seq_len > 0
    assert manifest["accuracy"]["test"] > 0.90
    assert manifest["build_seconds"] > 0  # recorded for the report, not asserted (a timing)
    assert manifest["splits"] == {"train": demo.NUM_TRAIN, "test": demo.NUM_TEST}


@pytest.mark.parametrize("family", shipped_families())
def test_the_shipped_assets_are_made_by_the_build_code_here(family):
    """Each family's shipped assets were made by this repository's dist_eval/demo_build.py and
    that family's small config, on the data dist_eval/demo.py generates, and are whole: after a
    change of either, run ``python -m dist_eval.demo_build`` and commit what it writes."""
    from dist_eval.backends.families import FAMILIES

    manifest = shipped_manifest(family)
    assert family in FAMILIES and manifest["family"] == family
    assert manifest["build_fingerprint"] == demo_build.build_fingerprint(family), (
        f"dist_eval/demo_build.py, a module it builds through ({', '.join(demo_build.BUILD_MODULES)}) or "
        f"{family}'s small_config changed after its demo was made: run python -m dist_eval.demo_build {family} "
        f"and commit dist_eval/demo_assets/{family}")
    assert manifest["data_sha256"] == demo.data_sha256(demo.make_dataset())
    folder = os.path.join(demo.SHIPPED_DIR, family)
    on_disk = {os.path.relpath(os.path.join(root, name), folder)
               for root, _, names in os.walk(folder) for name in names} - {demo.MANIFEST}
    assert on_disk == set(manifest["files"])
    for relative, digest in manifest["files"].items():
        assert file_sha256(os.path.join(folder, relative)) == digest, relative
    assert manifest["accuracy"]["test"] > 0.90 and manifest["built_with"]["epochs"] == list(demo_build.EPOCHS)


def test_the_fingerprint_covers_the_code_the_build_goes_through():
    """Issue 69: the fingerprint covered demo_build.py and the small config only, not the code the build
    trains through. Every module demo_build.py imports from, and the one defining each name it imports,
    is in BUILD_MODULES (those whose code runs in a build: the quick build's test), and a change of any of
    them (or of demo_build.py) changes the fingerprint: the shipped assets' check above then fails until
    they are made again."""
    import ast
    import importlib
    import inspect

    used = set()
    for node in ast.walk(ast.parse(demo_build.module_source("dist_eval.demo_build"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dist_eval"):
            used.add(node.module)
            for alias in node.names:
                named = getattr(importlib.import_module(node.module), alias.name)
                used.add(named.__name__ if inspect.ismodule(named) else getattr(named, "__module__", node.module))
        elif isinstance(node, ast.Import):
            used.update(alias.name for alias in node.names if alias.name.startswith("dist_eval"))
    assert {"dist_eval.backends.local", "dist_eval.backends.classifier", "dist_eval.demo"} <= used  # what it sees
    assert used <= set(demo_build.BUILD_MODULES), f"not in the fingerprint: {used - set(demo_build.BUILD_MODULES)}"
    fingerprint = demo_build.build_fingerprint("llama")
    for changed in ("dist_eval.demo_build", *demo_build.BUILD_MODULES):
        edited = demo_build.build_fingerprint(
            "llama", lambda module, changed=changed: demo_build.module_source(module) + (b"\n#\n" if module == changed
                                                                                         else b""))
        assert edited != fingerprint, f"{changed} edited, the fingerprint unchanged"


# modules whose code runs in a build but does not make what it writes, and why
RUN_BUT_NOT_FINGERPRINTED = {
    "dist_eval": "the package's lazy exports",
    "dist_eval.backends.provenance": "the loaded model's identity for the row store, not written in the assets",
    "dist_eval.backends.hub": "a local folder resolved to itself (load_model's hub ids)",
    "dist_eval.backends.arguments": "load_model's label words: none in the build",
    "dist_eval.backends.peft_adapter": "the checkpoint looked at as a PEFT adapter: the build's is dist_eval's file",
}


def _modules_run(call) -> set:
    """The modules of dist_eval (but demo_build) with a function that runs during ``call()``: its calls traced
    (class bodies and module code, which run once at import, aside)."""
    import inspect
    import sys
    import threading

    root, ran = os.path.dirname(os.path.dirname(os.path.abspath(demo.__file__))), set()

    def note(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_flags & inspect.CO_OPTIMIZED and code.co_filename.startswith(root):
            ran.add(code.co_filename)

    sys.setprofile(note)
    threading.setprofile(note)
    try:
        call()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    modules = {os.path.relpath(path, root)[:-3].replace(os.sep, ".") for path in ran if path.endswith(".py")}
    return {m[:-len(".__init__")] if m.endswith(".__init__") else m for m in modules if m.startswith("dist_eval")}


# the files a tokenizer's save_pretrained writes on either transformers: the shipped folder's are the pinned 4.33's
# (special_tokens_map.json too); 5.x writes the special tokens in tokenizer_config.json alone
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}


def shipped_files_as_saved_here(folder) -> set:
    """The shipped llama demo's files, its tokenizer's as this transformers' save_pretrained writes them."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>").save_pretrained(folder)
    saved = set(os.listdir(folder))
    assert {"tokenizer.json", "tokenizer_config.json"} <= saved <= TOKENIZER_FILES, saved
    shipped, tokenizer = set(shipped_manifest("llama")["files"]), {"model/" + name for name in TOKENIZER_FILES}
    assert tokenizer <= shipped
    return (shipped - tokenizer) | {"model/" + name for name in saved}


def test_a_quick_build_writes_what_the_installer_reads(tmp_path):
    """The build code runs (a short build: 2 epochs on 96 rows) and writes a folder that
    load_model reads, with the manifest the installer checks; every module of dist_eval whose code
    runs while it builds is in its fingerprint (demo_build.BUILD_MODULES), or said here why not."""
    from dist_eval.backends import load_model

    root = tmp_path / "llama"
    root.mkdir()
    lines, built = [], []
    ran = _modules_run(lambda: built.append(demo_build.build(str(root), "llama", log=lines.append, epochs=(1, 1),
                                                             train_rows=96)))
    manifest = built[0]
    assert {"dist_eval.backends.blocks", "dist_eval.backends.local", "dist_eval.data.tokenize"} <= ran  # it sees
    unknown = ran - {"dist_eval.demo_build", *demo_build.BUILD_MODULES, *RUN_BUT_NOT_FINGERPRINTED}
    assert not unknown, f"the build runs code of {sorted(unknown)}: add it to demo_build.BUILD_MODULES"
    assert json.loads((root / demo.MANIFEST).read_text()) == manifest
    assert manifest["build_fingerprint"] == demo_build.build_fingerprint("llama")
    assert set(manifest["files"]) == shipped_files_as_saved_here(tmp_path / "saved")
    assert manifest["splits"] == {"train": 96, "test": demo.NUM_TEST}
    loaded = load_model("local", str(root / "model"), checkpoint=str(root / "checkpoint.pt"))
    assert loaded.num_labels == demo.NUM_LABELS and loaded.pad_token_id == demo.PAD_ID
    assert any("test accuracy" in line for line in lines)


def test_a_cache_of_other_assets_is_written_again(built, tmp_path):
    """A cached folder whose manifest is not the shipped one (an earlier release's) is replaced."""
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(built[0], cache)
    final = cache / f"demo-v{DEMO_VERSION}"
    stale = json.loads((final / demo.MANIFEST).read_text())
    stale["data_sha256"] = "0" * 64
    (final / demo.MANIFEST).write_text(json.dumps(stale))
    lines = []
    again = demo_assets(str(cache), log=lines.append)
    assert (again.model_dir, again.data_dir, again.checkpoint) == (str(final / "model"), str(final / "data"),
                                                                   str(final / "checkpoint.pt"))
    assert json.loads((final / demo.MANIFEST).read_text()) == shipped_manifest("llama")
    assert len(lines) == 1 and "writing the built-in demo's files" in lines[0]


def test_the_flags_help_names_the_shipped_families():
    from dist_eval.config import _DEMO_FAMILY

    assert f"shipped with dist_eval ({', '.join(shipped_families())})." in _DEMO_FAMILY


def test_a_family_that_is_not_shipped_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no built-in demo of the family 'gpt2'"):
        demo_assets(str(tmp_path), log=lambda line: None, family="gpt2")


def test_dataset(assets, dataset):
    import datasets

    assert isinstance(dataset, datasets.DatasetDict)
    assert {"train", "test"} <= set(dataset)
    assert assets.split == "test"
    for split in ("train", "test"):
        part = dataset[split]
        assert part.column_names == [assets.text_column, assets.label_column]
        feature = part.features[assets.label_column]
        assert isinstance(feature, datasets.ClassLabel)
        assert tuple(feature.names) == assets.label_names and len(feature.names) >= 3
        labels = list(part[assets.label_column])
        assert set(labels) == set(range(assets.num_labels))
        assert min(labels.count(k) for k in range(assets.num_labels)) > len(labels) / (2 * assets.num_labels)
        lengths = [len(text.split()) for text in list(part[assets.text_column])]
        assert min(lengths) <= 8 and max(lengths) >= 30
        assert len(set(lengths)) > 20
    assert 2000 <= dataset["train"].num_rows <= 4000 and 500 <= dataset["test"].num_rows <= 1000
    # Held out: generated separately, not copies of train rows (short ones may coincide by chance).
    train_texts = set(list(dataset["train"][assets.text_column]))
    overlap = sum(text in train_texts for text in dataset["test"][assets.text_column])
    assert overlap < 0.01 * dataset["test"].num_rows


def test_generation_is_deterministic(dataset):
    texts, labels = demo.make_examples(dataset["train"].num_rows, demo.SEED)
    assert (texts, labels) == demo.make_examples(dataset["train"].num_rows, demo.SEED)
    # The saved split is exactly what the seed generates.
    assert texts == list(dataset["train"]["text"]) and labels == list(dataset["train"]["label"])
    assert demo.make_examples(dataset["train"].num_rows, demo.SEED + 7)[0] != texts


def test_tokenizer_never_emits_pad_for_text(assets, dataset, tokenizer):
    assert tokenizer.pad_token == "<pad>" and tokenizer.pad_token_id == 0
    assert tokenizer.unk_token_id not in (None, 0)
    texts = list(dataset["train"]["text"]) + list(dataset["test"]["text"])
    encoded = tokenizer(texts)["input_ids"]
    for text, ids in zip(texts, encoded):
        assert 0 not in ids
        assert len(ids) == len(text.split())  # one id per word, nothing added around the text
        assert tokenizer.unk_token_id not in ids
    # Unknown words and punctuation map to <unk>, never to the pad id.
    odd = tokenizer("Zebras, quietly juggling 42 teacups!")["input_ids"]
    assert odd and 0 not in odd and set(odd) == {tokenizer.unk_token_id}
    assert tokenizer.decode(encoded[0]) == texts[0]


def test_model_folder_is_a_causal_lm_without_head(assets, tokenizer):
    from safetensors import safe_open
    from transformers import AutoConfig

    from dist_eval.backends.checkpoint import load_checkpoint, model_dir_trainable_state

    config = AutoConfig.from_pretrained(assets.model_dir)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert config.pad_token_id == 0 and config.vocab_size == len(tokenizer)
    assert config.hidden_size == 64 and config.num_hidden_layers == 4 and config.max_position_embeddings >= 128
    with safe_open(os.path.join(assets.model_dir, "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert "model.layers.3.self_attn.q_proj.weight" in keys and "lm_head.weight" in keys
    assert not any(key.endswith("score.weight") for key in keys)
    assert model_dir_trainable_state(assets.model_dir) is None
    state = load_checkpoint(assets.checkpoint)
    assert state.tuning_mode == "ptune" and state.pre_seq_len == assets.pre_seq_len
    assert state.num_labels == assets.num_labels
    assert tuple(state.tensors["score.weight"].shape) == (assets.num_labels, config.hidden_size)
    assert tuple(state.tensors["prompt_embeddings.weight"].shape) == (assets.pre_seq_len, config.hidden_size)


def _right_pad(rows):
    batch = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for i, ids in enumerate(rows):
        batch[i, : len(ids)] = torch.tensor(ids)
    return batch


def test_local_model_accuracy_on_test_split(assets, dataset, tokenizer, manifest):
    from dist_eval.backends import load_model

    loaded = load_model("local", assets.model_dir, checkpoint=assets.checkpoint)
    assert loaded.num_labels == assets.num_labels and loaded.pad_token_id == 0
    test = dataset[assets.split]
    ids = tokenizer(list(test[assets.text_column]))["input_ids"]
    labels = torch.tensor(list(test[assets.label_column]))
    predictions = []
    with torch.no_grad():
        for start in range(0, len(ids), 32):  # dataset order: batches mix short and long rows
            predictions.append(loaded.module(_right_pad(ids[start : start + 32])).argmax(-1))
        predictions = torch.cat(predictions)
        accuracy = float((predictions == labels).float().mean())
        assert accuracy > 0.90
        assert abs(accuracy - manifest["accuracy"]["test"]) < 0.01
        # Every class is predicted well, not just the majority.
        for k in range(assets.num_labels):
            assert float((predictions[labels == k] == k).float().mean()) > 0.8
        # Right padding without attention mask: a row's logits do not depend on its batch-mates.
        batch = loaded.module(_right_pad(ids[:8]))
        for i in range(8):
            alone = loaded.module(_right_pad([ids[i]]))[0]
            assert_within_rounding(batch[i], alone, f"row {i} in a batch of 8, against alone",
                                   why="another batch: the row alone, unpadded, against the row padded in a batch")


def test_second_call_returns_the_cached_assets(built, assets, monkeypatch):
    cache = built[0]
    lines = []

    def no_build(*args, **kwargs):
        raise AssertionError("the cached assets were built again")

    monkeypatch.setattr(demo, "_install", no_build)
    again = demo_assets(cache, log=lines.append)
    assert again == assets
    assert lines == []  # nothing rebuilt, nothing waited for


def test_incomplete_folder_is_not_taken_for_assets(tmp_path):
    partial = tmp_path / f"demo-v{DEMO_VERSION}"
    (partial / "model").mkdir(parents=True)
    (partial / "data").mkdir()
    assert demo._read_assets(str(partial), shipped_manifest("llama")) is None  # no manifest: a copy that did not finish


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DIST_EVAL_CACHE", str(tmp_path / "c"))
    assert cache_folder() == str(tmp_path / "c")  # the demo's default cache_dir
    monkeypatch.delenv("DIST_EVAL_CACHE")
    assert cache_folder() == os.path.join(os.path.expanduser("~"), ".cache", "dist_eval")


@pytest.fixture(scope="module", params=["bloom", "falcon"])
def other_family(request, built, tmp_path_factory):
    """--demo-family: the demo of another family, written in a cache of its own: (family, cache, its DemoAssets)."""
    cache = str(tmp_path_factory.mktemp(f"demo_{request.param}"))
    return request.param, cache, demo_assets(cache, log=lambda line: None, family=request.param)


def test_the_family_is_part_of_the_cache_key(built, assets, other_family):
    """Another family's assets go to demo-v<N>-<family>; the default's stay where they were."""
    family, cache, other = other_family
    assert demo_assets(built[0], log=lambda line: None, family="llama") == assets  # the default, unchanged
    assert other.model_dir == os.path.join(cache, f"demo-v{DEMO_VERSION}-{family}", "model")
    with open(os.path.join(other.model_dir, "config.json")) as f:
        assert json.load(f)["model_type"] == family
    assert demo_assets(cache, log=lambda line: None, family=family) == other  # found, not written again


@pytest.mark.swarm
@pytest.mark.multiproc
def test_the_other_families_demos_run_on_a_local_swarm(other_family, tmp_path, rank_zygote):
    """``torchrun -m dist_eval --demo-family F``, as the docs offer it: a local swarm of that
    family's demo model, the task learned, and the same predictions as the local backend. The one
    rank is forked (conftest's run_ranks, torchrun's environment): the demo is tested, not the launch."""
    from unittest import mock

    from conftest import read_jsonl, run_ranks
    from inprocess_cli import run_cli_in_process
    from test_cli import no_figures_env

    family, cache, _ = other_family
    outs = {}
    for backend in ("petals", "local"):
        out = tmp_path / backend
        args = ["--demo-family", family, "--backend", backend, "--output-dir", str(out), "--save-logits"]
        if backend == "local":  # the reference: the CLI's code in this process, one thread (as a rank)
            with mock.patch.dict(os.environ, {"DIST_EVAL_CACHE": cache}):
                assert run_cli_in_process(args, hide_modules=("matplotlib",)) == 0  # no figure compared
        else:
            env = {"DIST_EVAL_CACHE": cache, **no_figures_env(tmp_path / "hidden")}  # no figure compared
            proc = run_ranks(rank_zygote, args, nproc=1, timeout=600, env=env)
            assert proc.returncode == 0, proc.stderr[-3000:]
        outs[backend] = (json.load(open(out / "metrics.json")), read_jsonl(out / "predictions.jsonl"))
    (metrics, rows), (local_metrics, local_rows) = outs["petals"], outs["local"]
    assert metrics["run"]["demo"] is True and metrics["run"]["backend"] == "petals" and metrics["accuracy"] > 0.9
    assert rows == local_rows  # labels, predictions and logits
    assert {k: v for k, v in metrics.items() if k != "run"} == {k: v for k, v in local_metrics.items() if k != "run"}
