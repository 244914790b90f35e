"""The last server of a forward returns only the positions the classifier head reads.

A classifier reads one position of each row's final hidden states (the row's last token,
:meth:`~dist_eval.backends.families.Family.last_token_index`), yet petals' servers answer
every forward with every position: [rows, prompt vectors + tokens, hidden], the size of
what was sent. That answer crosses the transport (hivemind's p2pd daemons, both ends) and
is serialised and copied on both sides, for one position in ~40 that anyone reads. Here
the client asks the **last** server of the chain for those positions only (a list in
the request's metadata, under :data:`POSITIONS_KEY`), and that server answers
[rows, 1, hidden]. Servers before the last answer whole hidden states, as they feed the next one.

Both halves of this small protocol live here:

- server: :func:`install_server`, applied to the servers dist_eval starts
  (:mod:`dist_eval.swarm.server`): the answer of a request that names positions is
  those rows' positions, taken just before serialisation;
- client: :func:`forward_reading`, which :class:`~dist_eval.backends.petals.PetalsClassifier`
  uses for its no-grad forwards. A server that does not know the key (petals' own
  ``run_server``, another version) ignores it and answers every position; the client
  then takes the positions itself. Either way the values are the server's own, bit for
  bit: taking some rows of a tensor copies them.

The client hands petals' model code a tensor of the usual shape, zeros except at the
read positions. Everything after the blocks (prompt removal, final norm, head, pooling)
works row by row, so the positions read get exactly the values they had before: the
logits are unchanged bit for bit (``tests/test_backends_readout.py``).

Measured on the CPU benchmark (benchmarks/RESULTS.md) and, in size, for issue 13's GPU
model (64 rows of 40 tokens + 16 prompt vectors, hidden 2048, fp16): a one-hop answer
of 14.7 MB becomes 0.26 MB.
"""
from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import List, Optional, Sequence

import torch

POSITIONS_KEY = "dist_eval_read_positions"  # request metadata: one position per row, or absent


# ---------------------------------------------------------------- server half


def read_positions(hidden_states: torch.Tensor, positions) -> torch.Tensor:
    """``hidden_states`` [rows, length, hidden] at one position per row -> [rows, 1, hidden].
    ValueError (the request fails, with this message) for positions that do not fit.
    """
    rows, length = hidden_states.shape[:2]
    if (not isinstance(positions, (list, tuple)) or len(positions) != rows
            or not all(isinstance(p, int) and 0 <= p < length for p in positions)):
        shown = positions if not isinstance(positions, (list, tuple)) else f"{len(positions)} values"
        raise ValueError(f"{POSITIONS_KEY}: expected {rows} positions in [0, {length}), one per row; got {shown}")
    return hidden_states[torch.arange(rows), torch.tensor(positions, dtype=torch.long)].unsqueeze(1)


_installed = False


def install_server() -> None:
    """Make this process's petals server answer a forward request that names
    :data:`POSITIONS_KEY` with those positions only (idempotent). Call after
    :func:`dist_eval.backends.compat.import_petals`, before the server starts.
    """
    global _installed
    if _installed:
        return
    from petals.server.handler import TransformerConnectionHandler

    serialize_outputs = TransformerConnectionHandler._serialize_outputs

    # the one step that both rpc_forward and rpc_forward_stream take with the request's
    # metadata in hand, after the blocks ran (backward and inference do not pass through it)
    def _serialize_outputs(self, hidden_states, requested_backends, metadata):
        positions = metadata.get(POSITIONS_KEY) if isinstance(metadata, dict) else None
        if positions is not None:
            hidden_states = read_positions(hidden_states, positions)
        return serialize_outputs(self, hidden_states, requested_backends, metadata)

    TransformerConnectionHandler._serialize_outputs = _serialize_outputs
    _installed = True


# ---------------------------------------------------------------- client half


def forward_reading(hidden_states: torch.Tensor, prompts, sequence_manager, positions: torch.Tensor) -> torch.Tensor:
    """The remote blocks' output for ``hidden_states`` [rows, length, hidden] (no grad), with
    only ``positions`` (one per row) filled in and zeros elsewhere. Requests are sized as
    :mod:`dist_eval.backends.requests` says; failures go through petals' routing and
    dist_eval's failover exactly as in petals' own forward.
    """
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

    from dist_eval.backends.requests import request_batches

    rows = hidden_states.shape[0]
    positions = positions.to(torch.long).cpu()
    input_batches, prompt_batches = request_batches(hidden_states, prompts, sequence_manager)
    position_batches = positions.split(input_batches[0].shape[0]) if input_batches else []
    _ = sequence_manager.rpc_info  # lazy init, as petals does before a forward

    async def all_requests():
        return await asyncio.gather(*(
            _forward_chain(inputs, batch_prompts, sequence_manager, batch_positions)
            for inputs, batch_prompts, batch_positions in zip(input_batches, prompt_batches, position_batches)
        ))

    read = torch.cat(RemoteExpertWorker.run_coroutine(all_requests()), dim=0)  # [rows, 1, hidden]
    out = torch.zeros_like(hidden_states)
    out[torch.arange(rows), positions] = read[:, 0].to(out.dtype)
    return out


async def _forward_chain(inputs: torch.Tensor, prompts: torch.Tensor, manager, positions: torch.Tensor):
    """One request's way through every block (petals 2.2.0's ``sequential_forward``, with
    the positions asked of the last server): [rows, 1, hidden].
    """
    from hivemind import MSGPackSerializer
    from petals.client.remote_forward_backward import run_remote_forward
    from petals.data_structures import CHAIN_DELIMITER
    from petals.server.handler import TransformerConnectionHandler
    from petals.utils.packaging import pack_args_kwargs

    end = len(manager.block_uids)
    wanted = positions.tolist()
    block, spans = 0, deque()
    while block < end:
        for attempt in itertools.count():
            span = None
            try:
                if not spans or attempt >= 1:  # a new route, also after every failure
                    spans = deque(manager.make_sequence(block, end, mode="max_throughput"))
                    spans[-1].end = min(spans[-1].end, end)
                span = spans.popleft()
                stub = TransformerConnectionHandler.get_stub(manager.state.p2p, span.peer_id)
                flat_tensors, args_structure = pack_args_kwargs(inputs, prompts[span.start : span.end])
                uids = CHAIN_DELIMITER.join(manager.block_uids[span.start : span.end])
                metadata = manager.get_request_metadata("rpc_forward", args_structure, uids, *flat_tensors)
                last = span.end == end
                if last:
                    metadata[POSITIONS_KEY] = wanted
                (outputs,) = await run_remote_forward(uids, stub, manager.rpc_info, *flat_tensors,
                                                      config=manager.config,
                                                      metadata=MSGPackSerializer.dumps(metadata))
                outputs = _check_answer(outputs, inputs.shape, wanted if last else None)
                inputs, block = outputs, span.end
                manager.on_request_success(span.peer_id)
                break
            except Exception:
                manager.on_request_failure(span.peer_id if span is not None else None)
                if attempt + 1 == manager.config.max_retries:
                    raise
                await asyncio.sleep(manager.get_retry_delay(attempt))
    return inputs


def _check_answer(outputs, sent_shape: Sequence[int], wanted: Optional[List[int]]) -> torch.Tensor:
    """A server's answer as the next step needs it: the whole hidden states from a server
    before the last; from the last, the positions ``wanted`` (taken here from a server
    that answered every position). A RuntimeError (a failed request) for any other shape.
    """
    rows, length, hidden = sent_shape
    if not isinstance(outputs, torch.Tensor):
        raise RuntimeError(f"a server answered a forward with {type(outputs).__name__}, not a tensor")
    shape = tuple(outputs.shape)
    if wanted is not None and shape == (rows, 1, hidden):
        return outputs
    if shape == (rows, length, hidden):
        return outputs if wanted is None else read_positions(outputs, wanted)
    expected = f"[{rows}, {length}, {hidden}]" + (f" or [{rows}, 1, {hidden}]" if wanted is not None else "")
    raise RuntimeError(f"a server answered a forward with shape {list(shape)}, expected {expected}")
