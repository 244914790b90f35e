"""Processes, process groups, sockets and ports, read from /proc: used by the local swarm,
the client's helpers and the ranks' view of their siblings.

Standard library only.
"""
from __future__ import annotations

import os
import signal
import socket
from typing import Dict, List, Sequence, Set, Tuple

_SIGINT_BIT = 1 << (signal.SIGINT - 1)

def proc_stat(pid: int) -> list | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().decode("utf-8", "replace").rpartition(")")[2].split()
    except OSError:
        return None


def start_time(pid: int) -> str | None:
    """When the process started (clock ticks since boot): tells a pid reused later apart."""
    fields = proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def is_running(pid: int, start_time: str | None = None) -> bool:
    """True while ``pid`` exists and is not a zombie (a dead child not reaped yet), and,
    with ``start_time``, is still the process that started then.
    """
    fields = proc_stat(pid)
    if not fields or fields[0] == "Z":
        return False
    return start_time is None or (len(fields) > 19 and fields[19] == start_time)


def child_pids(pid: int) -> list:
    """The live children of ``pid``, from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        fields = proc_stat(int(entry)) if entry.isdigit() else None
        if fields and len(fields) > 1 and int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(entry))
    return children


def _process_groups(pgids: Set[int]) -> Dict[int, List[Tuple[int, str]]]:
    """{pgid: [(pid, state), ...]} for every live process whose group is in ``pgids``."""
    found: Dict[int, List[Tuple[int, str]]] = {}
    if not pgids:
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        rest = stat.rpartition(")")[2].split()
        if len(rest) < 3:
            continue
        pgid = int(rest[2])
        if pgid in pgids:
            found.setdefault(pgid, []).append((int(entry), rest[0]))
    return found


def live_groups(pgids: Set[int]) -> Dict[int, List[int]]:
    """Like :func:`_process_groups`, without zombies (they hold no port and no memory)."""
    return {
        g: [p for p, st in procs if st != "Z"]
        for g, procs in _process_groups(pgids).items()
        if any(st != "Z" for _, st in procs)
    }


def unix_socket_paths(pids: Sequence[int]) -> Set[str]:
    """Paths of the unix sockets that these processes hold (hivemind never deletes some)."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    paths = set()
    try:
        with open("/proc/net/unix") as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("/"):
                    paths.add(parts[7])
    except OSError:
        pass
    return paths


def is_hivemind_socket(path: str) -> bool:
    """Whether a unix socket path is one hivemind made (``/tmp/hivemind-*``: p2pd's, a P2P client's)."""
    return os.path.basename(path).startswith("hivemind-")


def hivemind_socket_paths(pids: Sequence[int]) -> Set[str]:
    """The hivemind sockets (:func:`is_hivemind_socket`) these processes hold."""
    return {p for p in unix_socket_paths(pids) if is_hivemind_socket(p)}


def descendant_pids(pid: int) -> List[int]:
    """The live children of ``pid``, theirs, and so on, from /proc."""
    found, todo = [], [pid]
    while todo:
        children = child_pids(todo.pop())
        found += children
        todo += children
    return found


def remove_dead_hivemind_sockets(since: float, wait: float = 2.0) -> List[str]:
    """Remove the hivemind sockets in /tmp bound at or after ``since`` (``time.time()``) that no socket of
    any process holds (none in /proc/net/unix); the paths removed. hivemind removes a p2pd's socket only
    while the daemon runs: one that exited on its own (no peer answered at the initial peers) leaves it.
    Such a daemon (a child of this process, or of its DHT process) may still be exiting when the failure
    reaches this process: its socket is held a moment longer. So this waits up to ``wait`` seconds while a
    process under this one holds a hivemind socket bound since ``since``.
    """
    import glob
    import time

    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and any(
            _bound_since(path, since) for path in hivemind_socket_paths(descendant_pids(os.getpid()))):
        time.sleep(0.05)
    try:
        with open("/proc/net/unix") as f:
            held = {parts[7] for parts in map(str.split, f) if len(parts) >= 8}
    except OSError:
        return []  # no /proc: nothing can be told dead
    removed = []
    for path in glob.glob("/tmp/hivemind-*.sock"):
        try:
            if path not in held and _bound_since(path, since):
                os.remove(path)
                removed.append(path)
        except OSError:
            continue  # gone already, or another user's
    return removed


def _bound_since(path: str, since: float) -> bool:
    try:
        return os.stat(path).st_mtime >= since - 1.0  # file times are coarse
    except OSError:
        return False


def shm_managers_under(folder: str) -> List[int]:
    """The torch shared-memory managers whose socket is under ``folder``. torch starts one for
    processes that share tensors through files (hivemind's strategy) with its socket in their
    TMPDIR; it leaves their process group and session, outlives them by 2 s, frees the shared
    memory they left and removes its socket: with its folder gone first, it aborts there
    ("terminate called ... No such file or directory", in the output it inherited).
    """
    found, inside = [], folder.rstrip(os.sep) + os.sep
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/comm") as f:
                if not f.read().startswith("torch_shm_manag"):  # comm is cut at 15 characters
                    continue
        except (OSError, ValueError):
            continue
        if any(path.startswith(inside) for path in unix_socket_paths([int(entry)])):
            found.append(int(entry))
    return found


def ignores_sigint(pid: int) -> bool:
    """True when the process ignores SIGINT: it inherited SIG_IGN (e.g. its parent was a
    background job of a non-interactive shell), so Python never installed its handler.
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) & _SIGINT_BIT)
    except (OSError, ValueError):
        pass
    return False


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as p2pd does: TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError:
            return False
    return True


_reserved: Set[socket.socket] = set()  # open reservations of this process (closed in a forked child)


def reserve_ports(host: str, count: int = 0, ports: Sequence[int] = ()) -> List[socket.socket]:
    """Sockets that hold ``ports`` (or ``count`` ports the OS picks) on ``host`` until :func:`close_all`: bound,
    not listening, with SO_REUSEPORT set after the bind. Meanwhile no process gets such a port from the OS (a bind
    to port 0) or binds it without SO_REUSEPORT, yet a server of this user that binds it with SO_REUSEPORT, as p2pd
    does, can; and, not listening, they take none of the connections meant for that server. Why: a port found free
    and let go before its server bound it could be taken meanwhile by another p2pd of this user (a client's,
    listening on port 0), and the kernel then shares the port between the two daemons: a client sent to the server
    reached the other one about one time in three, and failed ("failed to connect to bootstrap peers").
    OSError (EADDRINUSE) if a port is taken: the bind, made before SO_REUSEPORT is set, is the check (a listener of
    any user's refuses it; a closed connection's TIME_WAIT does not, as for p2pd's own bind). A process forked
    from this one closes them (only the process that reserved them lets them go).
    """
    sockets: List[socket.socket] = []
    try:
        for port in [*ports, *[0] * count]:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    except OSError:
        close_all(sockets)
        raise
    _reserved.update(sockets)
    return sockets


def close_all(sockets: Sequence[socket.socket]) -> None:
    """Close ``sockets`` (reservations of :func:`reserve_ports`, or any)."""
    for s in list(sockets):
        _reserved.discard(s)
        s.close()


os.register_at_fork(after_in_child=lambda: close_all(_reserved))
