"""The ranks' fork server (tests/forked_ranks.py starts it; a process of its own, no thread).

It imports once what every ``python -m dist_eval`` rank imports (torch, datasets, transformers,
every dist_eval module: ~4 s of CPU a rank, most of a small run's), then, for each launch asked
for on its socket, forks a launcher that forks the ranks: each rank a real process of its own
in a real gloo group, running ``python -m dist_eval ARGS`` (or a script) from its ``__main__``,
with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...). The launcher does
what torchrun's agent does with its workers: it waits for them, and when one fails it stops the
others with SIGTERM (SIGKILL 30 s later); it reports every rank's exit code.

Usage: ``python tests/rank_zygote.py SOCKET`` (prints ``READY`` once it listens). A request is
one JSON line with the launch's stdout and stderr as passed file descriptors (SCM_RIGHTS):
``{"argv": ["-m", "dist_eval", ...] or [script, ...], "nproc": N (0: one process without torchrun's
environment, as a plain ``python -m dist_eval``), "env": {...}, "cwd": DIR,
"master_port": P, "path_prefix": [...], "preload": [...]}``; the answers, one JSON line each:
``{"pids": [...], "group": PGID}`` then ``{"codes": [...]}`` (a rank ended by a signal: minus its number).
"""
from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import pkgutil
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
import weakref

# torchrun's agent: how often it looks at its workers, how long it gives them after SIGTERM
MONITOR_INTERVAL = 0.1
CLOSE_TIMEOUT = 30.0
# what a rank imports whatever its arguments (and matplotlib's parts that rank 0 draws with: a launch
# that hides it, PYTHONPATH's stub first, gets it purged, see _unshadow)
PRELOAD = ["torch", "torch.distributed", "numpy", "datasets", "transformers", "scipy.special", "jinja2",
           "transformers.models.llama.modeling_llama", "transformers.models.bloom.modeling_bloom",
           "transformers.models.falcon.modeling_falcon", "matplotlib.figure", "matplotlib.backends.backend_agg"]


def preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    import dist_eval

    for module in pkgutil.walk_packages(dist_eval.__path__, "dist_eval."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)


def _exit_code(code) -> int:
    """Python's exit status for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _unshadow(prefix) -> None:
    """The modules that the launch's PYTHONPATH entries (put before the server's) hold, forgotten
    here: imported again, they come from there, as in a process started with that PYTHONPATH
    (e.g. a stub that hides matplotlib: tests/inprocess_cli.py's without_modules)."""
    names = set()
    for folder in prefix:
        try:
            entries = os.listdir(folder)
        except OSError:
            continue
        for entry in entries:
            if entry.endswith(".py"):
                names.add(entry[:-3])
            elif os.path.isfile(os.path.join(folder, entry, "__init__.py")):
                names.add(entry)
    for module in list(sys.modules):
        if module.split(".", 1)[0] in names:
            del sys.modules[module]


def _run_rank(request: dict, rank: int, out_fd: int, err_fd: int) -> None:
    """In the forked rank: torchrun's environment, the launch's stdout/stderr, the target run as
    ``python -u`` runs it; never returns."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        for fd in (devnull, out_fd, err_fd):
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # the zygote's own finalizers (none of this rank's) are not run at this rank's exit
        for finalizer in list(weakref.finalize._registry):
            finalizer.atexit = False
        nproc = request["nproc"]
        os.environ.clear()
        os.environ.update(request["env"])
        if nproc:  # nproc 0: one plain process, as `python -m dist_eval` without torchrun
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                              ROLE_NAME="default", WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                              GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(request["master_port"]), TORCHELASTIC_RESTART_COUNT="0",
                              TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=request["run_id"],
                              TORCHELASTIC_USE_AGENT_STORE="False", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
            os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.chdir(request["cwd"])
        if "hivemind" in sys.modules:  # as each torchrun rank has: a rank killed holding one hangs no other
            from dist_eval.backends.petals.shims import own_hivemind_locks

            own_hivemind_locks()
        # python -u: stdout and stderr unbuffered
        sys.stdin = open(0, closefd=False)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True,
                                      errors="backslashreplace")
        sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr
        argv = request["argv"]
        sys.path[:0] = request["path_prefix"]
        _unshadow(request["path_prefix"])
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                sys.path.insert(len(request["path_prefix"]), request["cwd"])
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                sys.path.insert(len(request["path_prefix"]), os.path.dirname(os.path.abspath(argv[0])))
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except BaseException:  # noqa: BLE001  (as the interpreter does with an uncaught exception)
            traceback.print_exc()
            code = 1
        # what the interpreter's exit does for the program (dist_eval's __main__ does this itself)
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        try:
            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _launch(conn: socket.socket, request: dict, out_fd: int, err_fd: int) -> None:
    """In the forked launcher (a session of its own): fork the ranks, answer their pids, wait for
    them as torchrun's agent does, answer their exit codes; never returns."""
    try:
        os.setsid()
        for name in request.get("preload", []):
            module, _, function = name.partition(":")
            imported = importlib.import_module(module)
            if function:
                getattr(imported, function)()
        ranks = {}
        for rank in range(max(1, request["nproc"])):
            pid = os.fork()
            if pid == 0:
                conn.close()
                _run_rank(request, rank, out_fd, err_fd)
            ranks[pid] = rank
        os.close(out_fd)
        os.close(err_fd)
        conn.sendall((json.dumps({"pids": sorted(ranks, key=ranks.get), "group": os.getpid()}) + "\n").encode())
        codes = [None] * len(ranks)
        stopping_since = None
        while any(code is None for code in codes):
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(MONITOR_INTERVAL)
            elif pid in ranks:
                codes[ranks[pid]] = os.waitstatus_to_exitcode(status)
            if stopping_since is None and any(code not in (None, 0) for code in codes):
                stopping_since = time.monotonic()  # a rank failed: the others are stopped, as torchrun does
                _signal_alive(ranks, codes, signal.SIGTERM)
            elif stopping_since is not None and time.monotonic() - stopping_since > CLOSE_TIMEOUT:
                _signal_alive(ranks, codes, signal.SIGKILL)
        conn.sendall((json.dumps({"codes": codes}) + "\n").encode())
    finally:
        os._exit(0)


def _signal_alive(ranks: dict, codes: list, sig: int) -> None:
    for pid, rank in ranks.items():
        if codes[rank] is None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _receive(conn: socket.socket):
    """(the request, its stdout and stderr descriptors)."""
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, more_fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
        if not chunk:
            raise EOFError("the request was cut short")
        data, fds = data + chunk, fds + list(more_fds)
    return json.loads(data), fds[0], fds[1]


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    listener.settimeout(0.2)
    print("READY", flush=True)
    parent = os.getppid()
    while os.getppid() == parent:  # the test process that started it is gone: so is this
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            conn = None
        while True:  # the launchers that ended
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if conn is None:
            continue
        conn.settimeout(None)
        try:
            request, out_fd, err_fd = _receive(conn)
        except (OSError, EOFError, ValueError, IndexError) as e:
            print(f"rank_zygote: a bad request: {e!r}", file=sys.stderr, flush=True)
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            _launch(conn, request, out_fd, err_fd)
        conn.close()
        os.close(out_fd)
        os.close(err_fd)


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as `python -m` has it: the ranks import nothing from tests/
    preload()
    serve(sys.argv[1])
