"""How a server dist_eval starts builds and reads its blocks (the server's half of
:mod:`dist_eval.backends.blocks`, applied by :func:`dist_eval.swarm.server.apply_server_patches`): each block
built knowing its index, its tensors dequantized as released (FP8 tiles, INT4 groups, MXFP4 and FP4 experts) as
petals' server reads them, and the version it announces marked (it computes the block options).
"""
from __future__ import annotations

import contextvars
import functools

from dist_eval.backends.blocks import SERVER_VERSION_MARK

# the FP8 tile of the block this process's petals server is loading (None: not FP8, or not loading)
_SERVER_FP8_BLOCK: contextvars.ContextVar = contextvars.ContextVar("dist_eval_server_fp8_block", default=None)
# the INT4 group size of the block this process's petals server is loading (None: not INT4, or not loading)
_SERVER_INT4_GROUP: contextvars.ContextVar = contextvars.ContextVar("dist_eval_server_int4_group", default=None)
# whether the block this process's petals server is loading has MXFP4 tensors (gpt-oss's experts)
_SERVER_MXFP4: contextvars.ContextVar = contextvars.ContextVar("dist_eval_server_mxfp4", default=False)
# whether the block this process's petals server is loading is DeepSeek-V4's (its FP8 tiles + FP4 experts, as released)
_SERVER_V4: contextvars.ContextVar = contextvars.ContextVar("dist_eval_server_v4", default=False)


def server_block_replacements() -> list:
    """Petals' server builds block ``i`` as ``config.block_class(config)``, without ``i``; a
    block of dist_eval's layers needs it (which blocks have the mixture of experts). The
    server's ``load_pretrained_block`` (which knows ``i``) sets it for the block's build
    (:data:`dist_eval.backends.layers.SERVER_BLOCK_INDEX`).
    """
    import petals.server.server as server

    from dist_eval.backends import layers
    from dist_eval.backends.layers import SERVER_BLOCK_INDEX, fp8_block_size, int4_group_size

    load = server.load_pretrained_block

    @functools.wraps(load)
    def load_pretrained_block(model_name, block_index, *args, **kwargs):
        token = SERVER_BLOCK_INDEX.set(block_index)
        fp8 = _SERVER_FP8_BLOCK.set(fp8_block_size(kwargs.get("config")))
        mxfp4 = _SERVER_MXFP4.set(layers.is_mxfp4(kwargs.get("config")))
        int4 = _SERVER_INT4_GROUP.set(int4_group_size(kwargs.get("config")))
        v4 = _SERVER_V4.set(bool(getattr(kwargs.get("config"), "hyper_connections", False)))
        try:
            return load(model_name, block_index, *args, **kwargs)
        finally:
            _SERVER_V4.reset(v4)
            _SERVER_INT4_GROUP.reset(int4)
            _SERVER_MXFP4.reset(mxfp4)
            _SERVER_FP8_BLOCK.reset(fp8)
            SERVER_BLOCK_INDEX.reset(token)

    return [(server, "load_pretrained_block", load_pretrained_block), *fp8_load_replacements()]


def fp8_load_replacements() -> list:
    """The tensors of a block as petals' server reads them (``_load_state_dict_from_repo``, every file
    holding one of them), FP8 weights dequantized (:func:`dist_eval.backends.layers.dequantize_fp8`)
    by the tile the block's config says (set by :func:`server_block_replacements` around its load), INT4
    weights (:func:`dist_eval.backends.layers.dequantize_int4`) by its group size; DeepSeek-V4's FP8 tiles and FP4
    experts by :func:`dist_eval.backends.layers.dequantize_v4`, as its local layers' load hook.
    """
    import petals.server.from_pretrained as from_pretrained

    from dist_eval.backends import layers

    read = from_pretrained._load_state_dict_from_repo

    @functools.wraps(read)
    def _load_state_dict_from_repo(model_name, block_prefix, *args, **kwargs):
        tensors = read(model_name, block_prefix, *args, **kwargs)
        block = _SERVER_FP8_BLOCK.get()
        if block is not None and _SERVER_V4.get():
            layers.dequantize_v4(tensors, block, where=f"{model_name} ({block_prefix}*)")
        elif block is not None:
            layers.dequantize_fp8(tensors, block, where=f"{model_name} ({block_prefix}*)")
        if _SERVER_MXFP4.get():
            layers.dequantize_mxfp4(tensors, where=f"{model_name} ({block_prefix}*)")
        group = _SERVER_INT4_GROUP.get()
        if group is not None:
            layers.dequantize_int4(tensors, group, where=f"{model_name} ({block_prefix}*)")
        return tensors

    return [(from_pretrained, "_load_state_dict_from_repo", _load_state_dict_from_repo)]


def server_version_replacements() -> list:
    """The version a server dist_eval starts announces: petals' own, marked."""
    import petals

    version = str(petals.__version__)
    return [] if version.endswith(SERVER_VERSION_MARK) else [(petals, "__version__", version + SERVER_VERSION_MARK)]
