"""Swarm failures: route around a failed server at once, and name the blocks left unserved."""
from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time
from typing import NamedTuple

from dist_eval.backends.petals.requests import drives, too_large
from dist_eval.errors import UsageError, one_line, short_error, stopping, warn


def failover_replacements() -> list:
    """The petals 2.2.0 client, made to route around a failed server at once (applied by
    :func:`dist_eval.backends.petals.shims.apply_client_patches`).

    Why: on a failed request, ``RemoteSequenceManager.on_request_failure`` bans the peer
    and drops it from ``block_infos``, but routing (``make_sequence``) reads the
    ``spans_containing_block`` computed at the last routing refresh, which still holds
    the dead peer. Every retry until the next refresh (``update_period``, 60 s by
    default) could pick it again, with backoff growing to ``max_backoff``: one batch
    stalled for about a minute when a server was killed (benchmarks/RESULTS.md). Here the spans are recomputed
    from ``block_infos`` right after the failure, so the next attempt goes elsewhere.
    A block left with no server is handled as petals does (``on_request_failure``
    triggers a refresh that re-adds banned servers rather than none).

    Only a server failure (:func:`server_failure`) bans a server: any other error (a bug
    of the client's, a petals API change) is raised at once, in petals' own requests too.
    A request over a server's ``--max_batch_size`` is no failure of that server: it ends
    the forward at once with :class:`~dist_eval.backends.petals.requests.RequestTooLarge` (for
    clients whose request size dist_eval drives), without a ban or a retry of the same size.

    Every route (``make_sequence``) first leaves out the servers of other RoPE than the client's config.json
    (:func:`leave_out_other_rope`).

    Also records each peer's last request outcome (``state.dist_eval_outcomes``: peer
    -> (monotonic time, ok)) so that, when a batch keeps failing, the blocks whose every
    server is failing can be named (see :func:`unserved_blocks`).
    """
    from petals.client.routing.sequence_manager import RemoteSequenceManager

    original_failure = RemoteSequenceManager.on_request_failure
    original_success = RemoteSequenceManager.on_request_success
    original_route = RemoteSequenceManager.make_sequence

    def on_request_failure(self, peer_id):
        helper_died = getattr(self, "dist_eval_helper_died", None)
        if helper_died is not None:  # no retry can work: stop this forward now (backends.petals.helpers)
            raise helper_died
        error = sys.exc_info()[1]
        if error is not None and not server_failure(error):  # ours, not the server's: no ban, no retry
            raise error
        refused = too_large(error) if drives(self) else None
        if refused is not None:  # the server works, the request was too big: resend it split
            raise refused
        outcomes = getattr(self.state, "dist_eval_outcomes", None) or {}
        if peer_id is not None and outcomes.get(peer_id, (0, True))[1]:
            _warn_server_failed(self, peer_id, error)  # once per failing streak, not per retry
        _record(self, peer_id, False)
        original_failure(self, peer_id)
        if peer_id is None:
            return
        with self.lock_changes:
            info = self.state.sequence_info
            info.spans_by_priority, info.spans_containing_block = info._sort_spans(info.block_infos)

    def on_request_success(self, peer_id):
        _record(self, peer_id, True)
        original_success(self, peer_id)

    def make_sequence(self, *args, **kwargs):
        # every route, the wire's and petals' own (label words, hidden states, training); again where petals
        # refreshed the table inside (it does when a failure emptied a block) and routed through a new server
        for _ in range(MAX_ROPE_REROUTES):
            leave_out_other_rope(self)
            spans = original_route(self, *args, **kwargs)
            if not any(other_rope(self, span.server_info) for span in spans):
                return spans
        raise LeftOut(f"{MAX_ROPE_REROUTES} routes in a row met a server of other RoPE settings than yours")

    return [(RemoteSequenceManager, "on_request_failure", on_request_failure),
            (RemoteSequenceManager, "on_request_success", on_request_success),
            (RemoteSequenceManager, "make_sequence", make_sequence)]


def quiet_retry_logs() -> None:
    """Quiet petals' retry logs: it logs every retry as a multi-line WARNING (the whole ServerInfo); the one line
    of :func:`failover_replacements` per failing server says the same, and the outcome is reported anyway.
    """
    for name in ("petals.client.sequential_autograd", "petals.client.routing.sequence_manager"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("petals.client.routing.sequence_manager").addFilter(_drop_helper_died)


def _record(manager, peer_id, ok: bool) -> None:
    if peer_id is None:
        return
    outcomes = getattr(manager.state, "dist_eval_outcomes", None)
    if outcomes is None:
        outcomes = manager.state.dist_eval_outcomes = {}
    outcomes[peer_id] = (time.monotonic(), ok)


class ServerAnswerError(RuntimeError):
    """A server answered a request with something the client cannot use (a server failure)."""


def server_failure(error: BaseException) -> bool:
    """Whether ``error``, raised by a request to the swarm, is the transport's or a server's
    (retried elsewhere, and the server banned), not the client's own (raised at once).

    Server failures: an error the server sent back or the transport raised (hivemind's
    ``P2PHandlerError``, ``P2PDaemonError``), a timeout, a dropped or refused connection
    (``OSError``, ``EOFError``), no server for some blocks (petals' ``MissingBlocksError``),
    an answer of the wrong shape (:class:`ServerAnswerError`). petals itself counts every
    exception as the server's; then a ``TypeError`` in the client's own request building
    banned every healthy server until ``--swarm-timeout``.
    """
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError
    from petals.client.routing.sequence_manager import MissingBlocksError

    return isinstance(error, (P2PHandlerError, P2PDaemonError, TimeoutError, OSError, EOFError,
                              MissingBlocksError, ServerAnswerError))


def _drop_helper_died(record: logging.LogRecord) -> bool:
    """A logging filter. petals' routing thread logs, with a traceback, the error that ends
    its wait on a dead DHT process (:func:`~dist_eval.backends.petals.helpers.release_waits_on_dead_helpers`);
    the run reports that failure itself, in one line.
    """
    from dist_eval.backends.petals.helpers import HelperDied

    return not (record.exc_info and isinstance(record.exc_info[1], HelperDied))


# A stream reset by this rank's own p2pd (a server that died mid-request, or this rank's own daemon stopping) is
# said once it is known not to be a stop: within this many seconds, or when the client closes, if the rank was not
# told to stop and no helper of its client (DHT process, p2pd) was found dead: a scheduler's cancel signals the
# helpers too, and they may act before the rank hears (a dead helper is the run's to report, HelperWatch, in one line).
OWN_DAEMON_GRACE_S = 10.0
_said_at_close = threading.Event()  # set by flush_daemon_error_warnings: the pending ones decide now
_pending: list = []  # the threads still waiting to decide (each started before it is listed), to join at close
_pending_lock = threading.Lock()  # the routing thread adds to _pending while the main thread's close takes it


def _warn_server_failed(manager, peer_id, error) -> None:
    if stopping.is_set():  # cancelled: the request was cut short here, not by the server
        return
    reason = one_line(f"{type(error).__name__}: {error}", 160) if error is not None else "no answer"
    message = (f"swarm server ...{str(peer_id)[-8:]} failed a request ({reason}); "
               "routing around it (a block no other server holds is retried for up to --swarm-timeout).")
    if type(error).__name__ == "P2PDaemonError":  # from the daemon of this rank, not the server's answer
        waiting = threading.Thread(target=_warn_unless_stopped_here, args=(manager, message),
                                   name="dist_eval-daemon-error", daemon=True)  # never holds up the exit
        waiting.start()  # before it is listed: a close taking the list meanwhile joins only started threads
        with _pending_lock:
            _pending[:] = [*(thread for thread in _pending if thread.is_alive()), waiting]
    else:
        warn(message)


def _warn_unless_stopped_here(manager, message: str) -> None:
    """Warn after :data:`OWN_DAEMON_GRACE_S`, or at once when the client closes
    (:func:`flush_daemon_error_warnings`), unless first the rank is told to stop or the client's
    :class:`~dist_eval.backends.petals.helpers.HelperWatch` finds one of its helpers dead (it records it on
    ``manager``).
    """
    def stopped_here() -> bool:
        return stopping.is_set() or getattr(manager, "dist_eval_helper_died", None) is not None

    deadline = time.monotonic() + OWN_DAEMON_GRACE_S
    while time.monotonic() < deadline and not _said_at_close.is_set():
        if stopped_here():
            return
        _said_at_close.wait(0.05)
    if not stopped_here():
        warn(message)


def flush_daemon_error_warnings(timeout: float = 5.0) -> None:
    """Before a client's helpers are stopped: every daemon error still waiting is decided now (said, unless the
    rank is stopping or a helper already ended), so a short run does not end before its warning is said.
    """
    _said_at_close.set()
    with _pending_lock:
        waiting_now, _pending[:] = list(_pending), []
    try:
        for waiting in waiting_now:
            waiting.join(timeout)
    finally:
        _said_at_close.clear()


# On a client's sequence manager: its config.json's RoPE settings (backends.config_json.rope_settings), set at the
# load; each server's announcements compared with them, and the servers left out for announcing others.
OWN_ROPE_ATTR = "dist_eval_own_rope"
_ROPE_COMPARED_ATTR = "dist_eval_rope_compared"
ROPE_LEFT_OUT_ATTR = "dist_eval_rope_left_out"


# routes made again in a row, each after a server of other RoPE met on the last was left out (each leaves out one
# more, so this bounds only a table that keeps changing under the route)
MAX_ROPE_REROUTES = 16


class _LeftOutServer(NamedTuple):
    announced: dict  # its RoPE settings
    differ: list  # the names that differ from the client's
    peer: object  # its PeerID (petals' blocked_servers)
    blocks: list  # the blocks it served when it was left out


class LeftOut(ServerAnswerError):
    """A request's span met a server of other RoPE than the client's (:func:`other_rope`): left out now; the
    request is routed around it, no failure of the server's (a replay of the audit counts it as one).
    """


def other_rope(manager, server_info) -> list:
    """The RoPE settings ``server_info`` announces otherwise than the client's config.json (:data:`OWN_ROPE_ATTR`);
    [] where it announces none (petals' own servers, an older dist_eval's) or the client keeps none.
    """
    from dist_eval.backends.config_json import ROPE_KEY, rope_differences

    own, theirs = getattr(manager, OWN_ROPE_ATTR, None), getattr(server_info, ROPE_KEY, None)
    return rope_differences(own, theirs) if own is not None and isinstance(theirs, dict) else []


def leave_out_other_rope(manager, say: bool = True) -> list:
    """Leave out, for the rest of the run, the online servers of the routing table that announce other RoPE
    settings than the client's config.json (their numbers are another model's): in petals' own
    ``blocked_servers``, which every refresh of the table applies, and out of the table now (again at each call:
    a refresh in flight puts one back), each said in a warning line. A server is compared again when its
    announcement changes. Called before every route, petals' own (``make_sequence``) and the audit's. Returns the
    blocks a server left out by this call served that have no other server online or joining in the table.
    ``say=False``: no line (the caller says it).
    """
    from petals.data_structures import ServerState

    from dist_eval.backends.config_json import ROPE_KEY

    left_out = manager.__dict__.setdefault(ROPE_LEFT_OUT_ATTR, {})
    if getattr(manager, OWN_ROPE_ATTR, None) is None:
        return []
    compared = manager.__dict__.setdefault(_ROPE_COMPARED_ATTR, {})  # peer -> the announcements compared
    info, newly, unserved = manager.state.sequence_info, {}, []
    with manager.lock_changes:
        for block in info.block_infos:  # every route: kept cheap (no string made of a peer id or an announcement)
            for peer, server in block.servers.items():
                announced, seen = getattr(server, ROPE_KEY, None), compared.setdefault(peer, [])
                if server.state == ServerState.ONLINE and announced not in seen:
                    seen.append(announced)
                    differ = other_rope(manager, server)
                    if differ:
                        newly[str(peer)] = _LeftOutServer(announced, differ, peer, [])
        left_out.update(newly)
        if newly:
            manager.blocked_servers = set(manager.blocked_servers or ()) | {out.peer for out in newly.values()}
        dropped, newly_out = False, {out.peer: out for out in newly.values()}
        for index, block in enumerate(info.block_infos):
            gone = {out.peer for out in left_out.values() if out.peer in block.servers}
            for peer in gone:
                del block.servers[peer]
                if peer in newly_out:
                    newly_out[peer].blocks.append(index)
            dropped = dropped or bool(gone)
            serving = [s for s in block.servers.values() if s.state in (ServerState.ONLINE, ServerState.JOINING)]
            if gone & set(newly_out) and not serving:
                unserved.append(index)
        if dropped:
            info.spans_by_priority, info.spans_containing_block = info._sort_spans(info.block_infos)
    if newly and say:
        warn_left_out(manager, newly)
    return unserved


def warn_left_out(manager, servers: dict) -> None:
    """One warning line: ``servers`` ({peer id: its :class:`_LeftOutServer`}) are left out of every route."""
    warn(f"{other_rope_line(manager, servers)}: left out of every route (metrics.json: run.swarm.rope_left_out).")


def other_rope_line(manager, servers: dict) -> str:
    """The start of a line about ``servers`` ({peer id: its :class:`_LeftOutServer`}): each server with its
    settings beside the client's.
    """
    own = getattr(manager, OWN_ROPE_ATTR, None) or {}

    def shown(value) -> str:  # a server's announcement is its own: any msgpack value, any size
        text = json.dumps(value, default=repr)
        return text if len(text) <= 200 else text[:200] + "..."

    said = "; ".join(f"{peer[:16]}...: " + ", ".join(f"{name} {shown(own.get(name))} here, "
                                                    f"{shown(out.announced.get(name))} there" for name in out.differ)
                     for peer, out in list(servers.items())[:3])
    more = f"; {len(servers) - 3} more" if len(servers) > 3 else ""
    return (f"server(s) of this model's blocks announce a config.json with other RoPE settings than yours ({said}"
            f"{more}): their numbers are another model's")


def unserved_blocks(manager) -> list:
    """Blocks with no working server: none is listed for them in the last routing
    refresh, or every server listed for them failed its latest request (the outcomes
    that :func:`failover_replacements` records).
    """
    outcomes = dict(getattr(manager.state, "dist_eval_outcomes", None) or {})
    failing = {peer for peer, (_, ok) in outcomes.items() if not ok}
    info = manager.state.sequence_info
    missing = []
    for block in range(len(manager)):
        # block_infos keeps every listed server; spans drop the ones a failure removed
        servers = set(info.block_infos[block].servers) | {s.peer_id for s in info.spans_containing_block[block]}
        if not servers or servers <= failing:
            missing.append(block)
    return missing


def swarm_failure(manager, swarm_timeout: float, waited: float, error: Exception) -> UsageError:
    """The error that ends a batch the swarm failed for ``swarm_timeout`` seconds: one line
    naming the blocks left without a working server (when known), the last error and the fixes.
    """
    missing = unserved_blocks(manager)
    if not missing:  # petals names them itself when no server is listed at all
        match = re.search(r"No servers holding blocks \[?([0-9, ]+)\]? are online", str(error))
        if match:
            missing = [int(b) for b in match.group(1).replace(",", " ").split()]
    left_out = {peer: out for peer, out in (getattr(manager, ROPE_LEFT_OUT_ATTR, None) or {}).items()
                if set(out.blocks) & set(missing)}
    what = (
        f"no working server for block(s) {missing} of {len(manager)}: every server holding them failed"
        + (" or was left out" if left_out else "")
        if missing
        else "the swarm failed every attempt"
    )
    if left_out:  # it served them: no restart brings it back within this run
        what += f" ({other_rope_line(manager, left_out)}: left out for the rest of this run)"
    return UsageError(
        f"{what} for {waited:.0f} s, so a batch could not be computed "
        f"(last error: {short_error(error)}). Restart servers for those blocks (python -m "
        "dist_eval.swarm, or petals' run_server), serve every block on 2+ servers to survive a failure, "
        "or raise --swarm-timeout to wait longer.",
        param="swarm_timeout", value=swarm_timeout,
    )
