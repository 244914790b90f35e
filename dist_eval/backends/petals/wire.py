"""What a forward sends to the swarm and what comes back: token ids in, read positions out.

petals' client sends the first server of a forward the embedded tokens, [rows, prompt
vectors + tokens, hidden] in float32, and every server answers with the hidden states of
every position, the size of what it was sent. On a classifier's forward most of both is
waste: the first server could look the tokens up itself, and the head reads one position
per row. Those bytes cross the transport (hivemind's p2pd daemons at both ends) and are
serialised and copied on both sides; on the CPU benchmark the daemons alone took a large
share of the machine (benchmarks/RESULTS.md). So, on a classifier's no-grad forward
(:class:`~dist_eval.backends.petals.backend.PetalsClassifier`):

1. **Read positions out.** The client names, in the request's metadata
   (:data:`POSITIONS_KEY`), one position per row for the **last** server of the chain,
   which answers [rows, 1, hidden]. Servers before the last answer whole hidden states (they
   feed the next one). A server of petals' own ignores the key and answers every position;
   the client takes the positions itself.
2. **Token ids in.** A server dist_eval starts that holds block 0 keeps the token embeddings
   (as saved, in memory shared by its connection handlers) and says so in its ``rpc_info``
   (:data:`TOKEN_IDS_KEY`: the SHA-256 of the table). The client asks each server of a
   forward's first span for that once (and hashes its own table the first time one offers
   it: nothing at start-up, nothing with others' servers); to a server whose table is the client's own, bit for
   bit, it sends the token ids [rows, tokens] (int64) and the prompt vectors [1, P, hidden]
   instead of the hidden states, and the server builds ``cat(prompts, table[ids])`` exactly
   as the client would have. Only for families whose embedding step is that lookup and
   concatenation and nothing else (``Family.embeds_on_server``; a family that normalises
   the embeddings keeps that arithmetic on the client, and sends hidden states).
3. Hidden states sent to the first server go in that server's dtype (float16 on a GPU
   server, half of float32), the conversion it would have made on arrival.
4. **Token ids beside hidden states.** DeepSeek-V4's hash-routed blocks (mlp_layer_types ``hash_moe``) choose a
   position's experts by its token id: each server whose span holds one is sent the rows' token ids [rows,
   tokens] (int64) after the hidden states and prompts (``routed_blocks``), which its merged forward hands to the
   blocks (:mod:`dist_eval.swarm.merged_forward`). A server of petals' own cannot build those blocks at all.

Every change moves values, never computes them differently: a lookup, a concatenation, a
dtype conversion the server made anyway, a choice of rows. So the logits are those of
petals' own path bit for bit (``tests/test_backends_wire.py``), whichever servers a
request meets, and a swarm that mixes dist_eval's servers with others' gives the same
results for any number of ranks. What a request carried before and after, for the GPU
benchmark's model, is computed in benchmarks/RESULTS.md.

The client half lives here (:func:`forward_over_wire`, with the protocol's keys and the lookup both halves
compute); the server half is :mod:`dist_eval.swarm.wire` (the servers dist_eval starts).
"""
from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from dist_eval.backends.petals import audit
from dist_eval.backends.petals.failover import (
    MAX_ROPE_REROUTES,
    LeftOut,
    ServerAnswerError,
    leave_out_other_rope,
    other_rope,
    server_failure,
)

POSITIONS_KEY = "dist_eval_read_positions"  # request metadata: one position per row (the last server's answer)
TOKEN_IDS_KEY = "dist_eval_token_ids"  # rpc_info: SHA-256 of the token embeddings this server looks ids up in
_PEERS_ATTR = "dist_eval_peer_wire"  # on a client's sequence manager: peer -> _PeerWire


def embeddings_digest(table: torch.Tensor) -> str:
    """SHA-256 of a token embedding table as float32 (its shape included)."""
    array = np.ascontiguousarray(table.detach().to(torch.float32).cpu().numpy())
    digest = hashlib.sha256(repr(tuple(array.shape)).encode())
    digest.update(array.data)
    return digest.hexdigest()


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


def embed(table: torch.Tensor, token_ids: torch.Tensor, prompts: Optional[torch.Tensor]) -> torch.Tensor:
    """[rows, P + tokens, hidden] in float32: ``prompts`` [1, P, hidden] (or None) before each
    row's looked-up tokens, as petals' client builds a forward's input (its table is the
    same one in float32: a 16-bit value widens to float32 exactly).
    """
    embedded = torch.nn.functional.embedding(token_ids, table).to(torch.float32)
    if prompts is None:
        return embedded
    return torch.cat([prompts.to(embedded.dtype).expand(token_ids.shape[0], -1, -1), embedded], dim=1)


class _PeerWire:
    """What the client knows of one server: the dtype it computes in, and ``digest``, the
    SHA-256 of its token embeddings where they are the client's own (else None: it is sent
    hidden states). ``own_digest`` computes the client's, and is called only when a server
    offers a table (it reads the whole table: no cost at start-up, none with others' servers).
    """

    def __init__(self, info: dict, own_digest: Optional[Callable[[], str]]):
        self.dtype = info["forward_schema"][0][0].dtype
        offered = info.get(TOKEN_IDS_KEY)
        self.digest = offered if offered is not None and own_digest is not None and offered == own_digest() else None


def forward_over_wire(hidden_states: torch.Tensor, prompts, sequence_manager, positions: torch.Tensor,
                      token_ids: Optional[torch.Tensor] = None, prompt_tokens: int = 0,
                      own_digest: Optional[Callable[[], str]] = None,
                      routed_blocks: frozenset = frozenset()) -> torch.Tensor:
    """The remote blocks' output for ``hidden_states`` [rows, prompt_tokens + tokens, hidden]
    (no grad), with only ``positions`` (one per row) filled in and zeros elsewhere.

    ``token_ids`` [rows, tokens] (the ids ``hidden_states`` embed, after ``prompt_tokens``
    prompt vectors) and ``own_digest`` (computes the digest of the client's table, once:
    cache it): sent instead of the hidden states to a first server with the same table; beside them to every
    server whose span holds one of ``routed_blocks`` (the blocks that route by token id). Requests are sized as
    :mod:`dist_eval.backends.petals.requests` says; failures go through petals' routing and
    dist_eval's failover exactly as in petals' own forward.
    """
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

    from dist_eval.backends.petals.requests import request_batches

    rows = hidden_states.shape[0]
    positions = positions.to(torch.long).cpu()
    input_batches, prompt_batches = request_batches(hidden_states, prompts, sequence_manager)
    size = input_batches[0].shape[0] if input_batches else 1
    position_batches = positions.split(size)
    id_batches = token_ids.cpu().split(size) if token_ids is not None else [None] * len(input_batches)
    _ = sequence_manager.rpc_info  # lazy init, as petals does before a forward
    if not hasattr(sequence_manager, _PEERS_ATTR):
        setattr(sequence_manager, _PEERS_ATTR, {})

    requests = [_Request(inputs, batch_prompts, ids, prompt_tokens, batch_positions, audit.caller_redoes(),
                         routed_blocks)
                for inputs, batch_prompts, ids, batch_positions in zip(input_batches, prompt_batches, id_batches,
                                                                       position_batches)]

    async def one(offset, request):
        try:
            return await _forward_chain(request, sequence_manager, own_digest)
        except audit.NonFiniteAnswer as error:  # its rows counted in this forward's
            raise error.shifted(offset, rows) from None

    async def all_requests():
        return await asyncio.gather(*(one(i * size, request) for i, request in enumerate(requests)))

    read = torch.cat(RemoteExpertWorker.run_coroutine(all_requests()), dim=0)  # [rows, 1, hidden]
    # in the caller's thread: whose answers its logits come from (audit.Redo), also with the audit off
    # (no ledger): the row store records them, so a later run that blames one of them serves none of its rows
    audit.note_taken(audit.ledger_of(sequence_manager), set().union(*(request.servers for request in requests)))
    out = torch.zeros_like(hidden_states)
    out[torch.arange(rows), positions] = read[:, 0].to(out.dtype)
    return out


class _Request:
    """One request's inputs: hidden states [rows, P + tokens, hidden], deep prompts
    [blocks, 1 or rows, P, hidden] (or a dummy), the token ids they embed (or None),
    P, and the positions the head reads.
    """

    def __init__(self, hidden_states, prompts, token_ids, prompt_tokens: int, positions: torch.Tensor,
                 redoes: bool = False, routed_blocks: frozenset = frozenset()):
        self.hidden_states, self.prompts, self.token_ids = hidden_states, prompts, token_ids
        self.routed_blocks = routed_blocks  # the blocks whose servers are sent the token ids (hash routing)
        self.prompt_tokens, self.positions = prompt_tokens, positions.tolist()
        self.redoes = redoes  # the caller evaluates the batch again if a server of it is blamed later
        self.servers: set = set()  # the servers whose answers were taken (the hidden states returned)
        self.finite_inputs: Optional[bool] = None  # whether the inputs are finite where the head's read depends on
        self.trace: Optional[list] = None  # (span, its inputs, its answer) of the route taken, while audited

    def of_rows(self, rows: Sequence[int]) -> _Request:
        """The request of ``rows`` alone (a row check), as long as the furthest position the head reads of them."""
        index = torch.tensor(list(rows), dtype=torch.long)
        length = max(self.positions[r] for r in rows) + 1
        prompts = self.prompts
        if prompts.ndim == 4 and prompts.shape[1] == len(self.positions) > 1:  # per-row deep prompts
            prompts = prompts[:, index]
        ids = None if self.token_ids is None else self.token_ids[index, : length - self.prompt_tokens]
        sub = _Request(self.hidden_states[index, :length], prompts, ids, self.prompt_tokens,
                       torch.tensor([self.positions[r] for r in rows]), self.redoes, self.routed_blocks)
        sub.finite_inputs = self.finite_inputs
        return sub


async def _forward_chain(request: _Request, manager, own_digest: Optional[Callable[[], str]]) -> torch.Tensor:
    """One request's way through every block (petals 2.2.0's ``sequential_forward``, with
    the wire changes of the module doc): [rows, 1, hidden]. A server failure
    (:func:`~dist_eval.backends.petals.failover.server_failure`) is retried elsewhere; so is a span whose
    answer has NaN or inf where its inputs had none (its server blamed, :func:`_blame_non_finite`). A
    share of the requests is then replayed on other servers and compared (:mod:`dist_eval.backends.petals.audit`).
    """
    end = len(manager.block_uids)
    inputs = request.hidden_states
    block, spans, route = 0, deque(), []
    ledger = audit.ledger_of(manager)
    request.trace = [] if ledger is not None else None
    non_finite: Dict[str, List[int]] = {}  # peer -> the rows its answer to this request had NaN or inf in
    while block < end:
        attempt, reroute, rope_reroutes = 0, False, 0
        while True:
            span = None
            try:
                if not spans or reroute:  # a new route, also after every failure
                    spans, reroute = _route(manager, block, end, request, non_finite), False
                span = spans.popleft()
                output = await _run_span(request, manager, span, inputs, own_digest)
                manager.on_request_success(span.peer_id)
            except LeftOut:  # no failure of the server's: no ban, no wait, no retry of the failures' counted
                rope_reroutes += 1
                if rope_reroutes == MAX_ROPE_REROUTES:
                    raise
                reroute = True
                continue
            except Exception as error:
                if not server_failure(error):  # the client's own error: no server to ban, no retry can help
                    raise
                manager.on_request_failure(span.peer_id if span is not None else None)
                if attempt + 1 == manager.config.max_retries:
                    raise
                await asyncio.sleep(manager.get_retry_delay(attempt))
                attempt, reroute = attempt + 1, True
                continue
            bad = _non_finite(request, span, output, end)
            if bad:  # from finite inputs: this server's, never a result; a route around it
                non_finite[str(span.peer_id)], reroute = bad, True
                continue
            if request.trace is not None:
                request.trace.append((span, inputs, output))
            inputs, block = output, span.end
            route.append(span)
            break
    request.servers = _peers(route)
    if ledger is not None:
        _blame_non_finite(ledger, non_finite, request, finite_from=route)
        try:
            return await _audit(request, manager, route, inputs, own_digest, ledger)
        finally:
            request.trace = None  # the spans' hidden states: held only while the audit may search them
    return inputs


def _non_finite(request: _Request, span, output: torch.Tensor, end: int) -> List[int]:
    """The rows of ``span``'s answer with NaN or inf where the head's read depends on them, the inputs
    there finite (else none: the client sent them, no server is at fault and the logits say so).
    """
    if request.finite_inputs is None:
        request.finite_inputs = not audit.non_finite_rows(request.hidden_states, request.positions, read=False)
    if not request.finite_inputs:
        return []
    return audit.non_finite_rows(output, request.positions, read=span.end == end)


def _blame_non_finite(ledger: audit.AuditLedger, non_finite: Dict[str, List[int]], request: _Request,
                      finite_from) -> None:
    """Blame the servers whose answers had NaN or inf where others' (``finite_from``) had numbers."""
    peers, rows = _peer_list(finite_from), len(request.positions)
    for peer, bad in non_finite.items():
        if not ledger.blame_non_finite(peer, len(bad), peers, redo=request.redoes):
            raise audit.AuditMismatch(
                f"swarm audit: server {peer} answered NaN or inf for {len(bad)} of {rows} row(s) of a request that "
                f"{', '.join(sorted(set(peers)))} answered with numbers, and answers of it were taken before this one, "
                "unchecked; stop it or leave it out of the swarm, then run again. No row of it is counted or stored.")


def _route(manager, block: int, end: int, request: Optional[_Request] = None,
           non_finite: Optional[Dict[str, List[int]]] = None) -> deque:
    """The route petals picks from ``block`` to ``end``; one around the servers the audit left out
    (:func:`~dist_eval.backends.petals.audit.exclude_if_unused`) and those that answered ``request`` NaN or
    inf (``non_finite``) where it met one of them. :class:`~dist_eval.backends.petals.audit.NonFiniteAnswer`
    where no route avoids the latter.
    """
    spans = deque(manager.make_sequence(block, end, mode="max_throughput"))  # servers of other RoPE left out first
    spans[-1].end = min(spans[-1].end, end)
    ledger = audit.ledger_of(manager)
    left_out = set(non_finite or ()) | (set(ledger.excluded) if ledger is not None else set())
    if left_out and _peers(spans) & left_out:
        around = audit.disjoint_route(manager, left_out, end, None, start=block)
        if around is not None:
            spans = deque(around)
        elif non_finite:  # every route tried for these blocks answered NaN or inf
            raise audit.NonFiniteAnswer([r for rows in non_finite.values() for r in rows], non_finite,
                                        len(request.positions))
        # else petals' (a block only left-out servers serve: its failure says so)
    return spans


async def _run_span(request: _Request, manager, span, inputs: torch.Tensor,
                    own_digest: Optional[Callable[[], str]]) -> torch.Tensor:
    """``span``'s server's answer to ``inputs`` (the request's, for block 0): the next span's inputs,
    or, from the last span, the read positions.
    """
    from hivemind.utils import MSGPackSerializer
    from petals.client.remote_forward_backward import run_remote_forward
    from petals.data_structures import CHAIN_DELIMITER
    from petals.server.handler import TransformerConnectionHandler
    from petals.utils.packaging import pack_args_kwargs

    if other_rope(manager, span.server_info):  # announced since its route was made: out, and a route around it
        leave_out_other_rope(manager)
        raise LeftOut(f"server {span.peer_id} announces other RoPE settings than the client's config.json")
    stub = TransformerConnectionHandler.get_stub(manager.state.p2p, span.peer_id)
    span_prompts = request.prompts[span.start : span.end]
    if span.start == 0:
        peer = await _peer_wire(manager, stub, span.peer_id, own_digest)
        tensors = _request_tensors(request, span_prompts, peer)
    else:
        tensors = (inputs, span_prompts)
    if len(tensors) == 2 and request.routed_blocks & set(range(span.start, span.end)):
        tensors = (*tensors, _routing_ids(request, tensors[0]))
    flat_tensors, args_structure = pack_args_kwargs(*tensors)
    uids = CHAIN_DELIMITER.join(manager.block_uids[span.start : span.end])
    metadata = manager.get_request_metadata("rpc_forward", args_structure, uids, *flat_tensors)
    last = span.end == len(manager.block_uids)
    if last:
        metadata[POSITIONS_KEY] = request.positions
    outputs = await run_remote_forward(uids, stub, manager.rpc_info, *flat_tensors,
                                       config=manager.config, metadata=MSGPackSerializer.dumps(metadata))
    return _check_answer(outputs, request.hidden_states.shape, request.positions if last else None)


async def _replay(request: _Request, manager, spans, own_digest, ledger: audit.AuditLedger,
                  answered: Sequence, trace: Optional[list] = None) -> Optional[torch.Tensor]:
    """The request through ``spans`` once, no retry; None when one of their servers fails, or answers
    NaN or inf where ``answered`` (the route that answered the request) gave numbers (it is blamed).
    ``trace`` gets (span, its inputs, its answer) of each span.
    """
    inputs, end = request.hidden_states, len(manager.block_uids)
    ledger.sent(len(request.positions), inputs.shape[1])
    try:
        for span in spans:
            output = await _run_span(request, manager, span, inputs, own_digest)
            bad = _non_finite(request, span, output, end)
            if bad:
                _blame_non_finite(ledger, {str(span.peer_id): bad}, request, answered)
                return None
            if trace is not None:
                trace.append((span, inputs, output))
            inputs = output
    except Exception as error:
        if not server_failure(error):
            raise
        return None
    return inputs


async def _elsewhere(request: _Request, manager, avoid: set, own_digest, ledger: audit.AuditLedger,
                     answered: Sequence):
    """(route, its answer, its spans' trace) for the request on servers outside ``avoid`` and those left
    out; (route or None, None, trace) where none answers. A server that answers NaN or inf is left out
    and another route tried.
    """
    end = len(manager.block_uids)
    while True:
        excluded, trace = len(ledger.excluded), []
        spans = audit.disjoint_route(manager, avoid | set(ledger.excluded), end, ledger)
        answer = None if spans is None else await _replay(request, manager, spans, own_digest, ledger, answered, trace)
        if answer is not None or spans is None or len(ledger.excluded) == excluded:
            return spans, answer, trace


def _peers(spans) -> set:
    return set(_peer_list(spans))


def _peer_list(spans) -> list:
    """The servers of ``spans`` by peer id, in route order (how the ledger names them)."""
    return [str(s.peer_id) for s in spans]


async def _audit(request: _Request, manager, route: list, answer: torch.Tensor, own_digest,
                 ledger: audit.AuditLedger) -> torch.Tensor:
    """What the ledger picks of the request replayed on servers outside ``route`` and compared: its drawn
    rows (a row check; beyond its tolerance, the whole request), or the whole request (a join probe, or
    every row drawn).
    """
    peers = _peer_list(route)
    reason, drawn = ledger.pick(audit.row_digests(request.token_ids, request.hidden_states, request.positions,
                                                  request.prompt_tokens), peers, request.hidden_states.shape[1])
    if reason is None:
        ledger.taken_unchecked(peers)
        return answer
    if reason == "rows" and await _rows_agree(request, manager, route, answer, drawn, own_digest, ledger):
        return answer
    return await _replay_whole(request, manager, route, answer, own_digest, ledger)


async def _rows_agree(request: _Request, manager, route: list, answer: torch.Tensor, drawn: List[int], own_digest,
                      ledger: audit.AuditLedger) -> bool:
    """A row check: the ``drawn`` rows alone on servers outside ``route``, within
    :func:`~dist_eval.backends.petals.audit.rows_tolerance` of the answer's rows (True; also where no replay
    answered: the request stands unchecked). False: the request is to be replayed whole.
    """
    peers = _peer_list(route)
    other, replayed, _ = await _elsewhere(request.of_rows(drawn), manager, set(peers), own_digest, ledger, route)
    if replayed is None:
        ledger.taken_unchecked(peers, replay_failed=other is not None)
        return True
    mine = answer[torch.tensor(drawn, dtype=torch.long)]
    if audit.agree(mine, replayed, audit.rows_tolerance([*route, *other], mine)):
        ledger.record_rows(peers, len(drawn), audit.difference(mine, replayed))
        ledger.taken_unchecked(peers)  # its other rows
        return True
    with ledger.lock:
        ledger.escalated += 1
    return False


async def _replay_whole(request: _Request, manager, route: list, answer: torch.Tensor, own_digest,
                        ledger: audit.AuditLedger) -> torch.Tensor:
    """The request replayed on servers outside ``route`` and compared; on a disagreement, a third route
    outside both settles who is outvoted (an outvoted route of several servers: its spans searched,
    :func:`_span_at_fault`); the outvoted server is left out, or the run stops.
    """
    peers, rows = _peer_list(route), len(request.positions)
    other, replayed, other_trace = await _elsewhere(request, manager, set(peers), own_digest, ledger, route)
    if replayed is None:
        ledger.taken_unchecked(peers, replay_failed=other is not None)
        return answer
    # only agreements between servers of other numerics calibrate their tolerance (audit.tolerance)
    ulp = None if audit.same_numerics([*route, *other]) else audit.unit([*route, *other], answer)
    bound = audit.tolerance([*route, *other], answer, ledger)
    if audit.agree(answer, replayed, bound):
        ledger.record(peers, rows, audit.difference(answer, replayed), bound, ulp)
        return answer
    third, agrees_with = await _third_route(request, manager, route, other, answer, replayed, own_digest, ledger)
    found = None
    if agrees_with in ("first", "second"):
        faulty, trace = (other, other_trace) if agrees_with == "first" else (route, request.trace)
        if len(_peers(faulty)) > 1:
            found = await _span_at_fault(request, manager, trace, own_digest, ledger)
    gap = audit.difference(answer, replayed)
    stands = audit.exclude_if_unused(ledger, rows, route, other, gap, third, agrees_with, redo=request.redoes,
                                     found=found)
    if stands is not None:  # the outvoted server left out (its answers taken before redone): the majority's stands
        ledger.record(_peer_list(route if stands == "first" else other), rows, 0.0, None)
        if stands == "second":
            request.servers = _peers(other)
        return answer if stands == "first" else replayed
    raise audit.mismatch(ledger, rows, route, other, gap, third, agrees_with)


async def _third_route(request: _Request, manager, route: list, other: list, answer: torch.Tensor,
                       replayed: torch.Tensor, own_digest, ledger: audit.AuditLedger) -> tuple:
    """(a third route outside both, which answer it agrees with: "first", "second", None (neither) or
    "both"); (None, None) where no third answers. Each answer is compared with the third's within the
    tolerance of its own route and the third's: a third of coarser numerics than both (bfloat16
    against two float32 routes) may agree with both, and settles nothing; then another third is
    tried, outside it too.
    """
    avoid, both = set(map(str, (s.peer_id for s in [*route, *other]))), None
    while True:
        third, settled, _ = await _elsewhere(request, manager, avoid, own_digest, ledger, route)
        if settled is None:
            return (both, "both") if both is not None else (None, None)
        first = audit.agree(answer, settled, audit.tolerance([*route, *third], answer, ledger))
        second = audit.agree(replayed, settled, audit.tolerance([*other, *third], replayed, ledger))
        if first != second or not first:
            return third, "first" if first else "second" if second else None
        both = third
        avoid |= _peers(third)


async def _span_at_fault(request: _Request, manager, trace: Optional[list], own_digest,
                         ledger: audit.AuditLedger) -> Optional[dict]:
    """An outvoted route of several servers, searched span by span: each span's inputs (as its route
    gave them) replayed on other holders of its blocks. The first span whose answer one other holder
    contradicts and a second confirms names its server (the evidence for
    :func:`~dist_eval.backends.petals.audit.exclude_if_unused`); None where no two others agree against one.
    """
    for span, inputs, output in trace or ():
        peer = str(span.peer_id)
        first = await _span_elsewhere(request, manager, span, inputs, {peer}, own_digest, ledger)
        if first is None:
            return None
        if audit.agree(output, first[1], audit.tolerance([span, *first[0]], output, ledger)):
            continue  # this span's answer is confirmed: the fault is further on
        second = await _span_elsewhere(request, manager, span, inputs, {peer} | _peers(first[0]), own_digest, ledger)
        if second is None or not audit.agree(first[1], second[1], audit.tolerance([*first[0], *second[0]], first[1],
                                                                                   ledger)):
            return None
        return {"peer": peer, "blocks": f"{span.start}:{span.end}", "outvoted_by": _peers(first[0]) | _peers(second[0])}
    return None


async def _span_elsewhere(request: _Request, manager, span, inputs: torch.Tensor, avoid: set, own_digest,
                          ledger: audit.AuditLedger):
    """(route, answer) of ``span``'s blocks for ``inputs`` on servers outside ``avoid`` and those left out;
    None where no such route answers.
    """
    spans = audit.disjoint_route(manager, avoid | set(ledger.excluded), span.end, None, start=span.start)
    if spans is None:
        return None
    ledger.sent(len(request.positions), inputs.shape[1])
    output = inputs
    try:
        for step in spans:
            output = await _run_span(request, manager, step, output, own_digest)
    except Exception as error:
        if not server_failure(error):
            raise
        return None
    return spans, output


async def _peer_wire(manager, stub, peer_id, own_digest: Optional[Callable[[], str]]) -> _PeerWire:
    """The server's :class:`_PeerWire`, asked once per client (its ``rpc_info``)."""
    known: Dict[object, _PeerWire] = getattr(manager, _PEERS_ATTR)
    if peer_id not in known:
        from hivemind.proto import runtime_pb2
        from hivemind.utils import MSGPackSerializer

        answer = await stub.rpc_info(runtime_pb2.ExpertUID(uid=manager.block_uids[0]),
                                     timeout=manager.config.request_timeout)
        known[peer_id] = _PeerWire(MSGPackSerializer.loads(answer.serialized_info), own_digest)
    return known[peer_id]


def _request_tensors(request: _Request, span_prompts, peer: _PeerWire) -> tuple:
    """The tensors of a first server's request: (token ids, deep prompts, prompt vectors
    [1, P, hidden] or a dummy, the table's digest as 32 bytes) to a server that looks
    the ids up in the client's table; else (hidden states, deep prompts) in its dtype.
    """
    from petals.utils.misc import DUMMY, is_dummy

    # in the server's dtype: it converts whatever comes to it, and a value once converted
    # converts to itself (the prompt vectors, put before float32 embeddings there, too)
    prompts = span_prompts if is_dummy(span_prompts) else span_prompts.to(peer.dtype)
    if peer.digest is not None and request.token_ids is not None:
        rows, tokens = request.token_ids.shape
        assert request.hidden_states.shape[:2] == (rows, request.prompt_tokens + tokens)
        vectors = request.hidden_states[:1, : request.prompt_tokens].to(peer.dtype) if request.prompt_tokens else DUMMY
        digest = torch.tensor(list(bytes.fromhex(peer.digest)), dtype=torch.uint8)
        return request.token_ids.to(torch.int64), prompts, vectors, digest
    return request.hidden_states.to(peer.dtype), prompts


def _routing_ids(request: _Request, hidden_states: torch.Tensor) -> torch.Tensor:
    """The token ids [rows, positions] a span of hash-routed blocks is sent beside ``hidden_states``: one per position
    (no prompt positions: ptune is refused on such models, Family.prompts_refusal).
    """
    ids = request.token_ids
    if ids is None or request.prompt_tokens or tuple(ids.shape) != tuple(hidden_states.shape[:2]):
        shown = "none" if ids is None else f"{list(ids.shape)} after {request.prompt_tokens} prompt positions"
        raise ValueError(f"blocks {sorted(request.routed_blocks)} route each position by its token id: expected "
                         f"token ids of shape {list(hidden_states.shape[:2])}, got {shown}")
    return ids.to(torch.int64)


def _check_answer(outputs, sent_shape: Sequence[int], wanted: Optional[List[int]]) -> torch.Tensor:
    """A server's answer as the next step needs it: the whole hidden states from a server
    before the last; from the last, the positions ``wanted`` (taken here from a server
    that answered every position). A ServerAnswerError (a failed request) for any other shape.
    """
    rows, length, hidden = sent_shape
    if isinstance(outputs, (tuple, list)) and len(outputs) == 1:  # run_remote_forward's answer: one tensor
        outputs = outputs[0]
    if not isinstance(outputs, torch.Tensor):
        raise ServerAnswerError(f"a server answered a forward with {type(outputs).__name__}, not a tensor")
    shape = tuple(outputs.shape)
    if wanted is not None and shape == (rows, 1, hidden):
        return outputs
    if shape == (rows, length, hidden):
        return outputs if wanted is None else read_positions(outputs, wanted)
    expected = f"[{rows}, {length}, {hidden}]" + (f" or [{rows}, 1, {hidden}]" if wanted is not None else "")
    raise ServerAnswerError(f"a server answered a forward with shape {list(shape)}, expected {expected}")
