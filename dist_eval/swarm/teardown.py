"""A local swarm's teardown: its servers' process groups stopped together (SIGINT, SIGKILL when
due, a drain waited for), then what they leave removed (hivemind's sockets in /tmp, the private
TMPDIR once torch's shared-memory manager left it, the identities, the temp folder); and every
swarm still running stopped at interpreter exit.

The servers are :class:`~dist_eval.swarm.process.ServerProcess` objects, used through their
public methods. Standard library only.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import threading
import time
from typing import Dict, List, Optional, Sequence, Set

from dist_eval.procs import hivemind_socket_paths, live_groups, shm_managers_under
from dist_eval.swarm.placement import SwarmError

# How long a drained stop waits for torch's shared-memory manager of its servers to exit
# (procs.shm_managers_under) before it removes their TMPDIR. The manager stays 2 s after its
# last client (torch's own shutdown delay), freeing what they left, then removes its socket;
# with its folder already gone it aborts with "terminate called ... No such file or directory"
# in the last server's log, its shared memory already freed. Not worth 2 s of every run's stop.
_SHM_MANAGER_EXIT_SECONDS = 5.0
# a private swarm's first server's address, read by the others at their start (in its work folder)
PEERS_FILE = "peers"
# SIGINT -> SIGKILL delay. A lone server exits soon after SIGINT, but the last servers of
# a swarm announce "offline" to peers that already left and wait for hivemind's DHT
# timeouts. For a private swarm (all of it going away)
# nothing is lost by cutting that short: its clients have closed, nobody is left to hear
# "offline", and the files hivemind would leave are removed at stop. 0.25 s saves most of a
# second of every demo run over 1 s (benchmarks/RESULTS.md).
# Servers that joined another host's swarm get longer, so that their "offline" reaches it;
# so does a swarm that others may have joined (python -m dist_eval.swarm: stop(grace=...)).
GRACE_SECONDS_PRIVATE = 0.25
GRACE_SECONDS_ANNOUNCED = 1.0
GRACE_SECONDS_JOINED = 3.0

_LIVE_SWARMS: Set = set()
_LIVE_LOCK = threading.Lock()


def stop_at_exit(swarm) -> None:
    """Have ``swarm.stop()`` run at interpreter exit, unless :func:`forget_at_exit` comes first."""
    with _LIVE_LOCK:
        _LIVE_SWARMS.add(swarm)


def forget_at_exit(swarm) -> None:
    """``swarm`` stopped itself: nothing left to do for it at exit."""
    with _LIVE_LOCK:
        _LIVE_SWARMS.discard(swarm)


def _stop_all_at_exit() -> None:
    with _LIVE_LOCK:
        swarms = list(_LIVE_SWARMS)
    for swarm in swarms:
        try:
            swarm.stop()
        except Exception:  # best effort at interpreter exit
            pass


atexit.register(_stop_all_at_exit)


def terminate(servers: Sequence, sockets: Set[str], deadline: float, grace: float, drain_s: float) -> None:
    """Stop the process groups of ``servers`` together: SIGINT to each (its main process alone
    with ``drain_s``), SIGKILL when due (:func:`kill_when_due`), then wait until none is left,
    at most until ``deadline``; the hivemind sockets they hold added to ``sockets`` first.
    SwarmError if a process survives (never seen).
    """
    started = [s for s in servers if s.pgid is not None and not s.seen_gone]
    if not started:
        return
    pgids = {s.pgid for s in started}
    live = note_sockets(sorted(pgids), sockets)
    for s in started:
        if s.poll() is None:
            s.interrupt(main_only=bool(drain_s))  # draining: the p2pd daemon and the handlers serve on
        elif s.pgid in live:  # main is gone, its children are not
            s.signal_group(signal.SIGKILL)
    kill_when_due(started, deadline, grace, drain_s)
    for s in started:
        if s.poll() is None:
            s.wait(timeout=max(0.1, deadline - time.monotonic()))
    left = live_groups(pgids)
    if left:
        raise SwarmError(
            f"local swarm: processes {sorted(p for procs in left.values() for p in procs)} survived SIGKILL "
            f"of their groups {sorted(left)}; kill them by hand (kill -9 -- -PGID)."
        )


def kill_when_due(started: Sequence, deadline: float, grace: float, drain_s: float) -> None:
    """Wait until the process groups of ``started`` (just sent SIGINT) are gone, at most until
    ``deadline``; SIGKILL to each one ``grace`` seconds after the SIGINT, or with ``drain_s``,
    ``grace`` after it says it drained its requests (at most ``drain_s`` + ``grace``).
    """
    began = time.monotonic()
    kill_at = {s.pgid: began + drain_s + grace for s in started}
    by_pgid = {s.pgid: s for s in started}
    draining = [s for s in started if drain_s]
    killed: Set[int] = set()
    while True:
        for s in started:
            s.poll()  # reap the main processes: a zombie leader keeps its group listed
        for s in [s for s in draining if s.drained]:
            draining.remove(s)
            kill_at[s.pgid] = min(kill_at[s.pgid], time.monotonic() + grace)
        live = live_groups(set(kill_at))
        now = time.monotonic()
        if not live or now >= deadline:
            return
        for pgid in set(live) - killed:
            if now >= kill_at[pgid]:
                by_pgid[pgid].signal_group(signal.SIGKILL)
                killed.add(pgid)
        time.sleep(0.05)


def note_sockets(pgids: Sequence[int], sockets: Set[str]) -> Dict[int, List[int]]:
    """Add to ``sockets`` the hivemind sockets that the process groups ``pgids`` hold: hivemind
    creates them in /tmp whatever TMPDIR says, and leaves some behind even on a clean exit.
    Returns the groups' live processes.
    """
    live = live_groups(set(pgids))
    sockets |= hivemind_socket_paths([p for procs in live.values() for p in procs])
    return live


def cleanup_files(sockets: Set[str], workdir: Optional[str], servers: Sequence, log_dir: Optional[str],
                  keep_logs: bool, wait_for_shm_managers: bool = False) -> None:
    """Remove what the servers left: ``sockets``, then in ``workdir`` the private TMPDIR (once torch's
    shared-memory managers left it, with ``wait_for_shm_managers``), the servers' identities, and the
    folder itself (with the logs in it when ``log_dir`` is None, unless ``keep_logs``: an error cites them).
    """
    for path in sockets:
        try:
            os.unlink(path)
        except OSError:
            pass
    if workdir is None:
        return
    tmpdir = os.path.join(workdir, "tmp")
    # a drained stop (a swarm others use, whose logs may be kept) lets torch's manager of shared
    # memory leave its socket folder itself; a private swarm's stop does not wait for it
    _wait_for_shm_managers(tmpdir, _SHM_MANAGER_EXIT_SECONDS if wait_for_shm_managers else 0.0)
    shutil.rmtree(tmpdir, ignore_errors=True)
    for path in [p for s in servers for p in (s.identity_path, s.state_path)]:  # the identities (private keys)
        try:  # go whatever happens
            os.unlink(path)
        except OSError:
            pass
    if log_dir is None and keep_logs:
        return  # the failure message points at these logs
    if log_dir is None:
        shutil.rmtree(workdir, ignore_errors=True)
        return
    for remove, path in ((os.unlink, os.path.join(workdir, PEERS_FILE)), (os.rmdir, workdir)):
        try:
            remove(path)
        except OSError:
            pass


def _wait_for_shm_managers(tmpdir: str, seconds: float) -> None:
    """Wait up to ``seconds`` until no torch shared-memory manager has its socket under ``tmpdir``."""
    waited_until = time.monotonic() + seconds
    while time.monotonic() < waited_until and shm_managers_under(tmpdir):
        time.sleep(0.05)
