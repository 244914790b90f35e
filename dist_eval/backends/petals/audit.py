"""The swarm audit (issue 49): a share of the forwards replayed on servers that did not compute them.

A server's answer moves the logits without a word when its weights are another revision, its
dtype or quantization another, its hardware faulty; petals checks only an answer's shape. So a
client of dist_eval replays, on a route of other servers:

- a seeded share of the rows of its requests (``--audit SHARE``, API ``audit=``), each row drawn by a
  hash of its content (its tokens up to the position the head reads) and the seed: the same rows for
  any number of ranks and any batch size. A request with rows drawn sends those rows alone (a row
  check: a 64-row request with one row drawn costs a 64th of it again), as long as the furthest
  position the head reads of them; a request with every row drawn is replayed whole;
- the first request through each server it has not seen yet (a join probe), whole, when the share
  is above 0, so a misconfigured server is caught on its first batch.

A row check's rows, computed in another batch, may differ in their last bits (other kernels for
another shape): they must agree within :func:`rows_tolerance` (64 ulps of the coarsest dtype at the
answer's magnitude); beyond it the request is replayed whole, and that replay decides. A whole
replay (the same composition) must agree with the answer within :func:`tolerance`: where every
server of both routes announces the same numerics (petals version, dtype, quantization, adapters)
and the same kernels (:func:`kernels`: dist_eval's servers announce them), bit for bit; the same
numerics but other kernels, or a server that does not announce them (petals' own run_server), 4 ulps
of that dtype at the answer's magnitude: honest servers on another CPU's vector instructions (AVX2
against AVX-512: measured), another GPU or another thread count differ in their last bits; where they
announce other numerics,
64 ulps of the coarsest dtype at first, then calibrated on the honest agreement between such servers
seen in the run (stated in the report). Replays go to the servers of the finest numerics available.
A disagreement is settled by a third route avoiding both (where the swarm has one), each answer
compared with it within the tolerance of its own route and the third's (a third of coarser numerics
that agrees with both settles nothing: another is tried): the route the other two outvote is named;
where it holds several servers, its spans are replayed one at a time, each on the inputs that route
gave it, on other holders of its blocks, and the server of the first span that one other holder
contradicts and a second confirms is blamed (dist_eval.backends.petals.wire's span search). A blamed server
is left out of every route from then on, the majority's answer stands, and the run goes on
(``excluded`` in the report, with the evidence); every batch whose answers it gave before,
unchecked, is evaluated again on the others (:class:`Redo`, in the forward loop): also on the other
ranks (after the loop, the ranks share their blames: dist_eval.predict.redo_blamed_on_other_ranks),
in the earlier rounds of a run that stops early, the batches a resume folder held and the rows the
row store served (each records its servers: dist_eval.predict.ShardLoop.stored_due), so the results
come from unblamed servers only and every row counts once.
The run stops with :class:`AuditMismatch` (one line naming the servers and the difference) before
any row of the request is counted or stored where no verdict is possible (no third route; a third
that agrees with neither, or every third with both; an outvoted route of several servers whose
spans no two others settle), or where no route of unblamed servers is left to evaluate a batch
again (or a caller other than the forward loop took its answers). A block no other server holds
cannot be audited disjointly: counted as a coverage gap in the report (``run.swarm.audit``).

An answer with NaN or inf where the head's read depends on it, from finite inputs, is never a
result: the request is retried on a route around its server, which is blamed as above; a row
NaN on every route stops the run naming the rows and servers (:class:`NonFiniteAnswer`).

What it does not prove: servers that collude (every holder of a block returning the same wrong
numbers) agree; a fault in a share f of one server's answers goes unseen with probability
(1 - f) ** (its answers checked), where a wrong answer is wrong in the rows checked (a wrong weight
or kernel moves every row of a batch): the report gives it per server, for f = 1 and f = 0.1; a
fault in one row of an answer is seen only where that row is drawn (the share, per row).
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

AUDIT_ATTR = "dist_eval_audit"  # on a client's sequence manager: its AuditLedger


class AuditMismatch(RuntimeError):
    """Two routes of servers gave different hidden states for one request: no row of it is counted."""


class NonFiniteAnswer(RuntimeError):
    """Servers answered NaN or inf for rows of a request on every route tried (none is counted or stored)."""

    def __init__(self, rows: Sequence[int], servers: Dict[str, List[int]], forward_rows: int, where: str = ""):
        self.rows, self.servers, self.forward_rows = sorted(set(rows)), servers, forward_rows
        shown = ", ".join(str(r) for r in self.rows[:8]) + (f" and {len(self.rows) - 8} more" if len(self.rows) > 8
                                                             else "")
        super().__init__(
            f"the swarm returned NaN or inf hidden states for {len(self.rows)} row(s) ({where or 'of a forward, '}rows "
            f"{shown}) on every route tried: servers {', '.join(sorted(servers))}; none of them is counted or "
            "stored. A server in float16 can overflow: serve the blocks in bfloat16 or float32 (python -m "
            "dist_eval.swarm --torch-dtype), or stop the servers named.")

    def shifted(self, offset: int, forward_rows: int) -> NonFiniteAnswer:
        """The same, its rows counted in a forward of ``forward_rows`` rows, the request's first at ``offset``."""
        return NonFiniteAnswer([offset + r for r in self.rows], self.servers, forward_rows)

    def in_batch(self, batch_id: int, rows: Sequence[int]) -> NonFiniteAnswer:
        """The same, naming the dataset's ``rows`` of batch ``batch_id`` (where the forward was that batch's)."""
        if self.forward_rows != len(rows):
            return self
        return NonFiniteAnswer([int(rows[r]) for r in self.rows], self.servers, self.forward_rows,
                               where=f"batch {batch_id}, ")


def non_finite_rows(output: torch.Tensor, positions: Sequence[int], read: bool) -> List[int]:
    """The rows of a server's answer with NaN or inf where the head's read depends on it: the read
    position (``read``: the last server's answer, [rows, 1, hidden]), else every position up to it
    (the blocks are causal: a later position, padding, never reaches the read one).
    """
    finite = torch.isfinite(output).all(dim=-1)  # [rows, positions]
    if not read:
        upto = torch.arange(output.shape[1])[None, :] <= torch.tensor(list(positions))[:, None]
        finite = finite | ~upto
    return [int(r) for r in torch.nonzero(~finite.all(dim=1)).flatten()]


@dataclass
class ServerAudit:
    """One server's part in the audit: the requests and rows of its answers replayed elsewhere."""

    computed: int = 0  # requests whose answer it computed (a span of)
    batches: int = 0  # of those, replayed whole on servers other than it, and equal
    row_checks: int = 0  # of those, some rows replayed on servers other than it, and equal
    rows: int = 0  # rows of its answers replayed elsewhere and equal (whole or in row checks)
    mismatches: int = 0
    unchecked: int = 0  # of those, taken without a whole replay's verdict (not drawn, rows only, or no other server)

    @property
    def verified(self) -> bool:
        """A replay elsewhere agreed with an answer of it: until then each of its requests is replayed."""
        return self.batches > 0


@dataclass
class AuditLedger:
    """What a client audited: set on its sequence manager (:func:`attach`), filled by the forwards."""

    share: float
    seed: int = 0
    servers: Dict[str, ServerAudit] = field(default_factory=dict)
    requests: int = 0  # every request the client completed
    request_rows: int = 0  # their rows
    request_positions: int = 0  # their rows times the positions sent
    replayed: int = 0  # those replayed whole on another route
    row_checks: int = 0  # those whose drawn rows (not all) were replayed on another route and agreed
    row_checked_rows: int = 0
    row_max_difference: float = 0.0  # over the row checks
    escalated: int = 0  # row checks beyond their tolerance: the request replayed whole
    extra_rows: int = 0  # rows sent on a replay of any kind (whole, rows, third routes, spans): the audit's compute
    extra_positions: int = 0  # those rows times the positions sent
    probes: int = 0  # requests picked for a replay as a join probe (a server no replay had agreed with yet)
    probe_rows: int = 0  # their rows
    probe_positions: int = 0  # their rows times the positions sent
    replayed_rows: int = 0
    replays_failed: int = 0  # a replay's server failed: no verdict (the request itself stands)
    gaps: Dict[int, int] = field(default_factory=dict)  # block -> replays it could not get from another server
    max_difference: float = 0.0  # over the replays that agreed
    tolerances: List[float] = field(default_factory=list)  # each replay compared within a tolerance
    # peer -> the evidence against it: a server outvoted on the only request whose answer it gave,
    # left out of every route since (the run goes on without it)
    excluded: Dict[str, dict] = field(default_factory=dict)
    learned: set = field(default_factory=set)  # of those, the servers other ranks blamed (Redo.learn)
    redone_batches: int = 0  # batches whose answers of a server blamed later were evaluated again (Redo)
    honest_ulps: List[float] = field(default_factory=list)  # each agreement within a tolerance: its difference
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def tolerance_ulps(self) -> float:
        """The tolerance now, in ulps (:data:`PRIOR_ULPS`, calibrated on the honest agreements seen)."""
        with self.lock:
            if len(self.honest_ulps) < CALIBRATE_AFTER:
                return PRIOR_ULPS
            return min(PRIOR_ULPS, max(FLOOR_ULPS, CALIBRATED_FACTOR * max(self.honest_ulps)))

    def pick(self, row_digests: Sequence[bytes], peers: Sequence[str],
             positions: int = 0) -> Tuple[Optional[str], Optional[List[int]]]:
        """What of the request through ``peers`` (one content digest per row, :func:`row_digests`; each
        row ``positions`` long) is replayed: ("first batch", None) the whole request, a join probe;
        ("share", None) the whole request, every row drawn; ("rows", the rows drawn) a row check;
        (None, None) nothing.
        """
        if self.share <= 0:
            return None, None
        with self.lock:
            self.requests += 1
            self.request_rows += len(row_digests)
            self.request_positions += len(row_digests) * positions
            for p in set(peers):
                self.servers.setdefault(p, ServerAudit()).computed += 1
            # the join probe: every request through a server no whole replay has agreed with yet (its
            # requests in flight at once, and after a replay that failed, included)
            if not all(self.servers[p].verified for p in peers):
                self.probes += 1
                self.probe_rows += len(row_digests)
                self.probe_positions += len(row_digests) * positions
                return "first batch", None
        key = self.seed.to_bytes(8, "little")
        drawn = [r for r, digest in enumerate(row_digests)
                 if int.from_bytes(hashlib.blake2b(digest, digest_size=8, key=key).digest(), "little")
                 < self.share * 2 ** 64]
        if not drawn:
            return None, None
        return ("share", None) if len(drawn) == len(row_digests) else ("rows", drawn)

    def sent(self, rows: int, positions: int) -> None:
        """A replay sent ``rows`` rows of ``positions`` positions each (the audit's own compute)."""
        with self.lock:
            self.extra_rows += rows
            self.extra_positions += rows * positions

    def record_rows(self, peers: Sequence[str], rows: int, difference: float) -> None:
        """A row check of ``rows`` rows computed by ``peers`` that agreed, ``difference`` apart at most."""
        with self.lock:
            self.row_checks += 1
            self.row_checked_rows += rows
            self.row_max_difference = max(self.row_max_difference, difference)
            for p in set(peers):
                audit = self.servers.setdefault(p, ServerAudit())
                audit.row_checks += 1
                audit.rows += rows

    def taken_unchecked(self, peers: Sequence[str], replay_failed: bool = False) -> None:
        """An answer of ``peers`` taken without a replay's verdict (``replay_failed``: one was tried)."""
        with self.lock:
            self.replays_failed += replay_failed
            for p in set(peers):
                self.servers.setdefault(p, ServerAudit()).unchecked += 1

    def record(self, peers: Sequence[str], rows: int, difference: Optional[float], tolerance: Optional[float],
               ulp: Optional[float] = None) -> None:
        """A replay of ``rows`` rows computed by ``peers`` that agreed, ``difference`` apart at most
        (``ulp``: the tolerance's unit, where it was compared within one: it calibrates the tolerance).
        """
        with self.lock:
            self.replayed += 1
            self.replayed_rows += rows
            for p in set(peers):
                audit = self.servers.setdefault(p, ServerAudit())
                audit.batches += 1
                audit.rows += rows
            if difference is not None:
                self.max_difference = max(self.max_difference, difference)
            if tolerance is not None:
                self.tolerances.append(tolerance)
            if ulp and difference is not None:
                self.honest_ulps.append(difference / ulp)

    def blame_non_finite(self, peer: str, rows: int, finite_from: Sequence[str], redo: bool = False) -> bool:
        """``peer`` answered NaN or inf from finite inputs where ``finite_from`` answered numbers: left
        out of every route from now on (True), unless answers of it were taken unchecked before and the
        caller does not evaluate them again (``redo``; False: the run stops, as on a mismatch).
        """
        with self.lock:
            audit = self.servers.setdefault(peer, ServerAudit())
            audit.mismatches += 1
            if audit.unchecked and not redo:
                return False
            self.excluded.setdefault(peer, {"rows": rows, "difference": "inf", "non_finite": True,
                                            "outvoted_by": sorted(set(finite_from)),
                                            "answers_taken_unchecked": audit.unchecked})
            return True

    def facts(self) -> dict:
        """``run.swarm.audit``: what was checked, per server, and what escaped."""
        with self.lock:
            return {
                "share": self.share,
                "requests": self.requests,
                "request_rows": self.request_rows,
                "request_positions": self.request_positions,
                "replayed": self.replayed,
                "join_probes": self.probes,
                "join_probe_rows": self.probe_rows,
                "join_probe_positions": self.probe_positions,
                "replayed_rows": self.replayed_rows,
                "row_checks": self.row_checks,
                "row_checked_rows": self.row_checked_rows,
                "row_max_difference": self.row_max_difference,
                "escalated": self.escalated,
                "extra_rows": self.extra_rows,
                "extra_positions": self.extra_positions,
                "replays_failed": self.replays_failed,
                "max_difference": self.max_difference,
                "max_tolerance": max(self.tolerances) if self.tolerances else 0.0,
                "tolerance": _tolerance_facts(len(self.honest_ulps), max(self.honest_ulps, default=0.0)),
                "coverage_gaps": {str(b): n for b, n in sorted(self.gaps.items())},
                "excluded": dict(sorted(self.excluded.items())),
                "redone_batches": self.redone_batches,
                "servers": {p: {"computed": a.computed, "batches": a.batches, "row_checks": a.row_checks,
                                "rows": a.rows, "mismatches": a.mismatches, "unchecked": a.unchecked,
                                **_unseen(a.batches + a.row_checks)}
                            for p, a in sorted(self.servers.items())},
            }


def _tolerance_facts(agreements: int, largest: float) -> dict:
    """How the tolerance between servers of other numerics was set (``run.swarm.audit.tolerance``)."""
    calibrated = agreements >= CALIBRATE_AFTER
    return {"honest_agreements": agreements, "largest_honest_ulps": largest, "calibrated": calibrated,
            "ulps": min(PRIOR_ULPS, max(FLOOR_ULPS, CALIBRATED_FACTOR * largest)) if calibrated else PRIOR_ULPS,
            "rule": f"servers of other numerics: {PRIOR_ULPS:g} ulps of the coarsest dtype at the answer's magnitude "
                    f"until {CALIBRATE_AFTER} honest agreements between such servers, then {CALIBRATED_FACTOR:g} times "
                    f"the largest difference they showed (at least {FLOOR_ULPS:g}, at most {PRIOR_ULPS:g}); servers "
                    f"announcing the same numerics and kernels: bit for bit; the same numerics, other kernels or "
                    f"none announced: {SAME_NUMERICS_ULPS:g} ulps"}


def _unseen(replayed: int) -> dict:
    """The chance that a server whose every answer (one in ten) is wrong went unseen, with
    ``replayed`` of its answers replayed (whole or some rows) and equal: an answer wrong in the
    rows a check replayed (a wrong weight or a faulty kernel moves every row of a batch; a fault in
    one row of an answer is seen only where that row is drawn, at the share).
    """
    return {"unseen_if_always_wrong": 0.0 if replayed else 1.0, "unseen_if_one_in_ten_wrong": 0.9 ** replayed}


def attach(manager, share: float, seed: int = 0) -> AuditLedger:
    """Audit ``share`` of the requests of the client whose sequence manager is ``manager``."""
    ledger = AuditLedger(share=float(share), seed=int(seed))
    setattr(manager, AUDIT_ATTR, ledger)
    return ledger


def ledger_of(manager) -> Optional[AuditLedger]:
    return getattr(manager, AUDIT_ATTR, None)


def row_digests(token_ids: Optional[torch.Tensor], hidden_states: torch.Tensor, positions: Sequence[int],
                prompt_tokens: int = 0) -> List[bytes]:
    """The content of each row of a request, up to the position the head reads (what decides its
    answer: the blocks are causal): the same whichever rank sends it, in whichever batch.
    """
    digests = []
    for row, position in enumerate(positions):
        h = hashlib.blake2b(digest_size=16)
        source = token_ids[row, : position - prompt_tokens + 1] if token_ids is not None else \
            hidden_states[row, : position + 1]
        h.update(source.detach().cpu().contiguous().numpy().tobytes())
        h.update(repr(position).encode())
        digests.append(h.digest())
    return digests


def disjoint_route(manager, avoid: set, end: int, ledger: Optional[AuditLedger], start: int = 0) -> Optional[list]:
    """Spans from block ``start`` to ``end`` on online servers outside ``avoid`` (the one reaching
    furthest at each step, then of the finest dtype, ties by peer id); None where a block has no such
    server (a coverage gap, counted in ``ledger`` for every block from ``start`` to ``end`` without one:
    each block no other server could check, not only the first).
    """
    from petals.data_structures import RemoteSpanInfo, ServerState

    from dist_eval.backends.petals.failover import leave_out_other_rope

    leave_out_other_rope(manager)  # servers of other RoPE than the client's: never a replay's route
    spans, block = [], start
    containing = manager.state.sequence_info.spans_containing_block

    def usable(at: int) -> list:
        return [s for s in containing[at] if str(s.peer_id) not in avoid and s.state == ServerState.ONLINE]

    while block < end:
        choices = usable(block)
        if not choices:
            if ledger is not None:
                with ledger.lock:
                    for gap in (at for at in range(start, end) if not usable(at)):
                        ledger.gaps[gap] = ledger.gaps.get(gap, 0) + 1
            return None
        # the furthest reach, then the finest numerics (a comparison within the coarsest dtype's tolerance:
        # a bfloat16 replayer would hide a float32 server's small fault), then the peer id
        best = max(choices, key=lambda s: (s.end, -torch.finfo(_dtype(s.server_info.torch_dtype)).eps, str(s.peer_id)))
        spans.append(RemoteSpanInfo(best.peer_id, block, min(best.end, end), best.server_info))
        block = spans[-1].end
    return spans


# The tolerance between servers of other numerics, in units (ulps) of the coarsest dtype's precision at
# the answer's largest magnitude: PRIOR_ULPS until the run has seen CALIBRATE_AFTER honest agreements,
# then CALIBRATED_FACTOR times the largest difference they showed (never above the prior, never below
# FLOOR_ULPS): a server a little off (another revision's small change) is caught once the run knows how
# close honest replicas come; the margin keeps an honest answer's tail from being blamed.
PRIOR_ULPS, CALIBRATE_AFTER, CALIBRATED_FACTOR, FLOOR_ULPS = 64.0, 32, 8.0, 4.0
# Between servers that announce the same numerics but not the same kernels (or none): the kernels alone may
# differ (another CPU's vector instructions, another GPU, another thread count sum in another order): AVX2
# against AVX-512 kernels far below it, a weight changed by 1e-3 above it on every request
# (benchmarks/RESULTS.md, tests/test_audit.py). The same numerics and kernels: bit for bit.
SAME_NUMERICS_ULPS = 4.0
# The key of a server's announcement (petals' ServerInfo, extra_info) that names its kernels: dist_eval's
# servers add it (dist_eval.swarm.server.kernels_of); petals' own drop it, its ServerInfo keeps no extra key
# (announced_numerics_replacements keeps it on the client)
KERNELS_KEY = "dist_eval_kernels"


def numerics(span) -> Tuple:
    """What a server announces that decides its numbers, but its kernels (:func:`kernels`)."""
    info = span.server_info
    return (info.version, str(info.torch_dtype), str(info.quant_type), tuple(info.adapters or ()))


def same_numerics(spans: Sequence) -> bool:
    return len({numerics(s) for s in spans}) <= 1


def kernels(span) -> Optional[str]:
    """The kernels a server announces (torch's version, the device kind: the CPU's vector instructions and
    threads, the GPU's name and compute capability), None where it announces none.
    """
    return getattr(span.server_info, KERNELS_KEY, None)


def same_kernels(spans: Sequence) -> bool:
    found = {kernels(s) for s in spans}
    return len(found) == 1 and None not in found


def announced_numerics_replacements() -> list:
    """Petals' ServerInfo.from_tuple, keeping what a server announces of its numbers (its pydantic fields drop extra
    keys): its kernels (:data:`KERNELS_KEY`, read by :func:`kernels`) and the RoPE of the config.json it serves
    (:data:`~dist_eval.backends.config_json.ROPE_KEY`, read by
    :func:`~dist_eval.backends.petals.failover.leave_out_other_rope`), attributes of the ServerInfo it makes.
    """
    from petals.data_structures import ServerInfo

    from dist_eval.backends.config_json import ROPE_KEY

    from_tuple = ServerInfo.from_tuple.__func__
    kept = {KERNELS_KEY: str, ROPE_KEY: dict}

    def with_numerics(cls, source: tuple):
        info = from_tuple(cls, source)
        extra = source[2] if len(source) > 2 and isinstance(source[2], dict) else {}
        for key, kind in kept.items():
            if isinstance(extra.get(key), kind):
                object.__setattr__(info, key, extra[key])
        return info

    with_numerics.__wrapped__ = from_tuple
    return [(ServerInfo, "from_tuple", classmethod(with_numerics))]


def unit(spans: Sequence, reference: torch.Tensor) -> float:
    """One ulp of the coarsest dtype's precision at the answer's largest magnitude (the tolerance's unit)."""
    eps = max(torch.finfo(_dtype(s.server_info.torch_dtype)).eps for s in spans)
    return float(eps * max(1.0, reference.abs().max().item()))


def tolerance(spans: Sequence, reference: torch.Tensor, ledger: Optional[AuditLedger] = None) -> float:
    """A bound on the difference of two honest answers: 0 (bit for bit) where every span announces the same
    numerics and kernels; :data:`SAME_NUMERICS_ULPS` of :func:`unit` where the same numerics only; else
    :meth:`AuditLedger.tolerance_ulps` of them (calibrated).
    """
    if same_numerics(spans):
        return 0.0 if same_kernels(spans) else unit(spans, reference) * SAME_NUMERICS_ULPS
    return unit(spans, reference) * (ledger.tolerance_ulps() if ledger is not None else PRIOR_ULPS)


def rows_tolerance(spans: Sequence, reference: torch.Tensor) -> float:
    """A row check's bound: its rows, replayed in a smaller batch, may differ in their last bits from
    the request's (another composition, other kernels), whatever the numerics: :data:`PRIOR_ULPS` units
    of the coarsest dtype's precision at the answer's largest magnitude. Beyond it is no blame, only
    the reason to replay the request whole (the same composition), compared as any replay.
    """
    eps = max(torch.finfo(_dtype(s.server_info.torch_dtype)).eps for s in spans)
    return float(PRIOR_ULPS * eps * max(1.0, reference.abs().max().item()))


def _dtype(name) -> torch.dtype:
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference of two answers (inf where either is not finite)."""
    a, b = a.float(), b.float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return float((a - b).abs().max().item()) if a.numel() else 0.0


def agree(a: torch.Tensor, b: torch.Tensor, bound: Optional[float]) -> bool:
    if bound is None:
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) and bool(torch.isfinite(a).all())
    return a.shape == b.shape and difference(a, b) <= bound


def combine(facts: Sequence[Optional[dict]]) -> Optional[dict]:
    """The ranks' :meth:`AuditLedger.facts` as one (counts added, maxima taken); None without any."""
    redone_by_rank = [(f or {}).get("redone_batches", 0) for f in facts]  # in rank order (all_gather_object's)
    facts = [f for f in facts if f]
    if not facts:
        return None
    total = {key: sum(f.get(key, 0) for f in facts)
             for key in ("requests", "request_rows", "request_positions", "replayed", "join_probes",
                         "join_probe_rows", "join_probe_positions", "replayed_rows", "row_checks",
                         "row_checked_rows", "escalated", "extra_rows", "extra_positions", "replays_failed")}
    gaps: Dict[str, int] = {}
    servers: Dict[str, dict] = {}
    for f in facts:
        for block, n in f["coverage_gaps"].items():
            gaps[block] = gaps.get(block, 0) + n
        for peer, s in f["servers"].items():
            into = servers.setdefault(peer, {"computed": 0, "batches": 0, "row_checks": 0, "rows": 0, "mismatches": 0,
                                             "unchecked": 0})
            for key in into:
                into[key] += s.get(key, 0)
    for s in servers.values():
        s.update(_unseen(s["batches"] + s["row_checks"]))
    excluded = {peer: evidence for f in facts for peer, evidence in f.get("excluded", {}).items()}
    return {"share": facts[0]["share"], **total, "max_difference": max(f["max_difference"] for f in facts),
            "row_max_difference": max(f.get("row_max_difference", 0.0) for f in facts),
            "max_tolerance": max(f["max_tolerance"] for f in facts),
            # every rank calibrates its own; the report's: the widest
            "tolerance": max((f["tolerance"] for f in facts if "tolerance" in f), key=lambda t: t["ulps"],
                             default=_tolerance_facts(0, 0.0)),
            "coverage_gaps": dict(sorted(gaps.items(), key=lambda kv: int(kv[0]))),
            "excluded": dict(sorted(excluded.items())),
            "redone_batches_by_rank": redone_by_rank,
            "servers": dict(sorted(servers.items()))}


def summary_line(run: dict) -> str:
    """The summary's line on the audit ('' without one)."""
    facts = (run.get("swarm") or {}).get("audit")
    if not facts:
        return ""
    unchecked = sum(1 for s in facts["servers"].values() if not s["batches"] and not s.get("row_checks"))
    excluded = facts.get("excluded") or {}
    compared = "bit for bit" if not facts["max_difference"] else (
        f"within {facts['max_tolerance']:.2g} (servers of other numerics or kernels; largest difference "
        f"{facts['max_difference']:.2g}; tolerance {_said_tolerance(facts.get('tolerance'))})")
    agreed = "the others all equal" if excluded else "all equal"
    redone = sum(facts.get("redone_batches_by_rank") or [facts.get("redone_batches", 0)])  # combined, or a rank's
    return (f"  swarm audit: {facts['replayed']} of {facts['requests']} requests ({facts['replayed_rows']} rows) "
            f"replayed on other servers, {agreed} {compared}"
            + (f"; {facts['row_checks']} more checked in {facts['row_checked_rows']} drawn rows, all within "
               f"{PRIOR_ULPS:g} ulps (largest difference {facts['row_max_difference']:.2g})"
               if facts.get("row_checks") else "")
            + f"; {len(facts['servers']) - unchecked} of "
            f"{len(facts['servers'])} servers checked" + (f", {len(facts['coverage_gaps'])} block(s) with no other "
                                                          "server to check them" if facts["coverage_gaps"] else "")
            + (f"; {len(excluded)} server(s) outvoted and left out: {', '.join(excluded)}"
               + (f" ({redone} batch(es) they answered evaluated again on the others)" if redone else "")
               if excluded else "")
            + " (metrics.json run.swarm.audit)")


def _said_tolerance(tolerance: Optional[dict]) -> str:
    if not tolerance:
        return f"{PRIOR_ULPS:g} ulps"
    if not tolerance["calibrated"]:
        return f"{tolerance['ulps']:g} ulps, not yet calibrated ({tolerance['honest_agreements']} honest agreements)"
    return (f"{tolerance['ulps']:.3g} ulps, calibrated on {tolerance['honest_agreements']} honest agreements "
            f"(largest {tolerance['largest_honest_ulps']:.3g} ulps)")


def describe(spans: Sequence) -> str:
    return " -> ".join(f"{s.peer_id} (blocks {s.start}:{s.end})" for s in spans)


def exclude_if_unused(ledger: AuditLedger, rows: int, route: Sequence, other: Sequence, gap: float,
                      third: Optional[Sequence], third_agrees_with: Optional[str], redo: bool = False,
                      found: Optional[dict] = None) -> Optional[str]:
    """Where a third route outvoted one server none of whose answers was taken unchecked (each of its
    requests was replayed until one agreed: the join probe), or whose answers taken the caller
    evaluates again (``redo``: :class:`Redo`), leave it out of every route from now on and return
    which answer stands ("first": the request's own, "second": the replay's); else None (the run stops).
    An outvoted route of several servers: ``found`` names the one whose span two others outvoted
    (``peer``, ``blocks``, ``outvoted_by``: the span search of dist_eval.backends.petals.wire), else None.
    """
    if third is None or third_agrees_with not in ("first", "second"):
        return None
    faulty = other if third_agrees_with == "first" else route
    peers = {str(s.peer_id) for s in faulty}
    with ledger.lock:
        if len(peers) != 1 and found is None:
            return None
        [peer] = peers if found is None else [found["peer"]]
        unchecked = ledger.servers.get(peer, ServerAudit()).unchecked
        if unchecked and not redo:
            return None  # answers of it were taken unchecked before: they cannot be told apart now
        ledger.servers.setdefault(peer, ServerAudit()).mismatches += 1
        outvoted_by = found["outvoted_by"] if found is not None else \
            {str(s.peer_id) for s in [*(route if faulty is other else other), *third]}
        ledger.excluded[peer] = {
            "rows": rows, "difference": gap if gap != float("inf") else "inf", "outvoted_by": sorted(outvoted_by),
            **({"blocks": found["blocks"], "route": [str(s.peer_id) for s in faulty]} if found is not None else {}),
            "answers_taken_unchecked": unchecked,  # evaluated again (Redo)
        }
    return third_agrees_with


def mismatch(ledger: AuditLedger, rows: int, route: Sequence, other: Sequence, gap: float,
             third: Optional[Sequence], third_agrees_with: Optional[str]) -> AuditMismatch:
    """The error that stops the run: both routes, the difference, and the blame a third route allows."""
    if third is None:
        verdict = ("no third server of these blocks to settle it; stop or leave out the servers of one route, "
                   "then run again")
        blamed = [*route, *other]
    elif third_agrees_with is None:
        verdict = f"a third route ({describe(third)}) agrees with neither: more than one server is at fault"
        blamed = [*route, *other, *third]
    elif third_agrees_with == "both":
        verdict = (f"every third route ({describe(third)}, the last) agrees with both within its own tolerance (its "
                   "numerics are coarser): none can tell which is at fault; serve these blocks on more servers of "
                   "the finer numerics, or leave out the servers of one route, then run again")
        blamed = [*route, *other]
    else:
        faulty = other if third_agrees_with == "first" else route
        verdict = (f"a third route ({describe(third)}) agrees with the "
                   f"{'first' if third_agrees_with == 'first' else 'second'}: "
                   + (f"server {faulty[0].peer_id} computes other numbers than its replicas (another revision, dtype "
                      "or quantization of the weights, or faulty hardware)" if len(faulty) == 1 else
                      f"one of {', '.join(str(s.peer_id) for s in faulty)} is at fault")
                   + (", and answers of it were taken before this one, unchecked" if len(faulty) == 1 else "")
                   + "; stop it or leave it out of the swarm, then run again")
        blamed = list(faulty)
    with ledger.lock:
        for s in blamed:
            ledger.servers.setdefault(str(s.peer_id), ServerAudit()).mismatches += 1
    return AuditMismatch(
        f"swarm audit: a request of {rows} row(s) gave other hidden states on two routes of servers, "
        f"{'inf' if gap == float('inf') else f'{gap:.3g}'} apart at most: {describe(route)}; and {describe(other)}. "
        f"{verdict[0].upper()}{verdict[1:]}. No row of it is counted or stored (--audit 0 turns the audit off).")


# ---------------------------------------------------------------- redo: a blamed server's answers taken before

_forward = threading.local()  # the caller's thread: what its current forward took (see Redo)


@dataclass
class Taken:
    """The servers whose answers one forward took (the hidden states its logits come from), and the
    ledger that may blame one of them later (None: a batch an earlier run computed, its servers recorded).
    """

    ledger: Optional[AuditLedger]
    servers: frozenset


def begin_forward() -> None:
    """The caller's next forward is one whose batch it evaluates again where a server is blamed later."""
    _forward.taken, _forward.redoes = None, True


def caller_redoes() -> bool:
    return getattr(_forward, "redoes", False)


def note_taken(ledger: Optional[AuditLedger], servers) -> None:
    """In the caller's thread: the forward took answers of ``servers``."""
    before = getattr(_forward, "taken", None)
    _forward.taken = Taken(ledger, frozenset(servers) | (before.servers if before is not None else frozenset()))


def end_forward() -> Optional[Taken]:
    """What the forward since :func:`begin_forward` took (None: no audited swarm)."""
    taken = getattr(_forward, "taken", None)
    _forward.taken, _forward.redoes = None, False
    return taken


class Redo:
    """A rank's batches whose answers came from audited servers: those of a server blamed later (its
    earlier answers, unchecked, are suspect), on this rank or another (:meth:`learn`), are evaluated
    again on the others, the run going on (the forward loop, :class:`dist_eval.predict.ShardLoop`,
    replaces their results: every row counts once). ``ledger``: the client's (routes avoid what it
    excludes); batches an earlier run computed (a resume folder's) are watched by their servers too.
    """

    def __init__(self, ledger: Optional[AuditLedger] = None):
        self.watched: Dict[int, Tuple[object, frozenset]] = {}  # position in the loop's results -> (batch, servers)
        self.ledgers: Dict[int, AuditLedger] = {}
        if ledger is not None:
            self.ledgers[id(ledger)] = ledger
        self.blamed_seen = 0

    def blamed(self) -> set:
        """Every server blamed so far (left out of every route)."""
        out: set = set()
        for ledger in self.ledgers.values():
            with ledger.lock:
                out |= set(ledger.excluded)
        return out

    def watch(self, position: int, batch, taken: Optional[Taken]) -> None:
        # no ledger (the audit off): nothing can be blamed in this run, so no batch is held for a redo
        if taken is None or not taken.servers or (taken.ledger is None and not self.ledgers):
            self.watched.pop(position, None)
            return
        self.watched[position] = (batch, frozenset(taken.servers))
        if taken.ledger is not None:
            self.ledgers.setdefault(id(taken.ledger), taken.ledger)
        if taken.servers & self.blamed():  # a forward in flight (or a stored batch) took answers of a blamed server
            self.blamed_seen = -1

    def due(self) -> List[Tuple[int, object]]:
        """(position, batch) of each watched batch that took answers of a server blamed since (a
        look at every batch only when a server was blamed).
        """
        blamed = self.blamed()
        if len(blamed) == self.blamed_seen:
            return []
        self.blamed_seen = len(blamed)
        return [(position, batch) for position, (batch, servers) in sorted(self.watched.items()) if servers & blamed]

    def redone(self, position: int, batch, taken: Optional[Taken], rows: int) -> None:
        """The batch at ``position`` evaluated again: AuditMismatch where a blamed server answered again."""
        again = set(taken.servers) & self.blamed() if taken is not None else set()
        if again:
            raise AuditMismatch(
                f"swarm audit: server(s) {', '.join(sorted(again))} were outvoted after answers of them were taken, "
                f"and evaluating those {rows} row(s) again found no route of other servers; serve their blocks on "
                "more servers, or stop the blamed ones, then run again. No row of it is counted or stored.")
        for ledger in list(self.ledgers.values())[:1]:
            with ledger.lock:
                ledger.redone_batches += 1
        self.watch(position, batch, taken)
        self.blamed_seen = -1  # the redo's own answers may meet a server blamed meanwhile

    def own_blames(self) -> Dict[str, dict]:
        """The servers this rank blamed itself, with the evidence (what it tells the other ranks)."""
        out: Dict[str, dict] = {}
        for ledger in self.ledgers.values():
            with ledger.lock:
                out.update({peer: {k: v for k, v in evidence.items() if k != "blamed_by_ranks"}
                            for peer, evidence in ledger.excluded.items() if peer not in ledger.learned})
        return out

    def learn(self, union: Dict[str, Tuple[dict, List[int]]]) -> None:
        """Every rank's blamed servers (:func:`dist_eval.ranks.collectives.union_by_key` of :meth:`own_blames`):
        each left out of this rank's routes, its evidence the lowest blaming rank's, with the ranks that blamed it.
        """
        for ledger in self.ledgers.values():
            with ledger.lock:
                for peer, (evidence, by) in union.items():
                    if peer not in ledger.excluded:
                        ledger.learned.add(peer)
                    ledger.excluded[peer] = {**evidence, "blamed_by_ranks": list(by)}
