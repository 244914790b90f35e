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
from typing import List, Optional

from dist_eval.errors import UsageError

INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def is_hub_id(model: str) -> bool:
    """``org/name`` (or ``name``) that is not a folder here: what ``--model`` names on the hub."""
    return not os.path.exists(model) and not model.startswith((".", "/", "~")) and model.count("/") <= 1


def client_folder(repo_id: str, revision: Optional[str] = None, endpoint: Optional[str] = None) -> str:
    """The snapshot folder (in the user's HF cache) holding config, tokenizer, the index and the
    shards with a client-side tensor of ``repo_id`` at ``revision``; never a blocks-only shard.
    """
    from dist_eval.backends.families import family_of_folder

    config = _fetch(repo_id, "config.json", revision, endpoint)
    folder = os.path.dirname(config)
    for name in TOKENIZER_FILES:
        _fetch(repo_id, name, revision, endpoint, optional=True)
    blocks = family_of_folder(folder).blocks + "."
    for name in client_shards(repo_id, revision, endpoint, blocks):
        _fetch(repo_id, name, revision, endpoint)
    return folder


def client_shards(repo_id: str, revision: Optional[str], endpoint: Optional[str], blocks_prefix: str) -> List[str]:
    """The weight files holding a tensor whose name does not start with ``blocks_prefix``."""
    for index_name in INDEX_FILES:
        index = _fetch(repo_id, index_name, revision, endpoint, optional=True)
        if index is not None:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            return sorted({f for key, f in weight_map.items() if not key.startswith(blocks_prefix)})
    for name in SINGLE_FILES:  # one file holds everything: the client reads it whole
        if _fetch(repo_id, name, revision, endpoint, optional=True) is not None:
            return [name]
    where = "the HF cache holds" if _offline() else "the hub repository has"
    raise UsageError(f"{where} no weights ({', '.join(INDEX_FILES + SINGLE_FILES)}) of it.",
                     param="model_dir", value=repo_id)


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def _fetch(repo_id: str, name: str, revision: Optional[str], endpoint: Optional[str], optional: bool = False):
    """The local path of ``name`` (downloaded, or from the cache); None for an absent optional file."""
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
            "HF_HUB_OFFLINE=1 to read the HF cache only.", param="model_dir", value=repo_id) from None
    except EntryNotFoundError:
        if optional:
            return None
        raise UsageError(f"the hub repository has no {name} (revision {revision or 'main'}).",
                         param="model_dir", value=repo_id) from None
    except RepositoryNotFoundError:
        raise UsageError("no such repository on the hub (or it is private: log in with `huggingface-cli login` "
                         "or set HF_TOKEN), and no such folder here.", param="model_dir", value=repo_id) from None

