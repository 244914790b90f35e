"""The local backend with its blocks streamed from disk: the model's transformer blocks stay in their
safetensors files and each is loaded when the forward reaches it and freed when it has run (accelerate's
disk offload, which transformers' ``from_pretrained(device_map=...)`` sets up on the pinned transformers, and
:func:`_load_blocks_unread` on 5.x, whose ``from_pretrained`` reads every offloaded tensor at the load; the weights
are read from the model's own files, not copied: the tensors outside the blocks are copied into a small file of a
temporary view of the folder). The embeddings, the final norm and the head stay in memory. Peak memory: those, one
block and the rows' activations, for a model of any size (benchmarks/RESULTS.md; the offload's hooks also
import ``torch._dynamo`` at their first call, ~64 MiB of code); the logits are those of the in-memory
local backend (:func:`dist_eval.backends.local.load_local`) bit for bit: the same modules, the same weights,
the same computation, only where the weights wait between forwards differs.

The local backend's ``--stream-blocks`` (``load_model(..., stream_blocks=True)``: :data:`dist_eval.backends.kinds.
BACKENDS`' ``local.streamed``), and ``python -m dist_eval.verify --backend local``'s default (``--in-memory``
loads the model whole instead). On a hub snapshot folder holding the client's shards alone (a hub id resolved
with ``stream``: :func:`dist_eval.backends.hub.resolve_model`), each block's shards are fetched when the forward
first reaches it, before the offload reads them.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
import weakref
from typing import Iterator, Optional

import torch

from dist_eval.backends.base import Backend
from dist_eval.backends.checkpoint import TrainableState
from dist_eval.backends.families import Family
from dist_eval.backends.hub import HubSource
from dist_eval.backends.zeroshot import LabelWords


def load_streamed(
    model_dir: str, state: TrainableState, family: Family, device: str = "cpu",
    label_words: Optional[LabelWords] = None, hub: Optional[HubSource] = None,
) -> Backend:
    """:func:`~dist_eval.backends.local.load_local`'s model, its blocks left on disk (see the module). ``hub``:
    where the shards of ``model_dir`` (a hub snapshot) not fetched yet come from: each block's when it first runs.
    """
    from dist_eval.backends.blocks import family_class
    from dist_eval.backends.compat import attention_choice, heads_read_after, no_random_init_of_meta_tensors
    from dist_eval.backends.local import PromptTunedClassifier
    from dist_eval.backends.petals_folder import detect_layout, missing_shards, petals_model_folder, require_every_shard
    from dist_eval.backends.zeroshot import ZeroShotScorer, read_saved_lm_head
    from dist_eval.errors import UsageError

    _refuse_quantized(model_dir, family)
    if str(device).split(":")[0] != "cpu":
        raise UsageError("expected cpu: the blocks streamed from disk are computed on the CPU. Pass --device cpu, "
                         "or load the model whole (--in-memory).", param="device", value=device)
    fetched_later = bool(hub) and bool(missing_shards(model_dir))
    if not fetched_later:
        require_every_shard(model_dir, "--backend local")
    if not detect_layout(model_dir, family).client_ready:
        if fetched_later:  # the converted copy is written from every shard
            raise UsageError(f"this {family.model_type} release's tensors are renamed into a converted copy before "
                             "they are read, which needs every shard at hand, not fetched block by block. Pass "
                             "--fetch-whole-model instead of --stream-blocks.", param="stream_blocks")
        model_dir = petals_model_folder(model_dir)
    config_class = family_class(family.local_lm_class if label_words is not None else family.local_class,
                                in_petals=False)
    with heads_read_after():  # a family's other model_type read as the family: no note of another type
        config = config_class.config_class.from_pretrained(model_dir)
    blocks = family.blocks.rstrip(".")
    view = tempfile.mkdtemp(prefix="dist_eval-streamed-")
    try:
        files = _tensor_files(model_dir)  # {tensor: file}, read once for the view, the fetches and the buffers
        _client_view(model_dir, files, blocks, config.num_hidden_layers, view)
        # the head no file may name: the classifier's, or a causal LM's saved under another name (saved_lm_head)
        device_map = _device_map(view, blocks, config.num_hidden_layers,
                                 family.head if label_words is None else family.lm_head)
        kwargs = {} if label_words is not None else {"num_labels": state.num_labels, "ignore_mismatched_sizes": False}
        with no_random_init_of_meta_tensors(), _no_progress_bar(), warnings.catch_warnings(), \
                heads_read_after(family.head, family.lm_head, unread=family.lm_head_weights):
            # "Loading checkpoint shards" (the view's) is not shown; nor that a causal LM's lm_head, mapped from
            # the files' names, is no module of a classifier
            warnings.filterwarnings("ignore", "The following device_map keys do not match any submodules")
            hf_model = _load_offloaded(config_class, view, device_map, blocks, kwargs, attention_choice(family))
        _whole_where_children_are_read(hf_model, family)
        for block in family.get(hf_model, family.blocks):  # its freed weights given back before the next block's
            block.register_forward_hook(_give_back_heap)
        if fetched_later:  # before the buffers' hooks: a block's shards are there when they are read
            _fetch_each_block_when_it_runs(hf_model, family, model_dir, files, hub)
        _read_resident_buffers(hf_model, family, files, when_each_runs=fetched_later)
    except BaseException:
        shutil.rmtree(view, True)
        raise
    model = PromptTunedClassifier(hf_model, state.tuning_mode, state.pre_seq_len, family)
    model.load_trainable(state)
    if label_words is not None:
        read_saved_lm_head(family.get(hf_model, family.lm_head), model_dir, hf_model.config, family)
        model = ZeroShotScorer(model, family.get(hf_model, family.lm_head), label_words)
    weakref.finalize(model, shutil.rmtree, view, True)  # the view goes with the model
    return model


def _load_offloaded(config_class, view: str, device_map: dict, blocks: str, kwargs: dict, attention: dict):
    """The model of the folder ``view`` (:func:`_client_view`), its blocks offloaded to "disk" (``device_map``):
    transformers' ``from_pretrained(device_map=...)`` where it reads none of their tensors at the load, else
    :func:`_load_blocks_unread`.
    """
    if _load_reads_offloaded_tensors():
        return _load_blocks_unread(config_class, view, device_map, blocks, kwargs, attention)
    return config_class.from_pretrained(view, torch_dtype=torch.float32, device_map=device_map,
                                        offload_folder=os.path.join(view, "offload"), offload_state_dict=False,
                                        **kwargs, **attention)


def _load_reads_offloaded_tensors() -> bool:
    """Whether transformers' ``from_pretrained(device_map=...)`` reads the tensors of the modules it offloads to
    "disk" at the load (>= 5.0: it opens every weight file the index names and reads each tensor before it finds
    the tensor's place in the offload index; a block's shard not fetched yet fails the load, and the load reads the
    whole model). The pinned 4.33 reads none of a file whose tensors are all offloaded: it only records where they
    are, for the offload to read each when its block runs.
    """
    from dist_eval.backends.compat import loads_through_module_hooks

    return not loads_through_module_hooks()  # 5.x's own loader (core_model_loading)


def _load_blocks_unread(config_class, view: str, device_map: dict, blocks: str, kwargs: dict, attention: dict):
    """The model of ``view`` as ``from_pretrained(device_map=...)`` makes it where that would read the blocks'
    tensors at the load (:func:`_load_reads_offloaded_tensors`): built on the meta device (its buffers computed on
    the CPU by its modules' ``__init__``), the client's tensors (``client.safetensors``, under the names the model
    has, the base model's prefix added where a folder saved them without it) assigned, a module none of them fills
    outside the blocks (the classifier's head) initialised as transformers initialises it, tied weights tied, then
    accelerate's dispatch: each block's tensors read from the files the view's index names when the block runs.
    """
    import json

    from accelerate import dispatch_model, init_empty_weights
    from safetensors.torch import load_file

    config = config_class.config_class.from_pretrained(view, **{k: v for k, v in kwargs.items() if k == "num_labels"})
    with init_empty_weights(include_buffers=False):
        model = config_class._from_config(config, dtype=torch.float32, **attention)  # 5.x's keyword (torch_dtype warns)
    names = set(model.state_dict())
    prefix = model.base_model_prefix + "."
    client = {(key if key in names or prefix + key not in names else prefix + key): tensor
              for key, tensor in load_file(os.path.join(view, "client.safetensors")).items()}
    model.load_state_dict({key: tensor.to(torch.float32) for key, tensor in client.items() if key in names},
                          strict=False, assign=True)
    for name, param in list(model.named_parameters()):
        if param.is_meta and not name.startswith(blocks + "."):  # the head, in no file: initialised, then replaced
            module_name, _, leaf = name.rpartition(".")
            module = model.get_submodule(module_name)
            setattr(module, leaf, torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                                     requires_grad=param.requires_grad))
            model._init_weights(module)
    model.tie_weights()
    with open(os.path.join(view, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    index = {name: {"safetensors_file": os.path.join(view, file), "weight_name": name, "dtype": "float32"}
             for name, file in weight_map.items() if name.startswith(blocks + ".") and name in names}
    unread = sorted(name for name, param in model.named_parameters() if param.is_meta and name not in index)
    if unread:  # else the offload fails at that block's first forward, naming no file
        from dist_eval.errors import UsageError

        raise UsageError(f"expected every block weight in the folder's files: {len(unread)} in none of them (first: "
                         f"{unread[:3]}). Save or copy the model folder again, with all its shards.", param="model_dir")
    dispatch_model(model, device_map=device_map, main_device="cpu", offload_index=index, offload_buffers=False)
    return model.eval()


def _refuse_quantized(model_dir: str, family: Family) -> None:
    """A folder of quantized weights (config.json's ``quantization_config``: FP8 tiles, MXFP4, INT4) refused in one
    line: the offload reads a block's tensors as saved, where loading the model whole dequantizes them.
    """
    from dist_eval.backends.config_json import read_config_json
    from dist_eval.errors import UsageError

    quantization = read_config_json(model_dir).get("quantization_config")  # as local's check reads it
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise UsageError(f"expected weights read as they are saved: this {family.model_type} folder's are quantized "
                         f"(quant_method {method!r} in config.json's quantization_config), dequantized as the whole "
                         "model loads, not block by block. Load the model whole: drop --stream-blocks (python -m "
                         "dist_eval.verify: pass --in-memory), or save it dequantized.", param="stream_blocks")


def _fetch_each_block_when_it_runs(hf_model, family: Family, model_dir: str, files: dict, hub: HubSource) -> None:
    """A hook before each block's forward (before the offload's, which reads the block: it wraps the block's
    ``forward``, which runs after every pre-hook) fetching into ``model_dir`` the shards holding its tensors
    that are not there yet: a block's shards at a time, in the order the forward needs them.
    """
    for index, block in enumerate(family.get(hf_model, family.blocks)):
        prefix = f"{family.blocks}.{index}."
        needed = sorted({os.path.basename(file) for name, file in files.items() if name.startswith(prefix)})
        block.register_forward_pre_hook(_fetcher(model_dir, needed, hub))


def _fetcher(model_dir: str, names: list, hub: HubSource):
    def fetch_absent(module, args) -> None:
        for name in names:
            if not os.path.exists(os.path.join(model_dir, name)):
                hub.fetch(name)

    return fetch_absent


def _give_back_heap(module, args, output) -> None:
    """After a block's forward (its weights freed by the offload's hook, which runs before this one: it was
    added first): the C heap's free memory given back to the system (glibc's ``malloc_trim``), else the freed
    weights of each block stay in the process (glibc raises its mmap threshold after a big free, so the next
    block's tensors come from the heap, which it does not shrink by itself).
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _tensor_files(model_dir: str) -> dict:
    """{tensor name: the safetensors file of the folder that holds it}."""
    import json

    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(model_dir, file) for name, file in json.load(f)["weight_map"].items()}
    out = {}
    for file in sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors")):
        with safe_open(os.path.join(model_dir, file), "pt") as f:
            out.update({name: os.path.join(model_dir, file) for name in f.keys()})  # noqa: SIM118 (not iterable)
    return out


def _client_view(model_dir: str, files: dict, blocks: str, num_blocks: int, view: str) -> None:
    """In ``view``: the model folder as transformers reads it, its blocks' tensors left where they are. The
    tensors outside the blocks (embeddings, final norm, heads: read whole at the load) copied into one small
    file; each weight file holding blocks linked under its name, and the index naming, for each block tensor,
    that link: transformers then reads none of them at the load (a file of the blocks alone is left to the
    offload, which reads each tensor when its block runs). Every other file (config, tokenizer) linked. The
    tensors of blocks past ``num_blocks`` (a release's multi-token-prediction block) are
    left out, as the model loaded whole leaves them: the offload's index would name a block the model has not.
    """
    import json

    from safetensors import safe_open
    from safetensors.torch import save

    from dist_eval.atomic import atomic_write

    client, weight_map = {}, {}
    for name, file in sorted(files.items()):
        if name.startswith(blocks + "."):
            index = name[len(blocks) + 1:].split(".", 1)[0]
            if index.isdigit() and int(index) >= num_blocks:
                continue
            link = os.path.join(view, "blocks-" + os.path.basename(file))
            if not os.path.lexists(link):
                os.symlink(os.path.realpath(file), link)
            weight_map[name] = os.path.basename(link)
        else:
            with safe_open(file, "pt") as f:
                client[name] = f.get_tensor(name)
            weight_map[name] = "client.safetensors"
    atomic_write(os.path.join(view, "client.safetensors"), save(client, metadata={"format": "pt"}), binary=True)
    atomic_write(os.path.join(view, "model.safetensors.index.json"),
                 json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    for name in os.listdir(model_dir):
        if not name.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")):
            os.symlink(os.path.realpath(os.path.join(model_dir, name)), os.path.join(view, name))


def _whole_where_children_are_read(hf_model, family: Family) -> None:
    """Each module of a block that reads a child module's weight without calling the child (a class of
    :mod:`dist_eval.backends.layers` marked ``reads_child_weights``: a convolution computed with its weight, a
    grouped projection, fused experts indexed by expert) gets its weights, its children's too, brought in by
    one hook before it runs (accelerate's ``preload_module_classes``); transformers' load hooks each module
    holding weights, bringing them in only when that module is called, which left those on the meta device.
    Every other module keeps its own hook: a block's experts are brought in one at a time, as before.
    """
    from accelerate.hooks import attach_align_device_hook, remove_hook_from_submodules

    for index, block in enumerate(family.get(hf_model, family.blocks)):
        whole = sorted({type(m).__name__ for m in block.modules() if getattr(type(m), "reads_child_weights", False)})
        hooks = [m._hf_hook for m in block.modules()
                 if getattr(getattr(m, "_hf_hook", None), "weights_map", None) is not None]
        if not whole or not hooks:  # none of it reads a child's weight, or nothing of it offloaded
            continue
        first = hooks[0]
        remove_hook_from_submodules(block)
        attach_align_device_hook(block, execution_device=first.execution_device, offload=True,
                                 weights_map=first.weights_map.dataset, module_name=f"{family.blocks}.{index}",
                                 skip_keys=first.skip_keys, preload_module_classes=whole,
                                 tied_params_map=first.tied_params_map)


def _read_resident_buffers(hf_model, family: Family, files: dict, when_each_runs: bool = False) -> None:
    """The blocks' persistent buffers saved with the weights (a router's correction bias, a table of experts by
    token id, a float32 weight kept as a buffer) read from the model's files into the model: the offload keeps a
    block's buffers in memory, and the load under it leaves them as the model's init made them, where the model
    loaded whole reads them (the same values, converted to each buffer's dtype as loading whole converts them).
    A non-persistent buffer (a rotary table an old checkpoint saved too) keeps the model's own, as loading whole
    keeps it. ``when_each_runs`` (a hub snapshot whose blocks' shards are fetched as they first run): each block's
    read before its first forward, after its shards' fetch. Small: a few numbers per expert, or one table.
    """
    for index, block in enumerate(family.get(hf_model, family.blocks)):
        prefix = f"{family.blocks}.{index}."
        saved = [(module, leaf, buffer.dtype, prefix + name)
                 for name, buffer in block.named_buffers()
                 for module_name, _, leaf in [name.rpartition(".")]
                 for module in [block.get_submodule(module_name)]
                 if prefix + name in files and leaf not in module._non_persistent_buffers_set]
        if not saved:
            continue
        if when_each_runs:
            _read_before_first_forward(block, saved, files)
        else:
            _read_buffers(saved, files)


def _read_before_first_forward(block, saved: list, files: dict) -> None:
    def read_once(module, args) -> None:
        handle.remove()
        _read_buffers(saved, files)

    handle = block.register_forward_pre_hook(read_once)


def _read_buffers(saved: list, files: dict) -> None:
    from safetensors import safe_open

    for module, leaf, dtype, name in saved:
        with safe_open(files[name], "pt") as f:
            module._buffers[leaf] = f.get_tensor(name).to(dtype=dtype, device="cpu")


def _device_map(model_dir: str, blocks: str, num_blocks: int, head: str) -> dict:
    """Each block on "disk", every other module holding weights on "cpu": those of the files' tensor names
    (transformers must find each, a causal LM's head read as a classifier's too) and ``head`` (the classifier's,
    in no file; with label words the causal LM's, which a release may save under another name). Made from the
    names alone: a skeleton of the model, even on the meta device, cost more memory than a block.
    """
    out = {head: "cpu", **{f"{blocks}.{i}": "disk" for i in range(num_blocks)}}
    for name in _tensor_files(model_dir):
        if not name.startswith(blocks + "."):
            out[name.rsplit(".", 1)[0]] = "cpu"
    return out
