"""A server's state, told to the swarm process that started it through a file, not its log.

``--state_file PATH`` (ours, not petals': :mod:`dist_eval.swarm.server` takes it off the command
line) names the file; the server's main process rewrites it whole at each change (:func:`report`)
and the swarm reads it (:func:`read`, in :class:`~dist_eval.swarm.process.ServerProcess`), trusting
only what the process it started wrote (the file names that pid). The swarm used to match petals'
log lines ("Running a server on", "Started") and the drain's: wording and log levels are no interface.

The states, in order: :data:`JOINING` (its DHT runs: ``addresses`` known, its blocks loading),
:data:`UP` (its blocks served), :data:`DRAINING` (told to stop: new requests refused, those in flight
finishing), :data:`DRAINED` (they finished; petals' shutdown goes on); :data:`FAILED` (its start
raised: ``error``). Standard library only.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from dist_eval.atomic import atomic_write

FLAG = "--state_file"
JOINING, UP, DRAINING, DRAINED, FAILED = "joining", "up", "draining", "drained", "failed"

_target: dict = {}  # where this server process reports ("path"), who it is ("pid"), what it said ("fields")


def use(path: Optional[str]) -> None:
    """Have this process's :func:`report` write to ``path`` (None: report nothing)."""
    _target.clear()
    if path:
        _target.update(path=path, pid=os.getpid(), fields={})


def report(state: str, **fields) -> None:
    """Write ``state`` and ``fields`` (kept for later reports: the addresses stay) where :func:`use` said;
    nothing without it, nor in a process the server forked (its connection handlers).
    """
    if not _target or os.getpid() != _target["pid"]:
        return
    _target["fields"].update(fields)
    atomic_write(_target["path"], json.dumps({"pid": _target["pid"], "state": state, **_target["fields"]}))


def read(path: str, pid: Optional[int]) -> dict:
    """The last report of process ``pid`` at ``path``; {} before its first (or where another process wrote)."""
    try:
        with open(path) as f:
            said = json.load(f)
    except (OSError, ValueError):
        return {}
    return said if isinstance(said, dict) and pid is not None and said.get("pid") == pid else {}
