"""A model folder that holds only the client's shards (its index names block shards that are
absent: what petals' client keeps of a big model): ``--backend petals`` against a swarm gives
the logits of the full folder bit for bit; the local backend and a local swarm, which read
every block, refuse it in one line naming the absent shards."""
import os

import pytest
from conftest import build_checkpoint, read_jsonl, run_cli, split_into_shards, write_csv
from fake_hub import fake_hub
from float_promises import assert_same_bits
from inprocess_cli import one_thread, run_cli_in_process
from test_cli import no_figures_env

from dist_eval import evaluate, load_model
from dist_eval.errors import UsageError
from dist_eval.swarm import SwarmError


@pytest.fixture(scope="module")
def client_folder(tiny_model, tmp_path_factory):
    return split_into_shards(tiny_model, str(tmp_path_factory.mktemp("client_shards")), blocks=False)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    import datasets

    csv = write_csv(str(tmp_path_factory.mktemp("client_shards_data") / "data.csv"), 13, seed=3)
    return datasets.load_dataset("csv", data_files=csv, split="train")


@pytest.mark.swarm
def test_a_client_only_folder_on_petals_equals_the_full_folder_bitwise(tiny_swarm, tiny_model, client_folder,
                                                                       dataset, tmp_path):

    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"))
    logits = [petals_logits(tiny_swarm, folder, checkpoint, dataset) for folder in (tiny_model, client_folder)]
    assert logits[0].shape == (len(dataset), 3)
    assert_same_bits(logits[1], logits[0], "the logits, the client's shards against the full folder")


def petals_logits(swarm, folder, checkpoint, dataset):
    """The logits of ``load_model("petals", folder)`` on ``swarm``, evaluated with one thread."""
    from transformers import AutoTokenizer

    model = load_model("petals", folder, checkpoint=checkpoint, initial_peers=swarm.initial_peers,
                       dht_prefix=swarm.dht_prefix)
    try:
        with one_thread():
            result = evaluate(model, dataset, tokenizer=AutoTokenizer.from_pretrained(folder), batch_size=4,
                              return_logits=True, bootstrap_resamples=0)
    finally:
        model.close()
    return result.predictions.logits


def test_the_local_backend_and_a_local_swarm_refuse_a_client_only_folder_in_one_line(client_folder, tmp_path):
    from dist_eval.swarm import LocalSwarm

    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"))
    with pytest.raises(UsageError) as e:
        load_model("local", client_folder, checkpoint=checkpoint)
    message = str(e.value)
    assert message.startswith(f"model_dir={client_folder!r}: --backend local reads every block") and "\n" not in message
    assert "model-blocks-0.safetensors, model-blocks-1.safetensors, model-blocks-2.safetensors, " \
           "model-blocks-3.safetensors" in message and "--backend petals --initial-peers" in message
    with pytest.raises(SwarmError, match=r"a local swarm reads every block's weights.*model-blocks-0\.safetensors"):
        LocalSwarm(client_folder, num_servers=1)  # refused before any server starts


REPO_ID = "tiny-org/tiny-llama"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A private HF cache (the user's is untouched), online unless a test says otherwise."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return tmp_path / "hf_cache"


@pytest.mark.swarm
def test_a_hub_id_fetches_only_the_clients_files_and_equals_the_full_folder(tiny_swarm, tiny_model, dataset,
                                                                            hub_cache, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from dist_eval.backends.hub import client_folder, petals_dht_prefix

    sharded = split_into_shards(tiny_model, str(tmp_path / "sharded"))
    with fake_hub({REPO_ID: sharded}) as hub:
        folder = client_folder(REPO_ID, endpoint=hub.endpoint)
    fetched = hub.files("GET")
    assert "model-client.safetensors" in fetched and "config.json" in fetched and "tokenizer.json" in fetched
    assert not [f for f in fetched if f.startswith("model-blocks-")], fetched
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the same, from the populated cache only
    assert client_folder(REPO_ID) == folder
    assert petals_dht_prefix(REPO_ID) == "tiny-llama-hf"  # petals' rule for a Llama hub id
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"))
    logits = [petals_logits(tiny_swarm, model_dir, checkpoint, dataset) for model_dir in (tiny_model, folder)]
    assert_same_bits(logits[1], logits[0], "the logits, the hub id's folder against the full folder")
    assert_same_bits(petals_object_logits(tiny_swarm, checkpoint, dataset, folder), logits[0],
                     "the logits, petals' own object against the full folder")


def petals_object_logits(swarm, checkpoint, dataset, folder):
    """The logits of petals' own ``from_pretrained(hub id)`` (offline, from the filled HF cache), with the
    checkpoint's prompts and head set as a training loop holds them, through ``evaluate``."""
    import torch
    from huggingface_hub import constants
    from transformers import AutoTokenizer

    from dist_eval.backends.checkpoint import load_checkpoint
    from dist_eval.backends.compat import import_petals, shutdown_petals_client
    from dist_eval.backends.families import FAMILIES

    state = load_checkpoint(checkpoint)
    model = getattr(import_petals(), FAMILIES["llama"].petals_class).from_pretrained(
        REPO_ID, cache_dir=constants.HF_HUB_CACHE, local_files_only=True, initial_peers=swarm.initial_peers,
        dht_prefix=swarm.dht_prefix, num_labels=3, tuning_mode="ptune", pre_seq_len=3, torch_dtype=torch.float32)
    try:
        with torch.no_grad():
            model.score.weight.copy_(state.tensors["score.weight"])
            model.model.prompt_embeddings.weight.copy_(state.tensors["prompt_embeddings.weight"])
        with one_thread():
            result = evaluate(model, dataset, tokenizer=AutoTokenizer.from_pretrained(folder), batch_size=4,
                              return_logits=True, bootstrap_resamples=0)
    finally:
        shutdown_petals_client(model.model.layers.sequence_manager)
    return result.predictions.logits


def test_offline_with_an_empty_cache_names_the_missing_file_in_one_line(hub_cache, monkeypatch):
    from huggingface_hub import constants

    from dist_eval.backends.hub import client_folder

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UsageError) as e:
        client_folder(REPO_ID)
    assert str(e.value).startswith(f"model_dir={REPO_ID!r}: config.json is not in the HF cache and HF_HUB_OFFLINE=1")
    assert "\n" not in str(e.value)


def test_the_local_backend_on_a_hub_id_says_what_it_would_fetch_before_fetching(tiny_model, hub_cache, tmp_path,
                                                                               monkeypatch):
    from dist_eval.backends.hub import resolve_model

    sharded = split_into_shards(tiny_model, str(tmp_path / "sharded"))
    with fake_hub({REPO_ID: sharded}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        for backend, peers in (("local", None), ("petals", None)):
            with pytest.raises(UsageError) as e:
                resolve_model(REPO_ID, backend, peers)
            assert "reads every block's weights" in str(e.value) and "\n" not in str(e.value)
            assert "GB in 5 shards, per model.safetensors.index.json" in str(e.value)
            assert "--fetch-whole-model" in str(e.value)
    assert set(hub.files("GET")) == {"model.safetensors.index.json"}  # nothing else before the user asks


def test_fetch_whole_model_gets_every_shard_for_the_local_backend(tiny_model, dataset, hub_cache, tmp_path,
                                                                   monkeypatch):
    """--fetch-whole-model (``whole=True``): every weight file is fetched, and the local backend
    on that folder equals the full local folder, bitwise."""
    from transformers import AutoTokenizer

    from dist_eval.backends.hub import resolve_model

    sharded = split_into_shards(tiny_model, str(tmp_path / "sharded"))
    with fake_hub({REPO_ID: sharded}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        folder, prefix = resolve_model(REPO_ID, "local", None, whole=True)
    shards = {f for f in os.listdir(sharded) if f.endswith(".safetensors")}
    assert shards <= set(hub.files("GET")) and shards <= set(os.listdir(folder)), (hub.files("GET"), shards)
    assert prefix is None
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"))
    logits = []
    for model_dir in (tiny_model, folder):
        model = load_model("local", model_dir, checkpoint=checkpoint)
        with one_thread():
            result = evaluate(model, dataset, tokenizer=AutoTokenizer.from_pretrained(model_dir), batch_size=4,
                              return_logits=True, bootstrap_resamples=0)
        logits.append(result.predictions.logits)
    assert_same_bits(logits[1], logits[0], "the logits, the hub id against the full folder")


@pytest.mark.swarm
@pytest.mark.multiproc
def test_the_cli_on_a_hub_id_with_two_ranks_equals_the_full_folder(tiny_swarm, tiny_model, tmp_path):
    """``--model org/name`` on a fake hub (HF_ENDPOINT, a private HF_HOME), N=2 == the full local
    folder (--backend local, one process), bitwise; no blocks-only shard requested; then the same
    with the hub stopped and HF_HUB_OFFLINE=1, from the cache the first run filled. No run draws
    figures (matplotlib hidden): none is looked at."""
    data = write_csv(str(tmp_path / "data.csv"), 17, seed=4)
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"))
    common = ["--data-files", data, "--checkpoint", checkpoint, "--batch-size", "4", "--save-logits"]
    sharded = split_into_shards(tiny_model, str(tmp_path / "sharded"))
    with fake_hub({REPO_ID: sharded}) as hub:
        env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "0",
               **no_figures_env(tmp_path / "hidden")}
        proc = run_cli(["--model", REPO_ID, "--output-dir", str(tmp_path / "hub"), "--initial-peers",
                        *tiny_swarm.initial_peers, "--dht-prefix", tiny_swarm.dht_prefix, *common], nproc=2, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [f for f in hub.files("GET") if f.startswith("model-blocks-")], hub.files("GET")
    # the hub is gone: HF_HUB_OFFLINE=1 set by the user runs both ranks from the cache it filled
    offline = run_cli(["--model", REPO_ID, "--output-dir", str(tmp_path / "offline"), "--initial-peers",
                       *tiny_swarm.initial_peers, "--dht-prefix", tiny_swarm.dht_prefix, *common],
                      nproc=2, env={**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 0, offline.stderr[-3000:]
    # the full folder on one process: in this one (one thread, as a launched process has)
    assert run_cli_in_process(["--model", tiny_model, "--backend", "local", "--output-dir", str(tmp_path / "local"),
                               *common], hide_modules=("matplotlib",)) == 0
    hub_rows = read_jsonl(tmp_path / "hub" / "predictions.jsonl")
    assert len(hub_rows) == 17
    assert_same_bits(hub_rows, read_jsonl(tmp_path / "local" / "predictions.jsonl"),
                     "predictions.jsonl, the hub id on petals N=2 against the folder on local N=1")
    assert_same_bits(read_jsonl(tmp_path / "offline" / "predictions.jsonl"), hub_rows, "offline, against online")
