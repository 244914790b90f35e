"""A model folder as petals 2.2.0's server and client read it, for every family (used by the
local swarm's servers and by the petals client alike).

What petals needs (measured with tiny folders of the three families on a local swarm):

- **Server** (``petals/server/from_pretrained.py::load_pretrained_block``): block ``i``'s
  tensors are looked up by the exact key prefix ``<Family.server_blocks>.<i>.`` (petals'
  ``Distributed*Config.block_prefix``). A folder whose keys carry another prefix makes the
  server exit with "Some block weights are missing". Which files to read comes from
  ``model.safetensors.index.json`` (sharded) or the single ``model.safetensors`` /
  ``pytorch_model.bin``.
- **Client** (``Distributed*ForSequenceClassification.from_pretrained``, transformers'
  loader): reads the embeddings, the embedding norm (BLOOM), the final norm and, when
  present, ``score.weight``; the block keys are skipped. It accepts a prefixed save
  (``*ForCausalLM`` / ``*ForSequenceClassification``) and a base-model save, but NOT a
  base-model layout that also holds ``score.weight`` ("The state dictionary of the model
  you are trying to load is corrupted").

So the folders that need converting are: BLOOM saved from its causal-LM or
sequence-classification class (prefixed block keys), FALCON and LLAMA saved
from their base model class (unprefixed block keys), and a base-layout folder with
a ``score`` head. :func:`petals_model_folder` returns the folder itself when petals reads it
as it is, else a converted copy in a cache folder, written once (atomically, so several
ranks may ask at once) and reused while the source files are unchanged. The copy is in the
family's hub layout (``server_blocks``) for every tensor of the base model, so transformers
reads it too (a mixed layout would load with random blocks, silently). When that layout has
no prefix (BLOOM), a ``score`` / ``lm_head`` head is left out of the copy (petals' client
refuses a head beside unprefixed keys); dist_eval reads the head from the source folder or
the checkpoint, never from the copy. With a prefixed layout, heads are kept.

Files: ``client.safetensors`` (every tensor that is not a block's), ``blocks-<k>.safetensors``
(one per source weight file, so memory stays at one source shard at a time; petals'
client skips these shards), ``model.safetensors.index.json`` mapping each key to its file,
and the source folder's other files (config.json, tokenizer files) copied. The copy keeps the
source's permissions (a private folder's weights stay private: :func:`_keep_source_modes`). The block
tensors are copied (safetensors cannot rename keys in place), so a conversion needs as much
free disk as the source weights.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from dist_eval.atomic import cache_folder
from dist_eval.backends.config_json import family_of_folder
from dist_eval.backends.families import Family
from dist_eval.errors import UsageError

# in the order petals' server looks for them (petals/server/from_pretrained.py INDEX_FILES)
WEIGHT_FILES = (
    "model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin"
)
HEAD_PREFIXES = ("score.", "lm_head.")
# 2: a copy keeps its source's modes (a copy of version 1 was readable by everyone)
CONVERSION_VERSION = "2"


@dataclass(frozen=True)
class FolderLayout:
    family: Family
    # key -> file (relative to the folder) holding it
    weight_map: Dict[str, str]
    # prefix the block stack has in this folder, (a Family.blocks or Family.block_name)
    block_prefix: str
    # True when the base model's keys carry the checkpoint prefix (a *ForCausalLM / *ForSequenceClassification save)
    prefixed: bool
    # a vision-language release: the text model's keys under Family.text_prefix (read as its checkpoint_prefix)
    text_nested: bool = False
    # a release under its own names (Family.release_renames) or with tensors never read (Family.skipped_prefixes),
    # its keys without the checkpoint prefix: read from the converted copy, under the family's names
    released: bool = False

    @property
    def server_ready(self) -> bool:
        return self.block_prefix == self.family.server_blocks and not self.released

    @property
    def client_ready(self) -> bool:
        if self.text_nested or self.released:
            return False
        return self.prefixed or not any(k.startswith(HEAD_PREFIXES) for k in self.weight_map)

    @property
    def num_blocks(self) -> int:
        pattern = re.compile(re.escape(self.block_prefix) + r"\.(\d+)\.")
        return len({m.group(1) for k in self.weight_map for m in [pattern.match(k)] if m})


def weight_map(model_dir: str) -> Dict[str, str]:
    """Every tensor name of the folder -> the file that holds it (the file petals and
    transformers would read, in their order of preference).
    """
    for name in WEIGHT_FILES:
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        if name.endswith(".index.json"):
            with open(path) as f:
                return dict(json.load(f)["weight_map"])
        return {key: name for key in _tensor_names(path)}
    raise UsageError(
        f"no weights ({', '.join(WEIGHT_FILES)}); pass a folder saved with save_pretrained().",
        param="model_dir", value=model_dir,
    )


def missing_shards(model_dir: str) -> List[str]:
    """The weight files the folder's index names that are not in the folder (what petals'
    client leaves out of its cache: the shards that hold only blocks); a shard holding only what is
    never read (a vision-language release's vision tower, Family.skipped_prefixes) is not missed.
    """
    try:
        mapping = weight_map(model_dir)
    except UsageError:
        return []  # no weights at all: the loader says so
    try:
        unread = tuple(family_of_folder(model_dir).skipped_prefixes)
    except UsageError:
        unread = ()
    needed = {f for key, f in mapping.items() if not (unread and key.startswith(unread))}
    return sorted(f for f in needed if not os.path.isfile(os.path.join(model_dir, f)))


def require_every_shard(model_dir: str, needs: str) -> None:
    """A UsageError, one line naming the absent shards, when ``needs`` (what reads every block:
    "--backend local", "a local swarm") would read a folder that holds only the client's shards.
    """
    missing = missing_shards(model_dir)
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise UsageError(
            f"{needs} reads every block's weights, but the folder's index names shards that are not in it "
            f"({shown}). Pass a folder that holds every shard, or use --backend petals --initial-peers "
            "with a swarm that serves the blocks (it reads only the client's shards).",
            param="model_dir", value=model_dir,
        )


def read_tensor(model_dir: str, key: str):
    """The tensor named ``key`` in the folder's weights (only that one is read from a
    safetensors file); a UsageError naming the key when the folder has none.
    """
    source = weight_map(model_dir).get(key)
    if source is None:
        raise UsageError(f"no tensor {key!r} in the folder's weights.", param="model_dir", value=model_dir)
    path = os.path.join(model_dir, source)
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            return f.get_tensor(key)
    return _load_bin(path)[key]


def read_tensors(model_dir: str) -> dict:
    """Every tensor of the folder's weights, read whole from the files :func:`weight_map` names."""
    tensors = {}
    for source in sorted(set(weight_map(model_dir).values())):
        tensors.update(_load_file(os.path.join(model_dir, source)))
    return tensors


def _tensor_names(path: str) -> List[str]:
    if path.endswith(".safetensors"):
        return safetensors_names(path)
    return list(_load_bin(path))


def safetensors_names(path: str) -> List[str]:
    """The tensor names of a safetensors file, read from its header with the standard library
    (``safe_open`` would import torch: ``python -m dist_eval.swarm`` reads folders without it).
    The format: an 8-byte little-endian header length, then the JSON header.
    """
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return [name for name in header if name != "__metadata__"]


def _load_bin(path: str):
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)


def _load_file(path: str):
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return _load_bin(path)


def _load_keys(path: str, keys: List[str]):
    """The tensors named ``keys`` of a weight file (of a safetensors file those alone are read)."""
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            return {key: f.get_tensor(key) for key in keys}
    tensors = _load_bin(path)
    return {key: tensors[key] for key in keys}


def detect_layout(model_dir: str, family: Optional[Family] = None) -> FolderLayout:
    """The folder's family (from config.json) and where its blocks' tensors are."""
    if family is None:
        family = family_of_folder(model_dir)
    mapping = weight_map(model_dir)
    nested_blocks = f"{family.text_prefix}{family.block_name}."
    if family.text_prefix and any(k.startswith(nested_blocks) for k in mapping):
        return FolderLayout(family, mapping, nested_blocks[:-1], prefixed=True, text_nested=True)
    prefixed_blocks = f"{family.blocks}."
    bare_blocks = f"{family.block_name}."
    has_prefixed = any(k.startswith(prefixed_blocks) for k in mapping)
    has_bare = any(k.startswith(bare_blocks) for k in mapping)
    if has_prefixed == has_bare:
        found = sorted(mapping)[:5]
        what = "both" if has_prefixed else "neither"
        raise UsageError(
            f"a {family.model_type} folder's blocks are under '{prefixed_blocks}<i>.' or "
            f"'{bare_blocks}<i>.'; this one has {what} (first keys: {found}).",
            param="model_dir", value=model_dir,
        )
    block_prefix = prefixed_blocks[:-1] if has_prefixed else bare_blocks[:-1]
    released = not has_prefixed and any(as_released(key, family) != key for key in mapping)
    return FolderLayout(family, mapping, block_prefix, prefixed=has_prefixed, released=released)


def as_released(key: str, family: Family) -> Optional[str]:
    """The name ``key`` of a folder without the checkpoint prefix is read under (``Family.release_renames``
    applied: the release's own names, DeepSeek-V4's), None for a tensor never read (``Family.skipped_prefixes``).
    """
    if not family.release_renames:
        return key
    if key.startswith(family.skipped_prefixes):
        return None
    for pattern, replacement in family.release_renames:
        key = re.sub(pattern, replacement, key)
    return key


def _rename(key: str, layout: FolderLayout) -> Tuple[str, Optional[str]]:
    """("block" | "client", key in the converted folder), or (.., None): left out."""
    family = layout.family
    prefix = family.checkpoint_prefix
    if layout.text_nested:  # a vision-language release: its text model's keys, the rest left out
        renamed = [(saved, read) for saved, read in family.text_renames if key.startswith(saved)]
        if key.startswith(family.text_prefix):
            key = prefix + key[len(family.text_prefix):]
        elif renamed:  # another part of the text model (Kimi K2.5's head)
            key = renamed[0][1] + key[len(renamed[0][0]):]
        elif key.startswith(family.skipped_prefixes):
            return "client", None
    elif layout.released:  # the release's own names (its multi-token-prediction layer left out)
        key = as_released(key, family)
        if key is None:
            return "client", None
    target_prefixed = family.server_blocks.startswith(prefix)
    heads = HEAD_PREFIXES + ((family.saved_lm_head + ".",) if layout.released and family.saved_lm_head else ())
    if key.startswith(heads) or (layout.prefixed and not key.startswith(prefix)):
        return "client", (key if target_prefixed else None)  # a head (see the module doc)
    base_key = key[len(prefix):] if layout.prefixed else key
    new_key = prefix + base_key if target_prefixed else base_key
    return ("block" if base_key.startswith(family.block_name + ".") else "client"), new_key


def _fingerprint(model_dir: str, layout: FolderLayout) -> str:
    h = hashlib.sha256()
    h.update(f"v{CONVERSION_VERSION}\0{os.path.realpath(model_dir)}\0".encode())
    for name in sorted(set(layout.weight_map.values()) | {"config.json"}):
        if not os.path.isfile(os.path.join(model_dir, name)):  # a shard a client's folder leaves out
            h.update(f"{name}\0absent\0".encode())
            continue
        # the ctime too: a file changed with its mtime set back has a new one (backends/provenance.py)
        st = os.stat(os.path.join(model_dir, name))
        h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{st.st_ctime_ns}\0".encode())
    return h.hexdigest()[:16]


def default_cache_dir() -> str:
    """``<$DIST_EVAL_CACHE or ~/.cache/dist_eval>/petals_folders``."""
    return os.path.join(cache_folder(), "petals_folders")


def petals_model_folder(model_dir: str, cache_dir: Optional[str] = None, log=None) -> str:
    """A folder petals' server and client both read for ``model_dir``: ``model_dir`` itself
    when it already is one, else its converted copy under ``cache_dir`` (see module doc).
    """
    layout = detect_layout(model_dir)
    if layout.server_ready and layout.client_ready:
        return model_dir
    cache_dir = cache_dir or default_cache_dir()
    name = os.path.basename(os.path.normpath(model_dir)) or "model"
    target = os.path.join(cache_dir, f"{name}-{layout.family.model_type}-{_fingerprint(model_dir, layout)}")
    if os.path.isfile(os.path.join(target, "model.safetensors.index.json")):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    if log:
        log(f"converting {model_dir} (blocks under '{layout.block_prefix}.<i>.') to the layout petals' "
            f"{layout.family.model_type} server reads ('{layout.family.server_blocks}.<i>.') in {target}")
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=cache_dir)  # private (0700) while written
    try:
        _write_converted(model_dir, layout, tmp)
        _keep_source_modes(model_dir, layout, tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: its copy is the same
            if not os.path.isfile(os.path.join(target, "model.safetensors.index.json")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _absent_shard(model_dir: str, layout: FolderLayout, source: str, fname: str, new_map: Dict[str, str],
                  dropped: List[str]) -> None:
    """A weight file the folder's index names and the folder lacks (a client's folder: petals' client, or a
    hub id fetched by :func:`dist_eval.backends.hub.client_folder`, keeps only the shards with a client
    tensor): its blocks' keys stay in the copy's index under ``fname``, absent too (so the copy is a
    client's folder as its source is: what reads every block refuses it, :func:`require_every_shard`), the
    keys never read (a vision tower) are left out; a client tensor in it is refused in one line.
    """
    for key in sorted(k for k, held in layout.weight_map.items() if held == source):
        part, new_key = _rename(key, layout)
        if new_key is None:
            dropped.append(key)
        elif part == "block":
            new_map[new_key] = fname
        else:
            raise UsageError(f"the folder's index puts {key} (a tensor the client reads) in {source}, which is not "
                             "in the folder. Fetch that shard (or the whole model) again.",
                             param="model_dir", value=model_dir)


def _keep_source_modes(model_dir: str, layout: FolderLayout, out: str) -> None:
    """The copy as readable as its source, no more: the folder gets the source folder's mode,
    each ``blocks-<k>`` file its source weight file's, the files holding every source's tensors
    (``client.safetensors``, the index) what all the weight files allow; the owner always may
    read and write (to delete the cache). The other files were copied with their modes.
    """
    def mode(path: str) -> int:
        return os.stat(path).st_mode & 0o777

    sources = sorted(set(layout.weight_map.values()))
    common = 0o777
    for k, source in enumerate(sources):
        if not os.path.isfile(os.path.join(model_dir, source)):
            continue  # a shard a client's folder leaves out: nothing of it copied
        common &= mode(os.path.join(model_dir, source))
        blocks = os.path.join(out, f"blocks-{k:05d}.safetensors")
        if os.path.exists(blocks):
            os.chmod(blocks, mode(os.path.join(model_dir, source)) | 0o600)
    for name in ("client.safetensors", "model.safetensors.index.json"):
        os.chmod(os.path.join(out, name), common | 0o600)
    os.chmod(out, mode(model_dir) | 0o700)


def _write_converted(model_dir: str, layout: FolderLayout, out: str) -> None:
    from safetensors.torch import save_file

    skip = set(WEIGHT_FILES) | set(layout.weight_map.values())
    for entry in os.listdir(model_dir):
        src = os.path.join(model_dir, entry)
        if entry not in skip and os.path.isfile(src):
            shutil.copy2(src, os.path.join(out, entry))
    new_map: Dict[str, str] = {}
    client: Dict[str, object] = {}
    dropped: List[str] = []
    total = 0
    for k, source in enumerate(sorted(set(layout.weight_map.values()))):
        if not os.path.isfile(os.path.join(model_dir, source)):
            _absent_shard(model_dir, layout, source, f"blocks-{k:05d}.safetensors", new_map, dropped)
            continue
        if layout.text_nested or layout.released:  # the tensors left out (a vision tower, an MTP layer): never read
            names = [key for key, held in layout.weight_map.items() if held == source]
            dropped += [key for key in names if _rename(key, layout)[1] is None]
            kept = [key for key in names if _rename(key, layout)[1] is not None]
            if not kept:
                continue
            tensors = _load_keys(os.path.join(model_dir, source), kept)
        else:
            tensors = _load_file(os.path.join(model_dir, source))
        blocks = {}
        for key, tensor in tensors.items():
            if layout.weight_map.get(key) != source:
                continue  # a stray copy: the index says another file holds it
            part, new_key = _rename(key, layout)
            if new_key is None:
                dropped.append(key)
                continue
            tensor = tensor.contiguous()
            total += tensor.numel() * tensor.element_size()
            (blocks if part == "block" else client)[new_key] = tensor
        if blocks:
            fname = f"blocks-{k:05d}.safetensors"
            save_file(blocks, os.path.join(out, fname), metadata={"format": "pt"})
            new_map.update({key: fname for key in blocks})
        del tensors, blocks
    save_file(client, os.path.join(out, "client.safetensors"), metadata={"format": "pt"})
    new_map.update({key: "client.safetensors" for key in client})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total, "converted_from": os.path.realpath(model_dir),
                                "left_out": sorted(dropped)},
                   "weight_map": dict(sorted(new_map.items()))}, f, indent=1)
