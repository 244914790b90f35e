"""Draining a server before it stops: SIGTERM (a preemption notice) or SIGINT to it.

petals' graceful shutdown (``ModuleContainer.shutdown``) announces the blocks OFFLINE, then
shuts the connection handlers down at once, cutting the requests they are serving: a client's
forward fails and is retried elsewhere, or fails the run where no other server holds the blocks.
Here the shutdown first announces OFFLINE, refuses new requests (a client routes around a
refusal at once, as around a failed server) and waits until the requests in flight have
finished, at most :data:`DRAIN_TIMEOUT_S`; then petals' shutdown goes on. The server reports
"draining" as the drain begins and "drained" when it ends (:mod:`~dist_eval.swarm.state_file`: the
swarm process that stops its servers waits for it, :func:`dist_eval.swarm.teardown.terminate`), and
logs a line at each for people.

The count of requests in flight lives in shared memory made before the connection handlers
(forked processes) start, so that they count and the server's main process reads it.
Standard library only at import.
"""
from __future__ import annotations

import contextlib
import functools
import multiprocessing
import sys
import time

from dist_eval.swarm import state_file

# How long a draining server waits for its requests in flight. SLURM's default KillWait: the
# time a job step gets between SIGTERM and SIGKILL; a cloud's preemption notice gives 30 s or more.
DRAIN_TIMEOUT_S = 30.0
# The log line a server prints when its drain ended (for people: the swarm reads its state file)
DRAINED = "dist_eval.swarm.server: drained"
# The handlers that serve a request with the blocks (rpc_info answers metadata: never refused)
_REQUESTS = ("rpc_forward", "rpc_backward", "rpc_push")
_STREAMS = ("rpc_forward_stream", "rpc_backward_stream", "rpc_inference")

_shared: dict = {}  # "in_flight": a shared int, "draining": a shared event; made by replacements()


class ServerDrainingError(RuntimeError):
    """A request that reached a draining server (the client sees a server failure and routes around it)."""


@contextlib.contextmanager
def _one_request_in_flight():
    in_flight, draining = _shared["in_flight"], _shared["draining"]
    with in_flight.get_lock():  # counted first, then the flag read: the drain sees it or it is refused
        in_flight.value += 1
    try:
        if draining.is_set():
            raise ServerDrainingError("this server is draining (it was told to stop): it takes no new requests")
        yield
    finally:
        with in_flight.get_lock():
            in_flight.value -= 1


def _counted(method):
    @functools.wraps(method)  # hivemind reads the request/response types from the annotations
    async def counted(self, request, context):
        with _one_request_in_flight():
            return await method(self, request, context)

    return counted


def _counted_stream(method):
    @functools.wraps(method)
    async def counted(self, requests, context):
        with _one_request_in_flight():
            async for response in method(self, requests, context):
                yield response

    return counted


def _say(line: str) -> None:
    print(f"dist_eval.swarm.server: {line}", file=sys.stderr, flush=True)


def _draining(shutdown):
    @functools.wraps(shutdown)
    def drain_then_shut_down(self):
        from petals.data_structures import ServerState

        in_flight, draining = _shared["in_flight"], _shared["draining"]
        self.dht_announcer.announce(ServerState.OFFLINE)  # petals' shutdown says it again: harmless
        draining.set()
        state_file.report(state_file.DRAINING)
        began = time.monotonic()
        _say(f"draining: {in_flight.value} request(s) in flight, new ones refused; "
             f"waiting at most {DRAIN_TIMEOUT_S:.0f} s")
        while in_flight.value > 0 and time.monotonic() - began < DRAIN_TIMEOUT_S:
            time.sleep(0.02)
        left = in_flight.value
        cut = f"; {left} request(s) still in flight after {DRAIN_TIMEOUT_S:.0f} s are cut" if left > 0 else ""
        print(f"{DRAINED} in {time.monotonic() - began:.1f} s{cut}", file=sys.stderr, flush=True)
        state_file.report(state_file.DRAINED)
        try:
            return shutdown(self)
        finally:  # petals may start a new container (new blocks): its handlers must not refuse
            draining.clear()
            in_flight.value = 0

    return drain_then_shut_down


def replacements() -> list:
    """The attributes that make this server process drain before its shutdown: each request
    handler of ``TransformerConnectionHandler`` counted (and refused while draining), and
    ``ModuleContainer.shutdown`` waiting for them. Applied by
    :func:`dist_eval.swarm.server.apply_server_patches`, before the handlers are forked.
    """
    from petals.server.handler import TransformerConnectionHandler
    from petals.server.server import ModuleContainer

    fork = multiprocessing.get_context("fork")  # hivemind's handlers are forked processes
    _shared.update(in_flight=fork.Value("i", 0), draining=fork.Event())
    handler = TransformerConnectionHandler
    return ([(handler, name, _counted(getattr(handler, name))) for name in _REQUESTS]
            + [(handler, name, _counted_stream(getattr(handler, name))) for name in _STREAMS]
            + [(ModuleContainer, "shutdown", _draining(ModuleContainer.shutdown))])
