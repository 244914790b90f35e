"""A model folder that holds only the client's shards (its index names block shards that are
absent: what petals' client keeps of a big model): ``--backend petals`` against a swarm gives
the logits of the full folder bit for bit; the local backend and a local swarm, which read
every block, refuse it in one line naming the absent shards."""
import contextlib
import os

import pytest
from conftest import build_checkpoint, read_jsonl, run_env, run_ranks, split_into_shards, write_csv
from fake_hub import fake_hub
from float_promises import assert_same_bits
from inprocess_cli import one_thread, run_cli_in_process
from test_cli import no_figures_env

from dist_eval import evaluate, load_model, load_tokenizer
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


def test_the_dht_prefix_of_a_hub_id_of_a_familys_alias_is_petals_rule_for_it(hub_cache):
    """The review's finding: a Qwen3.5 fine-tuned as a text model (config.json's model_type qwen3_5_text, a family's
    alias) named by hub id on --backend petals --initial-peers: petals' own reading of its type raised "Petals does
    not support model type qwen3_5_text". Its snapshot's family picks the class: petals' rule, the id's name + -hf."""
    import json

    from dist_eval.backends.hub import petals_dht_prefix

    snapshot = hub_cache / "models--org--q35-text" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text", "hidden_size": 32}))
    (hub_cache / "models--org--q35-text" / "refs").mkdir()
    (hub_cache / "models--org--q35-text" / "refs" / "main").write_text("0" * 40)
    assert petals_dht_prefix("org/q35-text", folder=str(snapshot)) == "q35-text-hf"


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
    from dist_eval.backends.families import FAMILIES
    from dist_eval.backends.petals.helpers import shutdown_petals_client
    from dist_eval.backends.petals.shims import import_petals

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


@contextlib.contextmanager
def ranks_of(env, folder):
    """A fork server of ranks (tests/forked_ranks.py) started with ``env`` (run_cli's, with ``env`` added):
    one whose ranks import huggingface_hub under that HF_HOME, HF_ENDPOINT and HF_HUB_OFFLINE, as a
    launch's ranks do (the session's cannot serve an environment a library reads when imported)."""
    from forked_ranks import RankZygote

    os.makedirs(folder)
    zygote = RankZygote(run_env(env), folder)
    try:
        yield zygote
    finally:
        zygote.stop()


@pytest.mark.swarm
@pytest.mark.multiproc
def test_the_cli_on_a_hub_id_with_two_ranks_equals_the_full_folder(tiny_swarm, tiny_model, tmp_path):
    """``--model org/name`` on a fake hub (HF_ENDPOINT, a private HF_HOME), N=2 == the full local
    folder (--backend local, one process), bitwise; no blocks-only shard requested; the local backend with its
    blocks streamed (--stream-blocks), N=2 on the same cache: the blocks' shards fetched by both ranks as their
    forwards reach them, the same bits (issue 73); then the petals run
    with the hub stopped and HF_HUB_OFFLINE=1, from the cache the first run filled. The two ranks are
    real processes in a real gloo group with torchrun's environment, forked from a process that
    imported their libraries under the run's HF variables (what the ranks do with them is tested, not
    the launch). No run draws figures (matplotlib hidden): none is looked at."""
    data = write_csv(str(tmp_path / "data.csv"), 17, seed=4)
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"))
    common = ["--data-files", data, "--checkpoint", checkpoint, "--batch-size", "4", "--save-logits"]
    sharded = split_into_shards(tiny_model, str(tmp_path / "sharded"))
    hidden = no_figures_env(tmp_path / "hidden")
    with fake_hub({REPO_ID: sharded}) as hub:
        env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "0"}
        with ranks_of(env, str(tmp_path / "z_online")) as zygote:
            proc = run_ranks(zygote, ["--model", REPO_ID, "--output-dir", str(tmp_path / "hub"), "--initial-peers",
                                      *tiny_swarm.initial_peers, "--dht-prefix", tiny_swarm.dht_prefix, *common],
                             nproc=2, env={**env, **hidden})
            petals_gets = hub.files("GET")
            # the local backend with its blocks streamed, N=2 on the same cache: both ranks fetch the blocks' shards
            # as their forwards reach them, into one cache at once (issue 73)
            streamed = run_ranks(zygote, ["--model", REPO_ID, "--output-dir", str(tmp_path / "streamed"), "--backend",
                                          "local", "--stream-blocks", *common], nproc=2, env={**env, **hidden})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.rank_codes == [0, 0]  # forked from the server started with these variables, not torchrun
    assert not [f for f in petals_gets if f.startswith("model-blocks-")], petals_gets
    assert streamed.returncode == 0, streamed.stderr[-3000:]
    blocks = sorted(f for f in os.listdir(sharded) if f.startswith("model-blocks-"))
    assert set(blocks) <= set(hub.files("GET")[len(petals_gets):]), hub.files("GET")
    # the hub is gone: HF_HUB_OFFLINE=1 set by the user runs both ranks from the cache it filled
    offline_env = {**env, "HF_HUB_OFFLINE": "1"}
    with ranks_of(offline_env, str(tmp_path / "z_offline")) as zygote:
        offline = run_ranks(zygote, ["--model", REPO_ID, "--output-dir", str(tmp_path / "offline"), "--initial-peers",
                                     *tiny_swarm.initial_peers, "--dht-prefix", tiny_swarm.dht_prefix, *common],
                            nproc=2, env={**offline_env, **hidden})
    assert offline.returncode == 0, offline.stderr[-3000:]
    assert offline.rank_codes == [0, 0]
    # the full folder on one process: in this one (one thread, as a launched process has)
    assert run_cli_in_process(["--model", tiny_model, "--backend", "local", "--output-dir", str(tmp_path / "local"),
                               *common], hide_modules=("matplotlib",)) == 0
    hub_rows = read_jsonl(tmp_path / "hub" / "predictions.jsonl")
    assert len(hub_rows) == 17
    assert_same_bits(hub_rows, read_jsonl(tmp_path / "local" / "predictions.jsonl"),
                     "predictions.jsonl, the hub id on petals N=2 against the folder on local N=1")
    assert_same_bits(read_jsonl(tmp_path / "offline" / "predictions.jsonl"), hub_rows, "offline, against online")
    assert_same_bits(read_jsonl(tmp_path / "streamed" / "predictions.jsonl"), hub_rows,
                     "the hub id on the local backend, its blocks streamed, N=2, against the folder on local N=1")


VL_REPO = "tiny-org/tiny-qwen3_5"


def split_as_vision_language_release(src: str, dst: str) -> str:
    """``src`` (a tiny Qwen3.5 text ``*ForCausalLM`` save) as a Qwen3.5 release lays it out: config.json's
    text_config nested beside a vision_config, the text model under ``model.language_model.``, a vision tower
    (``model.visual.*``) and a multi-token-prediction layer (``mtp.*``) each in shards of their own, a shard
    per block, the embeddings, final norm and head in ``model-00001-of-*.safetensors``."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name not in ("model.safetensors", "config.json"):
            shutil.copy(os.path.join(src, name), dst)
    with open(os.path.join(src, "config.json")) as f:
        text = json.load(f)
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "tie_word_embeddings": text.get("tie_word_embeddings", False),
              "text_config": {**text, "model_type": "qwen3_5_text"}, "vision_config": {"depth": 1, "hidden_size": 8}}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    shards = {"model-visual.safetensors": {"model.visual.blocks.0.attn.qkv.weight": torch.ones(24, 8)},
              "model-mtp.safetensors": {"mtp.fc.weight": torch.ones(32, 64)}}
    for key, tensor in load_file(os.path.join(src, "model.safetensors")).items():
        block = key.split(".")[2] if key.startswith("model.layers.") else None
        shard = "model-00001-of-client.safetensors" if block is None else f"model-blocks-{block}.safetensors"
        new_key = "model.language_model." + key[len("model."):] if key.startswith("model.") else key
        shards.setdefault(shard, {})[new_key] = tensor.contiguous()
    for shard, tensors in shards.items():
        save_file(tensors, os.path.join(dst, shard), metadata={"format": "pt"})
    weight_map = {key: shard for shard, tensors in sorted(shards.items()) for key in sorted(tensors)}
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 1}, "weight_map": weight_map}, f, indent=1)
    return dst


def test_a_vision_language_release_by_hub_id_fetches_the_clients_files_alone(hub_cache, dataset, tmp_path,
                                                                             monkeypatch):
    """Qwen3.5 as released (the text model under model.language_model., a vision tower and an mtp layer in
    shards of their own), by hub id (the fake hub, every GET recorded): the client's files are the config,
    tokenizer, index and the one shard with the embeddings, final norm and head, never a block's shard, the
    vision tower's or the mtp layer's; that client-only folder converts to the layout petals reads (the
    absent shards skipped: their blocks' keys named in the copy's index, absent, the vision tower's left out)
    and what reads every block refuses it naming the block shards alone. --fetch-whole-model (the local
    backend) fetches every block's shard and still neither the vision tower's nor the mtp's, and the local
    backend on it equals the whole folder bit for bit."""
    import json

    import torch
    from conftest import build_tiny_model
    from safetensors.torch import load_file

    from dist_eval.backends.hub import client_folder, resolve_model
    from dist_eval.backends.petals_folder import missing_shards, petals_model_folder, require_every_shard

    text = build_tiny_model(str(tmp_path / "text"), family="qwen3_5")
    release = split_as_vision_language_release(text, str(tmp_path / "release"))
    blocks = [f"model-blocks-{i}.safetensors" for i in range(4)]
    never = {"model-visual.safetensors", "model-mtp.safetensors"}
    with fake_hub({VL_REPO: release}) as hub:
        folder = client_folder(VL_REPO, endpoint=hub.endpoint)
        fetched = hub.files("GET")
    weights = {f for f in fetched if f.endswith(".safetensors")}
    assert weights == {"model-00001-of-client.safetensors"}, fetched
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= set(fetched)
    assert missing_shards(folder) == blocks  # the vision tower's and mtp's shards are not missed
    with pytest.raises(UsageError) as e:
        require_every_shard(folder, "--backend local")
    assert "model-blocks-0.safetensors" in str(e.value) and "visual" not in str(e.value) and "\n" not in str(e.value)
    converted = petals_model_folder(folder, cache_dir=str(tmp_path / "converted"))
    with open(os.path.join(converted, "model.safetensors.index.json")) as f:
        index = json.load(f)
    mapped = index["weight_map"]
    assert not [k for k in mapped if k.startswith(("model.visual.", "mtp.")) or "language_model" in k], mapped
    assert set(index["metadata"]["left_out"]) == {"model.visual.blocks.0.attn.qkv.weight", "mtp.fc.weight"}
    block_files = {mapped[k] for k in mapped if k.startswith("model.layers.")}
    assert len(block_files) == 4 and not [f for f in block_files if os.path.exists(os.path.join(converted, f))]
    assert len(missing_shards(converted)) == 4  # still a client's folder: what reads every block refuses it
    client = load_file(os.path.join(converted, "client.safetensors"))
    source = load_file(os.path.join(text, "model.safetensors"))
    assert set(client) == {k for k in source if not k.startswith("model.layers.")}
    assert all(torch.equal(client[k], source[k]) for k in client)
    with fake_hub({VL_REPO: release}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        whole, _ = resolve_model(VL_REPO, "local", None, whole=True)
        fetched = {f for f in hub.files("GET") if f.endswith(".safetensors")}
    assert fetched == set(blocks), fetched  # the client's shard is in the HF cache already
    held = {f for f in os.listdir(whole) if f.endswith(".safetensors")}
    assert held == {"model-00001-of-client.safetensors", *blocks} and not held & never, held
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"))
    logits = []
    for model_dir in (text, whole):
        model = load_model("local", model_dir, checkpoint=checkpoint)
        with one_thread():  # the folder's tokenizer as the CLI reads it (5.x's AutoTokenizer: Qwen3.5's own, no id)
            result = evaluate(model, dataset, tokenizer=load_tokenizer(model_dir), batch_size=4,
                              return_logits=True, bootstrap_resamples=0)
        logits.append(result.predictions.logits)
    assert_same_bits(logits[1], logits[0], "the logits, the hub id's whole text model against the text folder")


@pytest.mark.swarm
def test_a_vision_language_release_by_hub_id_on_a_swarm_serving_it_equals_local_bitwise(tiny_swarm, hub_cache, dataset,
                                                                                       tmp_path, monkeypatch):
    """Qwen3.5 as released, served as it is (``LocalSwarm(release)``: one server, forked from tiny_swarm's fork
    server) and named by hub id on ``--backend petals``: the logits equal the local backend's on the text folder bit
    for bit; the client fetched its files alone (never a block's shard, the vision tower's or the mtp layer's);
    the server was given the converted folder, whose files hold none of the vision tower's or mtp's tensors, and
    their shards in the release are not safetensors files at all: had the swarm opened one, it would not start."""
    import json
    from unittest import mock

    from conftest import build_tiny_model, forking_from

    from dist_eval.backends.petals_folder import safetensors_names
    from dist_eval.swarm import LocalSwarm

    text = build_tiny_model(str(tmp_path / "text"), family="qwen3_5")
    release = split_as_vision_language_release(text, str(tmp_path / "release"))
    never = ("model-visual.safetensors", "model-mtp.safetensors")
    for name in never:  # what is never read may as well be unreadable
        with open(os.path.join(release, name), "wb") as f:
            f.write(b"not a safetensors file: nothing may open it")
    monkeypatch.setenv("DIST_EVAL_CACHE", str(tmp_path / "cache"))  # the converted copies, not the user's cache
    checkpoint = build_checkpoint(str(tmp_path / "ck.pt"))
    swarm = LocalSwarm(release, num_servers=1, dht_prefix="vl-release")
    try:
        with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}), forking_from(tiny_swarm):
            swarm.start()
        served = swarm.model_dir
        assert served != swarm.source_dir and served in swarm.servers[0].proc.args
        with open(os.path.join(served, "model.safetensors.index.json")) as f:
            index = json.load(f)
        assert set(index["metadata"]["left_out"]) == {"model.visual.blocks.0.attn.qkv.weight", "mtp.fc.weight"}
        held = [key for name in os.listdir(served) if name.endswith(".safetensors")
                for key in safetensors_names(os.path.join(served, name))]
        assert len(held) == len(index["weight_map"]) and set(held) == set(index["weight_map"])
        assert not [k for k in held if k.startswith(("model.visual.", "mtp.")) or "language_model" in k], held
        with fake_hub({VL_REPO: release}) as hub:
            monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
            model = load_model("petals", VL_REPO, checkpoint=checkpoint, initial_peers=swarm.initial_peers,
                               dht_prefix=swarm.dht_prefix)
            try:
                assert model.source.model_dir.startswith(str(hub_cache))
                with one_thread():
                    result = evaluate(model, dataset, tokenizer=load_tokenizer(model.source.model_dir),
                                      batch_size=4, return_logits=True, bootstrap_resamples=0)
            finally:
                model.close()
            fetched = hub.files("GET")
    finally:
        swarm.stop()
    assert {f for f in fetched if f.endswith(".safetensors")} == {"model-00001-of-client.safetensors"}, fetched
    local = load_model("local", text, checkpoint=checkpoint)
    with one_thread():
        expected = evaluate(local, dataset, tokenizer=load_tokenizer(text), batch_size=4,
                            return_logits=True, bootstrap_resamples=0)
    assert_same_bits(result.predictions.logits, expected.predictions.logits,
                     "the logits, the release by hub id on a swarm serving it against the text folder on local")


def split_as_kimi_release(src: str, dst: str) -> str:
    """``src`` (a tiny kimi_k25 text ``*ForCausalLM`` save) as Moonshot lays Kimi K2.5 out: config.json's
    text_config (model_type kimi_k2) beside a vision_config, the text model under ``language_model.model.``, its
    head ``language_model.lm_head.weight``, the vision tower and projector (``vision_tower.*``, ``mm_projector.*``)
    in a shard of their own, a shard per block, the embeddings, final norm and head in one shard."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name not in ("model.safetensors", "config.json"):
            shutil.copy(os.path.join(src, name), dst)
    with open(os.path.join(src, "config.json")) as f:
        text = json.load(f)
    config = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
              "tie_word_embeddings": False, "text_config": {**text, "model_type": "kimi_k2"},
              "vision_config": {"hidden_size": 8}}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    shards = {"model-vision.safetensors": {"vision_tower.encoder.blocks.0.wqkv.weight": torch.ones(24, 8),
                                           "mm_projector.proj.0.weight": torch.ones(8, 8)}}
    for key, tensor in load_file(os.path.join(src, "model.safetensors")).items():
        block = key.split(".")[2] if key.startswith("model.layers.") else None
        shard = "model-00001-of-client.safetensors" if block is None else f"model-blocks-{block}.safetensors"
        shards.setdefault(shard, {})["language_model." + key] = tensor.contiguous()
    for shard, tensors in shards.items():
        save_file(tensors, os.path.join(dst, shard), metadata={"format": "pt"})
    weight_map = {key: shard for shard, tensors in sorted(shards.items()) for key in sorted(tensors)}
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 1}, "weight_map": weight_map}, f, indent=1)
    return dst


def test_kimi_k25_by_hub_id_fetches_the_clients_files_alone_and_reads_its_head(hub_cache, tmp_path):
    """Kimi K2.5 as released (text model under language_model.model., head language_model.lm_head., vision tower
    and projector in a shard of their own), by hub id: the client's files are the config, tokenizer, index and
    the one shard with the embeddings, final norm and head, never a block's or the vision tower's; converted,
    the client's tensors are the text model's own (the head read as lm_head.weight), the vision tower's left
    out."""
    import json

    import torch
    from conftest import build_tiny_model
    from safetensors.torch import load_file

    from dist_eval.backends.hub import client_folder
    from dist_eval.backends.petals_folder import missing_shards, petals_model_folder

    text = build_tiny_model(str(tmp_path / "text"), family="kimi_k25", num_layers=3)
    release = split_as_kimi_release(text, str(tmp_path / "release"))
    with fake_hub({"tiny-org/tiny-kimi": release}) as hub:
        folder = client_folder("tiny-org/tiny-kimi", endpoint=hub.endpoint)
        fetched = hub.files("GET")
    assert {f for f in fetched if f.endswith(".safetensors")} == {"model-00001-of-client.safetensors"}, fetched
    assert missing_shards(folder) == [f"model-blocks-{i}.safetensors" for i in range(3)]
    converted = petals_model_folder(folder, cache_dir=str(tmp_path / "converted"))
    with open(os.path.join(converted, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["metadata"]["left_out"]) == {"vision_tower.encoder.blocks.0.wqkv.weight",
                                                  "mm_projector.proj.0.weight"}
    client = load_file(os.path.join(converted, "client.safetensors"))
    source = load_file(os.path.join(text, "model.safetensors"))
    assert "lm_head.weight" in client and set(client) == {k for k in source if not k.startswith("model.layers.")}
    assert all(torch.equal(client[k], source[k]) for k in client)


def test_a_deepseek_v4_release_by_hub_id_fetches_no_shard_of_blocks_and_mtp_alone(hub_cache, tmp_path):
    """DeepSeek-V4 as released (its own names, no model. prefix: blocks under layers.<i>., an mtp.<k>. layer), by hub
    id: a shard holding only blocks and the MTP layer is never fetched; converted, the client's tensors (embed.weight,
    norm.weight, hc_head_*, head.weight) are read under the names transformers 5.x saves, the MTP layer left out."""
    import json

    import torch
    from conftest import build_tiny_model
    from safetensors.torch import load_file
    from test_backends_petals_folder import write_v4_release

    from dist_eval.backends.hub import client_folder
    from dist_eval.backends.petals_folder import missing_shards, petals_model_folder

    saved = build_tiny_model(str(tmp_path / "saved"), family="deepseek_v4", num_layers=3)
    release = write_v4_release(saved, str(tmp_path / "release"))
    with fake_hub({"tiny-org/tiny-v4": str(tmp_path / "release")}) as hub:
        folder = client_folder("tiny-org/tiny-v4", endpoint=hub.endpoint)
        fetched = hub.files("GET")
    assert {f for f in fetched if f.endswith(".safetensors")} == {"model-00001-of-00002.safetensors"}, fetched
    assert missing_shards(folder) == ["model-00002-of-00002.safetensors"]
    converted = petals_model_folder(folder, cache_dir=str(tmp_path / "converted"))
    with open(os.path.join(converted, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert index["metadata"]["left_out"] == sorted(k for k in release if k.startswith("mtp."))
    client = load_file(os.path.join(converted, "client.safetensors"))
    source = load_file(os.path.join(saved, "model.safetensors"))
    assert set(client) == {k for k in source if not k.startswith("model.layers.")}
    assert all(torch.equal(client[k], source[k]) for k in client)
