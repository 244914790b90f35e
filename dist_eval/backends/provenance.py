"""Where a row's logits come from: the content of the model, checkpoint and tokenizer that
compute them (:func:`folder_identity`, :func:`tensors_digest`, :func:`tokenizer_digest`: what
the row store keys its rows by), and which servers served a petals run, as they announce
themselves in the DHT.

Read from the client's routing table (``sequence_manager.state.sequence_info.block_infos``:
one ``RemoteModuleInfo`` per block, ``servers`` mapping each peer id to petals'
``ServerInfo``). On a swarm that dist_eval did not start, replicas of a block may differ
(petals servers default to NF4 quantization on CUDA and to ``torch_dtype="auto"``) and
petals picks a route at random for each forward: the results are then reproducible only
when every block's replicas are identical, which :func:`swarm_provenance` says.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from typing import Dict, Iterable, List, Optional

from dist_eval.atomic import atomic_write, cache_folder, file_sha256, read_regular
from dist_eval.backends.blocks import SERVER_VERSION_MARK

# Every file is hashed whole (SHA-256). A file over this size is hashed once: its digest is kept in
# the cache folder's DIGEST_CACHE by what changes whenever its content can have: (device, inode,
# size, mtime, ctime). A write changes mtime and ctime; setting the mtime back (touch -d, a build's
# normalised mtimes) sets the ctime to now, and no user can set a ctime; another file under the same
# name has another inode (or, reusing one, a new ctime). Hashing 100 GB at each start would take
# minutes (benchmarks/RESULTS.md, "file digests"); a cached digest takes a stat.
WHOLE_HASH_BYTES = 64 << 20
DIGEST_CACHE = "file_digests.json"
DIGEST_CACHE_BYTES = 4 << 20  # the cache's size bound when read (DIGEST_CACHE_ENTRIES take ~0.5 MB)
DIGEST_CACHE_ENTRIES = 4096  # the newest kept
# What decides a server's numbers: two replicas that agree on these compute the same blocks
REPLICA_FIELDS = ("version", "torch_dtype", "quant_type", "adapters")


def _state_name(info) -> str:
    state = getattr(info, "state", None)
    return str(getattr(state, "name", state)).lower()


def _text(info, name: str):
    value = getattr(info, name, None)
    return None if value is None else str(value)


def _replica_value(info, name: str) -> str:
    value = str(getattr(info, name, None))
    # dist_eval's servers mark their version (backends.blocks): on a model both compute, the same blocks
    return value[: -len(SERVER_VERSION_MARK)] if name == "version" and value.endswith(SERVER_VERSION_MARK) else value


def _server_record(peer_id: str, info, blocks: List[int]) -> dict:
    return {
        "peer_id": peer_id,
        "public_name": _text(info, "public_name"),
        "blocks": [min(blocks), max(blocks) + 1],  # [start, end) of what it served of this model
        "state": _state_name(info),
        "petals_version": _text(info, "version"),
        "torch_dtype": _text(info, "torch_dtype"),
        "quantization": _text(info, "quant_type"),
        "adapters": [str(a) for a in getattr(info, "adapters", None) or []],
    }


def swarm_provenance(block_infos: Iterable) -> dict:
    """{servers: [...], identical_replicas: bool, mixed_blocks: [block indices]} of the
    online servers of each block (``block_infos`` in block order).
    """
    blocks_of: Dict[str, List[int]] = {}
    infos: Dict[str, object] = {}
    mixed: List[int] = []
    for index, block in enumerate(block_infos):
        kinds = set()
        for peer_id, info in (getattr(block, "servers", None) or {}).items():
            if _state_name(info) != "online":
                continue
            key = str(peer_id)
            blocks_of.setdefault(key, []).append(index)
            infos[key] = info
            kinds.add(tuple(_replica_value(info, f) for f in REPLICA_FIELDS))
        if len(kinds) > 1:
            mixed.append(index)
    servers = [_server_record(p, infos[p], blocks_of[p]) for p in sorted(blocks_of, key=lambda p: blocks_of[p][0])]
    return {"servers": servers, "identical_replicas": not mixed, "mixed_blocks": mixed}


def servers_without_block_options(block_infos: Iterable) -> list:
    """(peer id, announced version) of the online servers that are not dist_eval's: their
    version lacks :data:`~dist_eval.backends.blocks.SERVER_VERSION_MARK`, so they do not
    compute the block options of a newer family.
    """
    return [(s["peer_id"], s["petals_version"]) for s in swarm_provenance(block_infos)["servers"]
            if not str(s["petals_version"]).endswith(SERVER_VERSION_MARK)]


def replicas_warning(run: dict) -> str:
    """One line for the summary when some block's replicas differed, else ''."""
    swarm = run.get("swarm") or {}
    if swarm.get("identical_replicas", True):
        return ""
    blocks = swarm.get("mixed_blocks", [])
    return (f"  warning: blocks {blocks[:8]}{' ...' if len(blocks) > 8 else ''} were served by replicas that differ "
            "(petals version, dtype, quantization or adapters): results may depend on the route "
            "(metrics.json run.swarm)")


# ---------------------------------------------------------------- the content of what computes a row

# The installed libraries whose version can change a row's tokens (tokenizers; sentencepiece: a slow
# tokenizer's pieces; transformers: its tokenizer classes) or logits (torch's kernels, transformers' and
# petals' model code, hivemind's wire, bitsandbytes' quantized and peft's adapted blocks on a local swarm)
KEYED_LIBRARIES = ("torch", "transformers", "tokenizers", "sentencepiece", "petals", "hivemind", "bitsandbytes",
                   "peft")


def library_versions() -> Dict[str, Optional[str]]:
    """{library: its installed version, None when it is not installed} of :data:`KEYED_LIBRARIES`."""
    from importlib import metadata

    versions = {}
    for name in KEYED_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


@functools.cache
def dist_eval_version() -> str:
    """dist_eval's version with a digest of its own code as it runs: ``0.1.0+src.<12 hex>``
    (:func:`code_digest` of the package). The version number is not bumped at each change, and a change of
    dist_eval's blocks, RoPE or tokenization changes rows as another transformers does: a run's partial results
    by other code are not resumed (:func:`dist_eval.resume.run_key`), nor shards of other code merged
    (:func:`dist_eval.shard_merge.check_versions`). Not the row store's key: a change of how dist_eval computes a
    family's rows is named there (:meth:`~dist_eval.backends.families.Family.computation_revision`), so that rows
    stay served across changes that compute them the same.
    """
    import dist_eval

    package = os.path.dirname(os.path.abspath(dist_eval.__file__))
    return f"{dist_eval.__version__}+src.{code_digest(package)[:12]}"


def code_digest(package: str) -> str:
    """The SHA-256 (hex) of the modules under the folder ``package``, by relative path and content: the regular
    ``.py`` files named as a module can be, in folders named as a package can be (so neither bytecode nor an
    editor's lock file nor a notebook's checkpoint, which differ between a checkout and an install of the same
    code).
    """
    digest = hashlib.sha256()
    for folder, subfolders, names in os.walk(package):
        subfolders[:] = sorted(name for name in subfolders if name.isidentifier() and name != "__pycache__")
        for name in sorted(names):
            path = os.path.join(folder, name)
            if name.endswith(".py") and name[:-3].isidentifier() and os.path.isfile(path) \
                    and not os.path.islink(path):
                digest.update(os.path.relpath(path, package).encode() + b"\0" + file_sha256(path).encode())
    return digest.hexdigest()


def file_digest(path: str) -> str:
    """A file's content: its SHA-256; over WHOLE_HASH_BYTES, read from the digest cache when
    the file is unchanged since it was hashed (see DIGEST_CACHE above), else hashed and kept there.
    """
    before = os.stat(path)
    if before.st_size <= WHOLE_HASH_BYTES:
        return file_sha256(path)
    key = _stat_key(before)
    cached = _read_digest_cache().get(key)
    if isinstance(cached, str) and re.fullmatch(r"[0-9a-f]{64}", cached):
        return cached
    digest = file_sha256(path)
    if _stat_key(os.stat(path)) == key:  # not changed while hashed
        _keep_digest(key, digest)
    return digest


def _stat_key(info: os.stat_result) -> str:
    return f"{info.st_dev}:{info.st_ino}:{info.st_size}:{info.st_mtime_ns}:{info.st_ctime_ns}"


def _digest_cache_path() -> str:
    return os.path.join(cache_folder(), DIGEST_CACHE)


def _read_digest_cache() -> Dict[str, str]:
    """{stat key: SHA-256} of the cache; {} when there is none, or it is not this user's regular
    file of bounded size, or not a cache (a corrupt cache is ignored: the file is hashed again).
    """
    try:
        cache = json.loads(read_regular(_digest_cache_path(), DIGEST_CACHE_BYTES, owner=os.geteuid()))
    except (OSError, ValueError):
        return {}
    digests = cache.get("sha256") if isinstance(cache, dict) else None
    return digests if isinstance(digests, dict) else {}


def _keep_digest(key: str, digest: str) -> None:
    """Add a digest to the cache (the newest DIGEST_CACHE_ENTRIES kept); a cache that cannot be
    written (a read-only home) only costs the next start another hash.
    """
    digests = _read_digest_cache()
    digests.pop(key, None)
    digests[key] = digest
    kept = dict(list(digests.items())[-DIGEST_CACHE_ENTRIES:])
    try:
        os.makedirs(cache_folder(), mode=0o700, exist_ok=True)
        atomic_write(_digest_cache_path(), json.dumps({"sha256": kept}))
    except OSError:
        pass


def folder_identity(folder: str) -> dict:
    """A model folder's identity: each file's digest by name (not the folder's name or place),
    and the commit of a hub snapshot (``.../snapshots/<commit>/``). Hashed once per process for
    the same files (the same names, sizes, mtimes and ctimes): a run that evaluates in rounds asks each round.
    """
    stats = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            stat = os.stat(path)
            stats.append((name, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino))
    return _folder_identity(folder, tuple(stats))


@functools.lru_cache(maxsize=16)
def _folder_identity(folder: str, stats: tuple) -> dict:
    real = os.path.realpath(folder)
    files = [(name, file_digest(os.path.join(folder, name))) for name, *_ in stats]
    commit = re.search(r"/snapshots/([0-9a-f]{40})(/|$)", os.path.abspath(folder) + "/") or re.search(
        r"/snapshots/([0-9a-f]{40})(/|$)", real + "/")
    return {"files": files, "hub_commit": commit.group(1) if commit else None}


def tensors_digest(tensors: dict) -> str:
    """The prompts' and head's content: names, dtypes, shapes and bytes of each tensor."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}:".encode())
        digest.update(tensor.view(-1).view(dtype=_byte_dtype()).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def _byte_dtype():
    import torch

    return torch.uint8


# init arguments that say how a tokenizer was found, not what it computes: transformers 5.x keeps them in
# init_kwargs (local_files_only is True where HF_HUB_OFFLINE is set, so a run's ranks and the process that filled a
# row store disagreed, and no stored row was found); the pinned 4.33 keeps neither (its keys are unchanged)
LOADING_ARGUMENTS = ("local_files_only", "is_local")


def tokenizer_digest(tokenizer) -> str:
    """The tokenizer's content: a fast tokenizer's whole definition (vocabulary, merges,
    normalizer, pre- and post-processor), else its vocabulary; its class and init arguments
    (but :data:`LOADING_ARGUMENTS`).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        body = backend.to_str()
    else:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        body = json.dumps(sorted(vocab.items()), ensure_ascii=False)
    init = getattr(tokenizer, "init_kwargs", None)
    if isinstance(init, dict):
        init = {name: value for name, value in init.items() if name not in LOADING_ARGUMENTS}
    facts = {"class": type(tokenizer).__name__, "init": init,
             "special": getattr(tokenizer, "special_tokens_map", None)}
    return hashlib.sha256(body.encode() + json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()
