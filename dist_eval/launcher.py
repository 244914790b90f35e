"""``dist-eval``: torchrun's launcher run in-process, ending on the run's own error line.

    dist-eval [torchrun options] [-- dist_eval flags]
    dist-eval --nproc-per-node 4 -- --model DIR --data-files test.csv
    dist-eval --nnodes 2 --node-rank 0 --rdzv-endpoint HOST:29400 --nproc-per-node 8 -- --initial-peers ...

Everything before ``--`` goes to torchrun (``torchrun --help`` lists it; default: one rank
on this node), everything after it to ``python -m dist_eval``. ``torchrun -m dist_eval``
keeps working as it is; the difference is what a failure looks like. When a rank fails,
torchrun's own entry point prints its ``ChildFailedError`` report (about 30 lines) after
the run's ``dist_eval: error: ...`` line, burying it. This launcher lets torchrun start,
watch and stop the ranks exactly as it does, but keeps its launcher logs quiet and ends
with the run's last line and the failing rank's exit code (128 + N for a rank killed by
signal N). SIGINT/SIGTERM to it stop every rank, as they do to torchrun.
"""
from __future__ import annotations

import logging
import sys
from typing import List, Optional, Sequence, Tuple

PROG = "dist-eval"
_USAGE = (
    f"usage: {PROG} [torchrun options] [-- dist_eval flags]\n"
    f"  e.g. {PROG} --nproc-per-node 2 -- --model DIR --data-files test.csv\n"
    "  torchrun options: see `torchrun --help` (default: one rank on this node);\n"
    "  dist_eval flags: see `python -m dist_eval --help` (none: the built-in demo)."
)


def split_argv(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(torchrun options, dist_eval flags): split at the first ``--``; without one,
    every argument is a torchrun option."""
    argv = list(argv)
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1 :]
    return argv, []


def _exit_code(error) -> int:
    """The exit code of the rank that failed first (torchrun stops the others after it),
    as a shell reports it: 128 + N for a rank killed by signal N."""
    if not getattr(error, "failures", None):
        return 1
    _, failure = error.get_first_failure()
    code = failure.exitcode
    return 128 - code if code < 0 else (code or 1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``torchrun [torchrun options] -m dist_eval [dist_eval flags]`` in this process."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip().split("\n\n")[0] + "\n\n" + _USAGE)
        return 0
    torchrun_options, flags = split_argv(argv)
    if any(not option.startswith("-") for option in torchrun_options[:1]):
        print(f"{PROG}: error: {torchrun_options[0]!r}: expected torchrun options before '--' and dist_eval flags "
              f"after it.\n{_USAGE}", file=sys.stderr, flush=True)
        return 2

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torchrun's launcher logs (rendezvous, "closing signal SIGTERM", the failure report)
    # repeat what the ranks already said; the ranks' own output is untouched.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.run").setLevel(logging.CRITICAL)
    try:
        args = parse_args([*torchrun_options, "-m", "dist_eval", *flags])
    except SystemExit as e:  # argparse has printed its own one-line error
        return int(e.code or 0)
    try:
        run(args)
    except ChildFailedError as e:
        return _exit_code(e)
    except SignalException as e:  # SIGTERM/SIGINT to the launcher: torchrun has stopped the ranks
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
