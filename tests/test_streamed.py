"""Issue 73: ``--backend local --stream-blocks`` (dist_eval/backends/streamed.py: each block read from the model's
files when the forward reaches it, freed after) in the CLI and ``load_model``: the in-memory local backend's
predictions bit for bit (N=1 in this process, N=2 on forked ranks); by hub id, a block's shards fetched when it
first runs, in the forward's order, none before; what it is refused with, in one line."""
import json
import os

import pytest
import torch
from conftest import build_checkpoint, read_jsonl, run_ranks, split_into_shards, write_csv
from fake_hub import fake_hub
from float_promises import assert_same_bits
from inprocess_cli import one_thread, run_cli_in_process
from test_cli import no_figures_env

from dist_eval import load_model
from dist_eval.atomic import file_sha256
from dist_eval.config import EvalConfig
from dist_eval.errors import UsageError

REPO_ID = "tiny-org/tiny-llama-streamed"
IDS = torch.tensor([[5, 6, 7, 8, 9, 0, 0], [10, 11, 12, 13, 14, 15, 16], [20, 0, 0, 0, 0, 0, 0]])


@pytest.mark.multiproc
def test_the_cli_with_stream_blocks_equals_the_in_memory_local_backend_n1_and_n2(tiny_model, rank_zygote, tmp_path):
    """The same 13 rows, the model's blocks in 4 shards: in memory N=1, streamed N=1 (this process), streamed N=2
    (two forked ranks in a gloo group): predictions.jsonl (logits included) bit for bit."""
    data = write_csv(str(tmp_path / "data.csv"), 13, seed=5)
    shards = split_into_shards(tiny_model, str(tmp_path / "shards"))
    common = ["--model", shards, "--backend", "local", "--data-files", data, "--batch-size", "4", "--save-logits",
              "--checkpoint", build_checkpoint(str(tmp_path / "ck.pt"), tuning_mode="deep_ptune")]
    runs = {"memory": [], "streamed": ["--stream-blocks"]}
    for name, extra in runs.items():
        assert run_cli_in_process([*common, *extra, "--output-dir", str(tmp_path / name)],
                                  hide_modules=("matplotlib",)) == 0, name
    proc = run_ranks(rank_zygote, [*common, "--stream-blocks", "--output-dir", str(tmp_path / "streamed2")], nproc=2,
                     env=no_figures_env(tmp_path / "hidden"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    memory = read_jsonl(tmp_path / "memory" / "predictions.jsonl")
    assert len(memory) == 13 and "logits" in memory[0]
    for name in ("streamed", "streamed2"):
        assert_same_bits(read_jsonl(tmp_path / name / "predictions.jsonl"), memory,
                         f"predictions.jsonl, {name} against the in-memory local backend")


def test_stream_blocks_is_refused_where_it_cannot_apply_in_one_line(tiny_model, tmp_path):
    """--stream-blocks with --backend petals (flags and load_model) or another device than the CPU: one line
    naming the flag, before anything loads."""
    common = {"model": tiny_model, "data_files": ["d.csv"], "stream_blocks": True}
    with pytest.raises(UsageError, match=r"^stream_blocks: expected backend 'local': the blocks of backend "
                                         r"'petals' are computed elsewhere") as e:
        EvalConfig(backend="petals", **common)
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match=r"^device='cuda': expected cpu: the blocks streamed from disk"):
        EvalConfig(backend="local", device="cuda", **common)
    with pytest.raises(UsageError, match=r"^stream_blocks: expected backend 'local'"):
        load_model("petals", tiny_model, checkpoint=build_checkpoint(str(tmp_path / "ck.pt")), stream_blocks=True)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A private HF cache (the user's is untouched), online."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return tmp_path / "hf_cache"


def test_streaming_by_hub_id_fetches_a_blocks_shards_when_it_first_runs(tiny_model, hub_cache, tmp_path,
                                                                         monkeypatch):
    """``load_model("local", org/name, stream_blocks=True)`` on a fake hub serving a folder of a shard per block:
    the load fetches the client's files alone; the first forward fetches block 0's shard, then 1's, 2's, 3's, in
    that order, each once (the second forward fetches nothing); the logits equal the folder's in memory, bit for
    bit. The CLI on the hub id (in this process, a cache of its own: its blocks fetched during its run) writes the
    same predictions as the folder, and its receipt names every file it read, those fetched after the load too."""
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"))
    sharded = split_into_shards(tiny_model, str(tmp_path / "sharded"))
    with one_thread(), torch.no_grad():
        whole = load_model("local", sharded, checkpoint=checkpoint).module(IDS)
    blocks = [f"model-blocks-{i}.safetensors" for i in range(4)]
    with fake_hub({REPO_ID: sharded}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        streamed = load_model("local", REPO_ID, checkpoint=checkpoint, stream_blocks=True)
        at_load = hub.files("GET")
        assert "model-client.safetensors" in at_load and "config.json" in at_load, at_load
        assert not set(at_load) & set(blocks), at_load  # no block's shard before the forward
        with one_thread(), torch.no_grad():
            first = streamed.module(IDS)
            assert hub.files("GET")[len(at_load):] == blocks  # a block's shard at a time, in the forward's order
            second = streamed.module(IDS)
        assert hub.files("GET")[len(at_load):] == blocks  # fetched once
        assert_same_bits(first, whole, "the logits, streamed by hub id against the folder in memory")
        assert_same_bits(second, whole, "the second forward's logits")
        data = write_csv(str(tmp_path / "data.csv"), 9, seed=6)
        common = ["--backend", "local", "--data-files", data, "--checkpoint", checkpoint, "--batch-size", "4",
                  "--save-logits"]
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache_cli"))
        for name, model, extra in (("hub", REPO_ID, ["--stream-blocks"]), ("folder", sharded, [])):
            assert run_cli_in_process(["--model", model, *common, *extra, "--output-dir", str(tmp_path / name)],
                                      hide_modules=("matplotlib",)) == 0, name
    assert_same_bits(read_jsonl(tmp_path / "hub" / "predictions.jsonl"),
                     read_jsonl(tmp_path / "folder" / "predictions.jsonl"),
                     "predictions.jsonl, --stream-blocks on the hub id against the folder in memory")
    read = json.load(open(tmp_path / "hub" / "metrics.json"))["run"]["receipt"]["model"]["files"]
    assert set(blocks) <= set(read), sorted(read)  # fetched after the load, read by the run
    assert read == {name: file_sha256(os.path.join(sharded, name)) for name in read}


def test_a_hub_id_without_stream_blocks_or_fetch_whole_model_names_both(tiny_model, hub_cache, tmp_path,
                                                                        monkeypatch):
    from dist_eval.backends.hub import resolve_model

    sharded = split_into_shards(tiny_model, str(tmp_path / "sharded"))
    with fake_hub({REPO_ID: sharded}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        with pytest.raises(UsageError) as e:
            resolve_model(REPO_ID, "local", None)
    assert "--stream-blocks to fetch each block's shards when it runs" in str(e.value)
    assert "--fetch-whole-model" in str(e.value) and "\n" not in str(e.value)


def rotary_table(backbone):
    """The rotary table block 0 computes with: its attention's own (4.33, the table an old checkpoint saved), or
    the backbone's, which every block is given (4.5x and 5.x, where the saved one is a key no module has)."""
    attention = backbone.layers[0].self_attn
    return (attention.rotary_emb if hasattr(attention, "rotary_emb") else backbone.rotary_emb).inv_freq


def test_a_saved_rotary_table_is_not_read_into_the_streamed_model(tiny_model, tmp_path):
    """A checkpoint saved before transformers 4.31 holds each block's rotary table (``rotary_emb.inv_freq``, a
    non-persistent buffer): the model loaded whole keeps its own, and so does the streamed one (its blocks' saved
    persistent buffers are read from the files, not these): the same logits bit for bit with a wrong table saved."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "old-llama"
    shutil.copytree(tiny_model, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    head_dim = tensors["model.layers.0.self_attn.q_proj.weight"].shape[1] // 4  # tiny_model: 4 heads
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(head_dim // 2, dtype=torch.float16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"))
    models = [load_model("local", str(folder), checkpoint=checkpoint, stream_blocks=s) for s in (False, True)]
    tables = [rotary_table(model.module.hf_model.model) for model in models]
    assert_same_bits(tables[1], tables[0], "the streamed model's rotary table against the whole one's")
    assert tables[0].abs().min() > 0  # its own, not the zeros saved
    with one_thread(), torch.no_grad():
        whole, streamed = (model.module(IDS) for model in models)
    assert_same_bits(streamed, whole, "the streamed model's logits against the whole one's, a rotary table saved")
