"""A server's forward request through all its requested blocks as one task of its runtime.

petals 2.2's server runs a forward request (``rpc_forward``, ``rpc_forward_stream``)
block by block: every block is a task of that block's own pool, so for every block the
hidden states travel from the connection-handler process to the runtime (a queue and a
shared-memory copy), onto the device, back to the CPU into new shared memory, and back
to the handler, which then submits the next block. With B blocks a request pays that B
times, and on a GPU the activations cross the PCIe bus 2B times. For inference petals
already runs all of a server's blocks as one task (``merge_inference_pools_inplace``);
this does the same for forward: one task per request, its blocks run one after another
in the runtime, the hidden states moved once each way.

The arithmetic is unchanged: the same ``backend.forward`` of each block on the same
values, in the same order, with the prompts (deep prompt tuning) added between blocks as
before, so the outputs are bitwise those of petals' own path (a CPU server computes even
the prompt addition on the same device as before). A request larger than the servers'
``--max_batch_size`` gets petals' own "Task size greater than max_batch_size" error.
Backward (a training client's request) keeps petals' per-block pools. One trade-off: a
forward request now holds the runtime for all its blocks, so an inference step (a
generating client of a shared swarm) waits for the whole request, not for one block.

Applied by :func:`dist_eval.swarm.server.apply_server_patches` (:func:`replacements`), i.e. to the servers that
dist_eval starts (``LocalSwarm``, ``python -m dist_eval.swarm``,
``launch/start_server.sh``), before petals builds its blocks.
"""
from __future__ import annotations

from typing import Dict, Tuple

MERGED_POOL = "dist_eval_merged_forward_pool"  # the attribute each backend of a server shares


class MergedForwardStep:
    """The runtime's function of the merged pool: (hidden states, adapter, block uids,
    a tuple of one prompt per block, the rows' token ids or None) -> (hidden states after those blocks,).

    The prompts come in a tuple, which the pool leaves where it is (it moves top-level
    tensors only): each goes to the device just before its block, as petals' per-block
    path held one block's prompts on the device at a time (deep prompts are expanded to
    the batch: B blocks of them at once could be large on a GPU). The token ids [rows, positions]
    (DeepSeek-V4's hash-routed blocks route each position by its token id) are the blocks'
    :data:`dist_eval.backends.layers.ROW_TOKEN_IDS` while they run (in the runtime's thread).
    """

    def __init__(self, backends: Dict[str, object]):
        self.backends = backends

    def __call__(self, hidden_states, active_adapter: str, uids: Tuple[str, ...], prompts: tuple, token_ids=None):
        import torch
        from petals.utils.misc import is_dummy

        from dist_eval.backends.layers import ROW_TOKEN_IDS

        routed = ROW_TOKEN_IDS.set(token_ids)
        try:
            with torch.no_grad():  # as each block's forward runs in petals' path
                for uid, prompt in zip(uids, prompts):
                    if not is_dummy(prompt):
                        hidden_states[:, : prompt.shape[1]] += prompt.to(hidden_states.device)
                    (hidden_states,) = self.backends[uid].forward(hidden_states, active_adapter)
        finally:
            ROW_TOKEN_IDS.reset(routed)
        return (hidden_states,)


def request_token_ids(extra: tuple, hidden_states):
    """The token ids a forward request carries after its hidden states and prompts (DeepSeek-V4's hash routing:
    ``backends.petals.wire``), [rows, positions] int64, or None when it carries none; ValueError (a failed request) for
    ids that do not match the hidden states.
    """
    import torch
    from petals.utils.misc import is_dummy

    if not extra or extra[0] is None or is_dummy(extra[0]):
        return None
    token_ids = extra[0]
    if token_ids.is_floating_point() or tuple(token_ids.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(f"a forward's token ids (after its hidden states and prompts): expected integers of shape "
                         f"{list(hidden_states.shape[:2])} (rows, positions), got {token_ids.dtype} "
                         f"{list(token_ids.shape)}")
    return token_ids.to(torch.int64)


def _attach_merged_pool(backends: Dict[str, object]) -> None:
    from petals.server.task_pool import PrioritizedTaskPool

    first = next(iter(backends.values())).forward_pool
    pool = PrioritizedTaskPool(
        MergedForwardStep(backends), max_batch_size=first.max_batch_size, device=first.device, name="merged_forward"
    )
    for backend in backends.values():
        setattr(backend, MERGED_POOL, pool)


async def _run_rpc_forward_merged(*flat_tensors, requested_backends, active_adapter: str = "", prioritizer,
                                  points: int = 0, args_structure=None):
    """The same as petals' ``run_rpc_forward`` (arguments, result), as one task of the merged pool; the token ids a
    request carries after its prompts (:func:`request_token_ids`) go with it.
    """
    import torch
    from petals.utils.misc import DUMMY, is_dummy
    from petals.utils.packaging import unpack_args_kwargs

    pool = getattr(requested_backends[0], MERGED_POOL, None)
    if pool is None or any(getattr(b, MERGED_POOL, None) is not pool for b in requested_backends):
        return await _original["run_rpc_forward"](
            *flat_tensors, requested_backends=requested_backends, active_adapter=active_adapter,
            prioritizer=prioritizer, points=points, args_structure=args_structure,
        )  # fmt: skip
    if args_structure is not None:
        flat_tensors, _ = unpack_args_kwargs(flat_tensors, args_structure)
    hidden_states, prompts, *extra = flat_tensors
    dtype = requested_backends[0].dtype
    hidden_states = hidden_states.to(dtype)
    assert hidden_states.ndim == 3
    token_ids = request_token_ids(tuple(extra), hidden_states)
    if prompts is None or is_dummy(prompts):
        prompts = [DUMMY] * len(requested_backends)
    else:
        prompts = [p.squeeze(0) for p in prompts.to(dtype).split(1, dim=0)]
    priority = prioritizer.prioritize(hidden_states, points=points, backend=requested_backends[0], type="forward")
    uids = tuple(backend.name for backend in requested_backends)
    (hidden_states,) = await pool.submit_task(hidden_states, active_adapter, uids, tuple(prompts), token_ids,
                                              priority=priority)
    assert isinstance(hidden_states, torch.Tensor) and hidden_states.ndim == 3
    return hidden_states


_original: Dict[str, object] = {}


def replacements() -> list:
    """What makes this process's petals server run each forward request as one task: petals'
    ``run_rpc_forward`` and the pool set-up it needs. Applied first of the server patches, by
    :func:`dist_eval.swarm.server.apply_server_patches`, before the server starts.
    """
    import petals.server.handler as handler
    import petals.server.server as server
    from petals.server.backend import TransformerBackend

    _original.update(
        run_rpc_forward=handler.run_rpc_forward,
        merge_inference_pools_inplace=server.merge_inference_pools_inplace,
        get_pools=TransformerBackend.get_pools,
        shutdown=TransformerBackend.shutdown,
    )

    def merge_pools_inplace(backends) -> None:
        _original["merge_inference_pools_inplace"](backends)
        _attach_merged_pool(backends)

    def get_pools(self):
        pools = _original["get_pools"](self)
        merged = getattr(self, MERGED_POOL, None)
        return (*pools, merged) if merged is not None else pools  # the runtime drops the repeats

    def shutdown(self) -> None:
        setattr(self, MERGED_POOL, None)  # pool -> step -> backends -> pool: break it, as petals does for its pools
        _original["shutdown"](self)

    return [(server, "merge_inference_pools_inplace", merge_pools_inplace),
            (TransformerBackend, "get_pools", get_pools), (TransformerBackend, "shutdown", shutdown),
            (handler, "run_rpc_forward", _run_rpc_forward_merged)]
