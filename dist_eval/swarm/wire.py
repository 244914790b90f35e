"""The server half of the wire (:mod:`dist_eval.backends.petals.wire`, the protocol and its client half): a
server dist_eval starts answers the positions a request names, and, holding block 0 of a family that embeds on
servers, looks the token ids it is sent up in its own table.
"""
from __future__ import annotations

import functools
import os
import random
from typing import Callable, Dict, Optional

import torch

from dist_eval.backends.petals.wire import POSITIONS_KEY, TOKEN_IDS_KEY, embed, embeddings_digest, read_positions

_server: Dict[str, object] = {}  # "table", "digest": this server's token embeddings (servers holding block 0)


def server_replacements(model_dir: Optional[str] = None, first_block: Optional[int] = None) -> list:
    """What makes this process's petals server answer a request naming :data:`POSITIONS_KEY`
    with those positions only, and, if it serves block 0 (``first_block``) of a family that
    embeds on servers, accept token ids (the table read from ``model_dir``). Applied by
    :func:`dist_eval.swarm.server.apply_server_patches` after the merged forward (it wraps
    the ``run_rpc_forward`` that one sets), before the server starts (its connection
    handlers, forked later, share the table).
    """
    from petals.server import handler

    if model_dir is not None and first_block == 0:
        _load_server_table(model_dir)
    connection = handler.TransformerConnectionHandler
    serialize_outputs, rpc_info, run_rpc_forward = connection._serialize_outputs, connection.rpc_info, \
        handler.run_rpc_forward

    fault = _test_fault(model_dir)

    # the one step both rpc_forward and rpc_forward_stream take with the request's metadata
    # in hand, after the blocks ran (backward and inference do not pass through it)
    def _serialize_outputs(self, hidden_states, requested_backends, metadata):
        positions = metadata.get(POSITIONS_KEY) if isinstance(metadata, dict) else None
        if positions is not None:
            hidden_states = read_positions(hidden_states, positions)
        if fault is not None:  # on what is sent (a nudge's size: the answer's own magnitude)
            hidden_states = fault(hidden_states)
        return serialize_outputs(self, hidden_states, requested_backends, metadata)

    @functools.wraps(rpc_info)  # hivemind reads the request/response types from the annotations
    async def _rpc_info(self, request, context):
        info = await rpc_info(self, request, context)
        if "digest" not in _server:
            return info
        from hivemind.proto import runtime_pb2
        from hivemind.utils import MSGPackSerializer

        result = MSGPackSerializer.loads(info.serialized_info)
        result[TOKEN_IDS_KEY] = _server["digest"]
        return runtime_pb2.ExpertInfo(serialized_info=MSGPackSerializer.dumps(result))

    async def _run_rpc_forward(*flat_tensors, args_structure=None, **kwargs):
        if "table" in _server:
            from petals.utils.packaging import unpack_args_kwargs

            args = unpack_args_kwargs(flat_tensors, args_structure)[0] if args_structure is not None else flat_tensors
            if len(args) >= 4 and not args[0].is_floating_point():  # token ids (see _request_tensors)
                flat_tensors, args_structure = _embed_on_server(*args[:4]), None
        return await run_rpc_forward(*flat_tensors, args_structure=args_structure, **kwargs)

    return [(connection, "_serialize_outputs", _serialize_outputs), (connection, "rpc_info", _rpc_info),
            (handler, "run_rpc_forward", _run_rpc_forward)]


TEST_FAULT_ENV = "DIST_EVAL_TEST_FAULT"  # tests and benchmarks only: a server that corrupts its answers


def _test_fault(model_dir: Optional[str]) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The fault ``$DIST_EVAL_TEST_FAULT`` asks of this server (the audit's tests and benchmark make a
    faulty server with it): ``nan`` (row 0 of an answer all NaN), ``shift`` (row 0 plus 1e-2),
    ``shift_all`` (every row plus 1e-2, as a wrong weight moves a whole batch), ``KIND:SHARE`` in that
    share of the answers (a seeded draw per answer); ``shift_rows:SHARE``: each row of every answer
    plus 1e-2 in that share of the rows (a draw per row); ``nudge:K``: every answer after its first K (per
    connection handler) plus 16 ulps of its dtype at its largest magnitude (a server that turns a
    little off: within the audit's prior tolerance between servers of other numerics, beyond a
    calibrated one); else None. Entries separated by ``;``; one
    written ``FOLDER=KIND[:SHARE]`` is only for servers of that model folder (servers started at once
    with one environment, each its own fault).
    """
    value = None
    for entry in filter(None, os.environ.get(TEST_FAULT_ENV, "").split(";")):
        folder, _, fault = entry.rpartition("=")
        if not folder or (model_dir is not None and os.path.realpath(folder) == os.path.realpath(model_dir)):
            value = fault
    if not value:
        return None
    kind, _, share = value.partition(":")
    if kind not in ("nan", "shift", "shift_all", "shift_rows", "nudge"):
        raise ValueError(f"${TEST_FAULT_ENV}: expected nan, shift, shift_all or shift_rows, optionally :SHARE, or "
                         f"nudge:K; got {value!r}")
    if kind == "nudge":
        return _nudge(int(share or 0))
    draw, share = random.Random(0), float(share or 1)

    def fault(hidden_states: torch.Tensor) -> torch.Tensor:
        rows = [r for r in range(hidden_states.shape[0]) if draw.random() < share] if kind == "shift_rows" else \
            ([] if draw.random() >= share else [0] if kind in ("nan", "shift") else list(range(hidden_states.shape[0])))
        if not rows:
            return hidden_states
        hidden_states = hidden_states.clone()
        hidden_states[rows] = float("nan") if kind == "nan" else hidden_states[rows] + 1e-2
        return hidden_states

    return fault


def _nudge(after: int) -> Callable[[torch.Tensor], torch.Tensor]:
    answers = [0]

    def fault(hidden_states: torch.Tensor) -> torch.Tensor:
        answers[0] += 1
        if answers[0] <= after:
            return hidden_states
        eps = torch.finfo(hidden_states.dtype if hidden_states.is_floating_point() else torch.float32).eps
        return hidden_states + 16 * eps * max(1.0, float(hidden_states.float().abs().max()))

    return fault


def _load_server_table(model_dir: str) -> None:
    from dist_eval.backends.config_json import family_of_folder
    from dist_eval.backends.petals_folder import read_tensor

    family = family_of_folder(model_dir)
    if not family.embeds_on_server:
        return
    table = read_tensor(model_dir, family.served_embeddings_key)  # as saved: looked-up rows widen to float32
    _server.update(table=table, digest=embeddings_digest(table))


def _embed_on_server(token_ids, prompts, input_prompts, digest):
    """(hidden states, prompts) of a request that sent token ids; ValueError (a failed
    request) for a table other than this server's or ids outside it.
    """
    from petals.utils.misc import is_dummy

    table = _server["table"]
    if bytes(digest.to(torch.uint8).tolist()).hex() != _server["digest"]:
        raise ValueError(f"{TOKEN_IDS_KEY}: the client's token embeddings are not this server's; send hidden states")
    if token_ids.ndim != 2 or (token_ids.numel() and not 0 <= int(token_ids.min()) <= int(token_ids.max())
                               < table.shape[0]):
        raise ValueError(f"{TOKEN_IDS_KEY}: expected token ids [rows, tokens] in [0, {table.shape[0]})")
    return embed(table, token_ids, None if is_dummy(input_prompts) else input_prompts), prompts
