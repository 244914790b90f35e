"""A local swarm's servers kept alive: a server that dies is restarted, with a backoff and a
bounded number of restarts in a time window, as a process supervisor does (issue 42).

:class:`RestartPolicy` is the policy (pure: the delays, the limit, the bound on unserved
blocks); :class:`Supervisor` is the thread that applies it to a
:class:`~dist_eval.swarm.local.LocalSwarm`'s servers once they serve, through their public
methods (:class:`~dist_eval.swarm.process.ServerProcess`) and the swarm's. Each event is one line:
which server, its exit code or signal, its blocks, restarted or not.

- A server that exits with code 0 left on purpose (SIGTERM or SIGINT to it: petals' graceful
  shutdown, e.g. a preemption notice): it is not restarted.
- Any other exit (a signal such as SIGKILL or an OOM kill, a non-zero code): what is left of
  its process group is killed (its p2pd holds the port), then it is restarted on the same
  port, blocks and peer identity (``--identity_path``, so its address stays valid), joining
  through the servers still up (or the swarm it joined): the first server may be the one
  that died. It counts as back once it says it serves again (its state file), within the start timeout.
- More than ``max_restarts`` restarts of one server within ``window`` seconds: it stays down.
- Blocks without a live server past ``unserved_timeout`` seconds, or with no server left that
  may come back: :meth:`Supervisor.failure` says so (``python -m dist_eval.swarm`` then exits 1).

Standard library only.
"""
from __future__ import annotations

import random
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional, Tuple

from dist_eval.swarm.placement import SwarmError

POLL_SECONDS = 0.2


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead server is restarted (see the module's docstring).

    ``max_restarts`` restarts of one server within ``window`` seconds at most (0: never
    restarted); the k-th restart in the window waits ``backoff * 2**(k-1)`` seconds, at most
    ``max_backoff``, each delay +-``jitter`` (a fraction) at random so that servers sharing
    a GPU do not reload at once; ``unserved_timeout``: seconds a block may go without a live
    server before the swarm gives up.
    """

    max_restarts: int = 3
    window: float = 600.0
    backoff: float = 2.0
    max_backoff: float = 60.0
    unserved_timeout: float = 300.0
    jitter: float = 0.25

    def __post_init__(self) -> None:
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise SwarmError(f"max_restarts={self.max_restarts!r}: expected an integer >= 0 (0: never restart).")
        for name in ("window", "unserved_timeout"):
            if not getattr(self, name) > 0:
                raise SwarmError(f"{name}={getattr(self, name)!r}: expected a positive number of seconds.")
        if not 0 <= self.backoff <= self.max_backoff:
            raise SwarmError(f"backoff={self.backoff!r}, max_backoff={self.max_backoff!r}: expected "
                             "0 <= backoff <= max_backoff seconds.")
        if not 0 <= self.jitter < 1:
            raise SwarmError(f"jitter={self.jitter!r}: expected a fraction in [0, 1).")

    def delay(self, restart: int, rng: random.Random) -> float:
        """Seconds before the ``restart``-th restart (1, 2, ...) within the window."""
        base = min(self.max_backoff, self.backoff * 2 ** max(0, restart - 1))
        return base * (1 + self.jitter * (2 * rng.random() - 1))


def describe_exit(returncode: int) -> str:
    """``-9`` -> "killed by SIGKILL", ``3`` -> "exit code 3"."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class _Watch:
    """What the supervisor knows of one server."""

    state: str = "up"  # up -> waiting (restart due) -> starting -> up; or down (stays down)
    restarts: Deque[float] = field(default_factory=deque)  # when each restart in the window began
    due: float = 0.0  # waiting: when the restart is due
    spawned: float = 0.0  # starting: when the restart began
    died: float = 0.0  # when it died last
    timed_out: bool = False  # starting: killed for not serving within the start timeout


class Supervisor:
    """The thread that keeps ``swarm``'s servers alive (``swarm``: a LocalSwarm, started;
    ``swarm.restart`` is the policy, ``swarm.servers`` the server processes), through public methods alone.
    """

    def __init__(self, swarm, log: Callable[[str], None]):
        self.swarm, self.policy, self.log = swarm, swarm.restart, log
        self.watches = [_Watch() for _ in swarm.servers]
        self.unserved: List[int] = []  # blocks without a live server, since unserved_since
        self.unserved_since: Optional[float] = None
        self._rng = random.Random()
        self._watching = threading.Lock()  # the watches: this thread writes them, failure() reads them
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dist_eval-swarm-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30.0)

    def state(self, index: int) -> str:
        return self.watches[index].state

    def restarts(self, index: int) -> int:
        return len(self.watches[index].restarts)

    def _loop(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            # stop() waits for this block to end, and then the swarm no longer runs: no restart begins after a stop
            with self.swarm.running() as running, self._watching:
                if not running:
                    return
                now = time.monotonic()
                for s, watch in zip(self.swarm.servers, self.watches):
                    try:
                        self._tend(s, watch, now)
                    except Exception as e:  # a failed restart is one more death, not the end of supervision
                        self.log(f"{s.label}: restart failed ({type(e).__name__}: {e}); it stays down")
                        watch.state = "down"
                self._note_coverage(now)

    def _tend(self, s, watch: _Watch, now: float) -> None:
        if watch.state in ("up", "starting") and s.poll() is not None:
            self._died(s, watch, now)
        elif watch.state == "starting":
            if self.swarm.serves_again(s):
                # said before it shows: whoever sees "up" (server_state) finds the line in the log
                self.log(f"{s.label} serves again (restart {len(watch.restarts)}, {now - watch.died:.1f} s "
                         f"after it died; address {s.address})")
                watch.state = "up"
            elif now - watch.spawned > self.swarm.start_timeout:
                watch.timed_out = True
                s.kill()  # seen dead on the next round, counted as a failed start
        elif watch.state == "waiting" and now >= watch.due and s.gone():
            peers = self.peers_for(s)
            if peers is None:
                return  # another server is restarting a new swarm: join it once its address is known
            watch.state, watch.spawned, watch.timed_out = "starting", now, False
            watch.restarts.append(now)
            # the same port, blocks and identity, joining through those servers and the swarm this one joined
            s.restart([o.address for o in peers if o.address] + self.swarm.join_peers)

    def peers_for(self, s) -> Optional[list]:
        """The servers ``s`` joins through on its restart: those up, or restarting with an address
        announced; [] (a new swarm, or the one it joined) when there is none; None to wait, while
        another server without an address yet restarts (two new swarms would not know each other).
        """
        others = [(o, w) for o, w in zip(self.swarm.servers, self.watches) if o is not s]
        peers = [o for o, w in others if w.state == "up" or (w.state == "starting" and o.address)]
        if not peers and not self.swarm.join_peers and any(w.state == "starting" for _, w in others):
            return None
        return peers

    def _died(self, s, watch: _Watch, now: float) -> None:
        how = (f"did not serve within {self.swarm.start_timeout:.0f} s of its restart" if watch.timed_out
               else describe_exit(s.returncode))
        if s.returncode > 0:  # it failed by itself: the end of its log says why
            how += f"; its log ({s.log_path}) ends: {s.tail(2)}"
        watch.died = now
        s.kill()  # its helpers (the DHT process, p2pd holding the port) outlive its main process
        while watch.restarts and watch.restarts[0] < now - self.policy.window:
            watch.restarts.popleft()
        if s.returncode == 0 and not watch.timed_out:
            self.log(f"{s.label} left the swarm ({how}: stopped on purpose, e.g. SIGTERM); not restarted"
                     f"{self._cover_note(s)}")
            watch.state = "down"  # after the line, as every state: whoever sees it finds the line said
            return
        if len(watch.restarts) >= self.policy.max_restarts:
            self.log(f"{s.label} died ({how}); not restarted: {len(watch.restarts)} restart(s) in the last "
                     f"{self.policy.window:.0f} s, the limit (--max-restarts {self.policy.max_restarts}, "
                     f"--restart-window {self.policy.window:.0f}); it stays down{self._cover_note(s)}")
            watch.state = "down"
            return
        delay = self.policy.delay(len(watch.restarts) + 1, self._rng)
        self.log(f"{s.label} died ({how}); restarting in {delay:.1f} s (restart {len(watch.restarts) + 1} of at "
                 f"most {self.policy.max_restarts} in {self.policy.window:.0f} s){self._cover_note(s)}")
        watch.state, watch.due = "waiting", now + delay

    def _cover_note(self, dead) -> str:
        """Whether the servers still up hold the dead one's blocks."""
        live = [s.blocks for s, w in zip(self.swarm.servers, self.watches)
                if w.state == "up" and s is not dead and s.poll() is None]  # not dead too, unseen yet
        missing = [b for b in range(*dead.blocks) if not any(a <= b < e for a, e in live)]
        if not missing:
            return "; the other servers still serve its blocks"
        return f"; blocks {ranges(missing)} have no live server meanwhile"

    def _note_coverage(self, now: float) -> None:
        first, last = self.swarm.block_range
        live = [s.blocks for s, w in zip(self.swarm.servers, self.watches) if w.state == "up"]
        unserved = [b for b in range(first, last) if not any(a <= b < e for a, e in live)]
        if unserved and self.unserved_since is None:
            self.unserved_since = now
        elif not unserved and self.unserved_since is not None:
            self.log(f"every block is served again (blocks {ranges(self.unserved)} had no live server for "
                     f"{now - self.unserved_since:.1f} s)")
            self.unserved_since = None
        self.unserved = unserved

    def failure(self) -> Optional[str]:
        """Why the swarm failed (its blocks stay unserved), or None while it serves or may serve again."""
        with self._watching:
            if self.unserved_since is None:
                return None
            unserved, since = list(self.unserved), time.monotonic() - self.unserved_since
            holders = [(s, w) for s, w in zip(self.swarm.servers, self.watches)
                       if any(a <= b < e for b in unserved for a, e in [s.blocks])]
        if since > self.policy.unserved_timeout:
            why = f"for {since:.0f} s (--unserved-timeout {self.policy.unserved_timeout:.0f})"
        elif all(w.state == "down" for _, w in holders):
            why = "and every server holding them stays down"
        else:
            return None
        down = ", ".join(f"{s.label}: {w.state}" for s, w in holders)
        return f"blocks {ranges(unserved)} have no live server {why} ({down}); read the servers' logs"


def ranges(blocks: List[int]) -> str:
    """[0, 1, 2, 5] -> "0:3, 5:6" (end exclusive, as --block-indices)."""
    spans: List[Tuple[int, int]] = []
    for b in blocks:
        if spans and spans[-1][1] == b:
            spans[-1] = (spans[-1][0], b + 1)
        else:
            spans.append((b, b + 1))
    return ", ".join(f"{a}:{e}" for a, e in spans)
