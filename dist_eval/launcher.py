"""``dist-eval``: torchrun's launcher run in-process, ending on the run's own error line.

    dist-eval [torchrun options] [-- dist_eval flags]
    dist-eval --nproc-per-node 4 -- --model DIR --data-files test.csv
    dist-eval --nnodes 2 --node-rank 0 --rdzv-endpoint HOST:29400 --nproc-per-node 8 -- --initial-peers ...
    dist-eval merge SHARD_DIR... --output-dir OUT     (python -m dist_eval.shard_merge: shards merged)
    dist-eval verify OUT [--backend local]            (python -m dist_eval.verify: a report checked)

Everything before ``--`` goes to torchrun (``torchrun --help`` lists it; default: one rank
on this node), everything after it to ``python -m dist_eval``. ``torchrun -m dist_eval``
keeps working as it is; the difference is what a failure looks like. When a rank fails,
torchrun's own entry point prints its ``ChildFailedError`` report (about 30 lines) after
the run's ``dist_eval: error: ...`` line, burying it. This launcher lets torchrun start,
watch and stop the ranks exactly as it does, but keeps its launcher logs quiet and ends
with the run's last line and the failing rank's exit code (128 + N for a rank killed by
signal N). SIGINT/SIGTERM to it stop every rank, as they do to torchrun.

One exit code, whatever the timing: a scheduler that stops the other nodes of a job when
one node fails (``srun --kill-on-bad-exit``) sends SIGTERM to this launcher while its ranks
are already exiting with the code they agreed on (2 for a usage error, every rank of every
node). When every rank of this node ended with a code of the run's own (0, 1, 2) rather
than by the signal, that code is this launcher's too, not 128 + 15.

And whichever node's launcher ends first: the rendezvous host's leaves when its own ranks
have ended after a failure (torchrun waits for the other nodes after a success only), taking
the rendezvous store with it. The other nodes' launchers then neither end with a traceback
(their poll for nodes waiting to join) nor print torch's C++ store warnings: their ranks'
own exit codes stand.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from typing import Dict, List, Optional, Sequence, Tuple

PROG = "dist-eval"
_USAGE = (
    f"usage: {PROG} [torchrun options] [-- dist_eval flags]\n"
    f"  e.g. {PROG} --nproc-per-node 2 -- --model DIR --data-files test.csv\n"
    f"  {PROG} merge SHARD_DIR... --output-dir OUT: the shards of a run (--shard I/K) merged into its report\n"
    f"  {PROG} verify OUT [--backend local]: a finished report checked against its receipt and its rows\n"
    "  torchrun options: see `torchrun --help` (default: one rank on this node);\n"
    "  dist_eval flags: see `python -m dist_eval --help` (none: the built-in demo)."
)


def split_argv(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(torchrun options, dist_eval flags): split at the first ``--``; without one,
    every argument is a torchrun option.
    """
    argv = list(argv)
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1 :]
    return argv, []


def _exit_code(error) -> int:
    """The exit code of the rank that failed first (torchrun stops the others after it),
    as a shell reports it: 128 + N for a rank killed by signal N.
    """
    if not getattr(error, "failures", None):
        return 1
    _, failure = error.get_first_failure()
    code = failure.exitcode
    return 128 - code if code < 0 else (code or 1)


# the exit codes of a run that ended on its own (dist_eval.cli: success, EXIT_FAILURE, EXIT_USAGE)
RUN_CODES = (0, 1, 2)


@contextlib.contextmanager
def _noting_rank_exit_codes(codes: Dict[int, Optional[int]]):
    """While torchrun runs: each time it closes its ranks (``SubprocessContext.close``,
    after a signal too), ``codes`` gets their exit codes (local rank -> code; negative:
    killed by that signal).
    """
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    original = SubprocessContext.close

    def close(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            for local_rank, handler in getattr(self, "subprocess_handlers", {}).items():
                codes[local_rank] = handler.proc.poll()

    SubprocessContext.close = close
    try:
        yield codes
    finally:
        SubprocessContext.close = original


@contextlib.contextmanager
def _outliving_the_rendezvous_host():
    """While torchrun runs: its poll of the rendezvous for nodes waiting to join (each
    monitoring round while the ranks run) answers 0 once the host's store is gone, rather than
    raising. The host's launcher leaves as soon as its ranks end after a failure; a node whose
    ranks took longer to exit (with the code every rank agreed on) had them killed and ended
    with a traceback and exit code 1. No node can wait on a rendezvous whose host has gone; a
    host that died mid-run fails this node's ranks in their next collective, with their own error.
    """
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    original = DynamicRendezvousHandler.num_nodes_waiting

    def num_nodes_waiting(self) -> int:
        try:
            return original(self)
        except RendezvousConnectionError:
            return 0

    DynamicRendezvousHandler.num_nodes_waiting = num_nodes_waiting
    try:
        yield
    finally:
        DynamicRendezvousHandler.num_nodes_waiting = original


def _import_torch_without_cpp_warnings() -> None:
    """Import torch with its C++ log level at ERROR for this process only: c10d's warnings
    about a store that went away (the rendezvous host's launcher, gone first: "recvValueWithTimeout
    failed ... Did the remote server shutdown or crash?", 20 lines of C++ frames) come from the
    launcher, not the run. torch reads TORCH_CPP_LOG_LEVEL once, at import; the ranks started
    afterwards inherit the environment as it was. A level the caller set is kept.
    """
    if "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def _code_after_signal(sigval: int, codes: Dict[int, Optional[int]]) -> int:
    """128 + the signal, unless every rank ended with a code of the run's own: that one
    (the first non-zero; 0 when all succeeded).
    """
    ended = list(codes.values())
    if ended and all(code in RUN_CODES for code in ended):
        return next((code for code in ended if code), 0)
    return 128 + int(sigval)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``torchrun [torchrun options] -m dist_eval [dist_eval flags]`` in this process."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip().split("\n\n")[0] + "\n\n" + _USAGE)
        return 0
    if argv[:1] == ["merge"]:  # dist-eval merge SHARD_DIR... --output-dir OUT: the shards' merge, this process
        os.execv(sys.executable, [sys.executable, "-m", "dist_eval.shard_merge", *argv[1:]])
    if argv[:1] == ["verify"]:  # dist-eval verify OUT ...: a report checked (python -m dist_eval.verify), this process
        os.execv(sys.executable, [sys.executable, "-m", "dist_eval.verify", *argv[1:]])
    torchrun_options, flags = split_argv(argv)
    if any(not option.startswith("-") for option in torchrun_options[:1]):
        print(f"{PROG}: error: {torchrun_options[0]!r}: expected torchrun options before '--' and dist_eval flags "
              f"after it.\n{_USAGE}", file=sys.stderr, flush=True)
        return 2

    _import_torch_without_cpp_warnings()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torchrun's launcher logs (rendezvous, "closing signal SIGTERM", the failure report)
    # repeat what the ranks already said; the ranks' own output is untouched.
    # torch's elastic loggers each have a level of their own (LOGLEVEL, WARNING): every one of them,
    # or "Received 15 death signal, shutting down workers" follows a scheduler's cancel
    for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic", "torch.distributed.run"]:
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        args = parse_args([*torchrun_options, "-m", "dist_eval", *flags])
    except SystemExit as e:  # argparse has printed its own one-line error
        return int(e.code or 0)
    codes: Dict[int, Optional[int]] = {}
    try:
        with _noting_rank_exit_codes(codes), _outliving_the_rendezvous_host():
            try:
                run(args)
            finally:  # the ranks have ended: a SIGTERM now (srun stopping the job's other nodes) changes nothing
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ChildFailedError as e:
        return _exit_code(e)
    except SignalException as e:  # SIGTERM/SIGINT to the launcher: torchrun has stopped the ranks
        return _code_after_signal(e.sigval, codes)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
