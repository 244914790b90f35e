"""A model named by its hub id: only the files petals' client reads, as its client fetches them.

petals' client (``Distributed*.from_pretrained(hub_id)``) downloads the config, the tokenizer
and the checkpoint shards that hold a client-side tensor (embeddings, final norm, head);
its patch of transformers' ``get_checkpoint_shard_files`` skips the shards that hold only
blocks. :func:`client_folder` fetches the same files through ``huggingface_hub`` (or finds
them in the user's HF cache) and returns the cache's snapshot folder, which then holds only
the client's shards: a folder ``--backend petals`` reads as it is
(:func:`dist_eval.backends.petals_folder.require_every_shard` is what the local backend and a
local swarm say of it). Offline-ness is the user's: ``HF_HUB_OFFLINE=1`` (read by
``huggingface_hub`` at its import) reads from the cache only, and a missing file is named in
one line. Nothing here sets an environment variable.
"""
from __future__ import annotations

import json
import os
from typing import List, NamedTuple, Optional, Tuple

from dist_eval.backends.arguments import is_hub_id
from dist_eval.backends.kinds import backend_kind
from dist_eval.errors import UsageError

INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


class HubSource(NamedTuple):
    """Where the files of a hub id's snapshot folder not fetched yet come from (its blocks' shards, streamed)."""

    repo_id: str
    commit: str  # the snapshot's: every file of the run from the same one

    def fetch(self, name: str) -> str:
        """The local path of the snapshot's file ``name``, downloaded now unless in the HF cache."""
        return _fetch(self.repo_id, name, self.commit, None)


def hub_source(model_dir: str) -> Optional[HubSource]:
    """The :class:`HubSource` of ``model_dir`` when it is a snapshot folder of an HF cache
    (``.../models--ORG--NAME/snapshots/COMMIT``: what :func:`resolve_model` made of a hub id, on any node), else None.
    """
    import re

    found = re.search(r"/models--([^/]+)/snapshots/([0-9a-f]{40})$", os.path.abspath(model_dir))
    return HubSource(found.group(1).replace("--", "/"), found.group(2)) if found else None


def resolve_model(model: str, backend: str, initial_peers, revision: Optional[str] = None,
                  whole: bool = False, stream: bool = False) -> Tuple[str, Optional[str]]:
    """(the folder to read, the DHT prefix petals' client would use or None) of ``model``: a
    folder as it is; a hub id, for ``--backend petals --initial-peers``, as its client files
    (:func:`client_folder`). What reads every block (the local backend, a local swarm) is told
    what the repository holds, in one line, before anything but its index is fetched; with
    ``whole`` (``--fetch-whole-model``) it gets every weight file instead; with ``stream``
    (``--stream-blocks``, the local backend) the client's files, each block's shards fetched when it runs
    (:class:`HubSource`).
    """
    if os.path.isdir(model) or not is_hub_id(model):
        if revision is not None:
            raise UsageError(f"only for a hub id; --model {model} is a folder here. Drop --revision.",
                             param="revision", value=revision)
        return model, None
    kind = backend_kind(backend)
    if not kind.on_swarm or not initial_peers:
        if whole:
            return client_folder(model, revision, every_shard=True), None
        if stream and kind.streamed is not None:
            return client_folder(model, revision), None
        needs = f"--backend {backend}" if not kind.on_swarm else "a local swarm (no --initial-peers)"
        streams = " or --stream-blocks to fetch each block's shards when it runs," if kind.streamed else ""
        raise UsageError(
            f"{needs} reads every block's weights, and of a hub id dist_eval fetches only the client's files "
            f"({_size_of(model, revision)}). Run --backend petals --initial-peers against a swarm serving it,"
            f"{streams} or add --fetch-whole-model to download every weight file into the HF cache.",
            param="model_dir", value=model)
    folder = client_folder(model, revision)
    return folder, petals_dht_prefix(model, revision, folder)


def snapshot_on_this_node(model_dir: str, model: str, backend: str, initial_peers, whole: bool = False,
                          stream: bool = False) -> str:
    """``model_dir`` (a snapshot rank 0 resolved) when it is in this process's HF cache; else the
    same snapshot (its commit: a snapshot folder is named by it) fetched into this one's (another
    node without a shared HF_HOME).
    """
    from huggingface_hub import constants

    own_cache = os.path.realpath(constants.HF_HUB_CACHE)
    if os.path.realpath(model_dir).startswith(own_cache + os.sep):
        return model_dir
    commit = os.path.basename(os.path.normpath(model_dir))
    return resolve_model(model, backend, initial_peers, commit, whole=whole, stream=stream)[0]


def petals_dht_prefix(repo_id: str, revision: Optional[str] = None, folder: Optional[str] = None) -> str:
    """The DHT prefix petals' client uses for ``repo_id`` (petals' own rule, per family: its
    config class applied to the id, the config read from the HF cache). ``folder``: the id's snapshot, whose
    config.json's family picks the class where petals' own reading of the type would not (a family's alias,
    ``Family.model_type_aliases``, which petals' registry has not).
    """
    from dist_eval.backends.blocks import register
    from dist_eval.backends.petals.shims import import_petals

    import_petals()
    register()  # petals' registry knows the families it lacks
    from huggingface_hub import constants
    from petals.utils.auto_config import _CLASS_MAPPING, AutoDistributedConfig

    from dist_eval.backends.config_json import saved_family_type

    classes = _CLASS_MAPPING.get(saved_family_type(folder)) if folder else None
    config_class = classes.config if classes is not None else AutoDistributedConfig
    config = config_class.from_pretrained(  # the cache huggingface_hub uses, which client_folder filled
        repo_id, revision=revision, local_files_only=True, cache_dir=constants.HF_HUB_CACHE)
    return config.dht_prefix


def _size_of(repo_id: str, revision: Optional[str]) -> str:
    """What the repository's weights come to, from its index (the only file fetched for it)."""
    found = _index(repo_id, revision, None)
    if found is None:
        return "its index could not be read"
    index_name, content = found
    total = content.get("metadata", {}).get("total_size")
    shards = len(set(content["weight_map"].values()))
    size = f"{total / 1e9:.1f} GB in " if total else ""
    return f"its weights: {size}{shards} shards, per {index_name}"


def _index(repo_id: str, revision: Optional[str], endpoint: Optional[str]) -> Optional[Tuple[str, dict]]:
    """(the index file's name, its content) of the repository's sharded weights, or None."""
    for index_name in INDEX_FILES:
        index = _fetch(repo_id, index_name, revision, endpoint, optional=True)
        if index is not None:
            with open(index) as f:
                return index_name, json.load(f)
    return None


def client_folder(repo_id: str, revision: Optional[str] = None, endpoint: Optional[str] = None,
                  every_shard: bool = False) -> str:
    """The snapshot folder (in the user's HF cache) holding config, tokenizer, the index and the
    shards with a client-side tensor of ``repo_id`` at ``revision``; never a blocks-only shard,
    unless ``every_shard`` (what the local backend and a local swarm read), and never a shard holding only
    what no backend reads (a vision-language release's vision tower: :func:`unread_prefixes`).
    """
    from dist_eval.backends.config_json import family_of_folder

    config = _fetch(repo_id, "config.json", revision, endpoint)
    folder = os.path.dirname(config)
    family = family_of_folder(folder)  # a model no block here computes is refused before anything else is fetched
    for name in TOKENIZER_FILES:
        _fetch(repo_id, name, revision, endpoint, optional=True)
    for name in client_shards(repo_id, revision, endpoint, unread_prefixes(family, every_shard)):
        _fetch(repo_id, name, revision, endpoint)
    return folder


def unread_prefixes(family, every_shard: bool = False) -> Tuple[str, ...]:
    """The key prefixes of the tensors a client (``every_shard``: what reads every block) never reads:
    the blocks' (under the text model's prefix too, in a vision-language release; without the checkpoint prefix too,
    in a release under its own names: Family.release_renames) and, always, a
    vision-language release's vision tower and other parts beside its text model (Family.skipped_prefixes).
    """
    blocks = () if every_shard else (family.blocks + ".",) + (
        (f"{family.text_prefix}{family.block_name}.",) if family.text_prefix else ()) + (
        (family.block_name + ".",) if family.release_renames else ())  # a release's own names: no prefix
    return blocks + tuple(family.skipped_prefixes)


def client_shards(repo_id: str, revision: Optional[str], endpoint: Optional[str], unread: Tuple[str, ...]) -> List[str]:
    """The weight files holding a tensor whose name starts with none of ``unread`` (every weight file,
    with ``unread`` empty).
    """
    found = _index(repo_id, revision, endpoint)
    if found is not None:
        unread = tuple(unread)
        return sorted({f for key, f in found[1]["weight_map"].items() if not (unread and key.startswith(unread))})
    for name in SINGLE_FILES:  # one file holds everything: the client reads it whole
        if _fetch(repo_id, name, revision, endpoint, optional=True) is not None:
            return [name]
    where = "the HF cache holds" if _offline() else "the hub repository has"
    raise UsageError(f"{where} no weights ({', '.join(INDEX_FILES + SINGLE_FILES)}) of it.",
                     param="model_dir", value=repo_id)


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def adapter_folder(repo_id: str, files: tuple, check, param: str = "checkpoint") -> str:
    """The snapshot folder (in the user's HF cache) of a PEFT adapter's repository; ``files``: (its config's
    name, its weights files' names: the first found is fetched). The config is fetched and handed to ``check``
    (which refuses an adapter that is not read) before a weights file is; nothing else is fetched.
    """
    config_name, weights_names = files
    here = "no such file or folder here"
    try:
        config = _fetch(repo_id, config_name, None, None, param=param, absent=(
            f"{here}, and no hub repository of that name with a {config_name} (a PEFT adapter's). Pass the "
            "checkpoint file, or a PEFT adapter's folder or hub id."))
    except UsageError as e:
        if e.detail.startswith(here):
            raise
        raise UsageError(f"{here}; as a PEFT adapter's hub id: {e.detail}", param=param, value=repo_id) from None
    check(config)
    for name in weights_names:
        if _fetch(repo_id, name, None, None, optional=True, param=param) is not None:
            break
    else:
        if _offline():  # in the cache the config alone: the weights never fetched, not absent from the adapter
            raise UsageError(f"a PEFT adapter whose {' or '.join(weights_names)} is not in the HF cache, and "
                             "HF_HUB_OFFLINE=1 forbids downloading it: run once online (or unset HF_HUB_OFFLINE), or "
                             "pass the adapter's folder.", param=param, value=repo_id)
    return os.path.dirname(config)


def _fetch(repo_id: str, name: str, revision: Optional[str], endpoint: Optional[str], optional: bool = False,
           param: str = "model_dir", absent: Optional[str] = None):
    """The local path of ``name`` (downloaded, or from the cache); None for an absent optional file.
    ``param``: the argument the errors name; ``absent``: the message where the repository or the file is not there.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = _offline()
    try:  # LocalEntryNotFoundError first: it is an EntryNotFoundError
        return hf_hub_download(repo_id, name, revision=revision, endpoint=endpoint or os.environ.get("HF_ENDPOINT"),
                               local_files_only=offline)
    except LocalEntryNotFoundError:
        if optional:  # offline: the online run that filled the cache fetched it, or found it absent
            return None
        raise UsageError(
            f"{name} is not in the HF cache and HF_HUB_OFFLINE=1 forbids downloading it: run once online "
            "(or unset HF_HUB_OFFLINE), or pass a folder that holds the model." if offline else
            f"{name} could not be downloaded (no connection to the hub?): check the network, or set "
            "HF_HUB_OFFLINE=1 to read the HF cache only.", param=param, value=repo_id) from None
    except EntryNotFoundError:
        if optional:
            return None
        raise UsageError(absent or f"the hub repository has no {name} (revision {revision or 'main'}).",
                         param=param, value=repo_id) from None
    except RepositoryNotFoundError:
        raise UsageError(absent or "no such repository on the hub (or it is private: log in with `huggingface-cli "
                         "login` or set HF_TOKEN), and no such folder here.", param=param, value=repo_id) from None

