"""``torchrun --nproc_per_node=N -m dist_eval [flags]``: the flags, the exit codes, the signals.

flags -> :class:`dist_eval.config.EvalConfig` -> :func:`dist_eval.pipeline.run` (the
run, phase by phase). A failure is agreed on by every rank (:func:`dist_eval.ranks.phase`)
and printed once, as one line naming the flag; the exit code says what kind it was.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from typing import List, Optional

from dist_eval import ranks
from dist_eval.config import EvalConfig, default_of, flag_fields, shard_from_slurm
from dist_eval.errors import UsageError, flag_names, stopping
from dist_eval.ranks.siblings import Siblings, dead_main_rank, sibling_ranks

EXIT_USAGE = 2
EXIT_FAILURE = 1


def build_parser() -> argparse.ArgumentParser:
    """The flags, generated from the declarations of :mod:`dist_eval.config` (one per field)."""
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node=N -m dist_eval",
        description=(
            "Evaluate a classifier served by a Petals swarm (or locally), sharded over torchrun ranks, "
            "exactly: every row counted once. With no --model/--data-files it runs the built-in demo "
            "(a local swarm, a small prompt-tuned model, a synthetic 4-class task)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for title, group_fields in flag_fields().items():
        group = parser.add_argument_group(title)
        for f in group_fields:
            group.add_argument(flag_of(f.name), dest=f.name, **_argparse_kwargs(f))
    return parser


def flag_of(name: str) -> str:
    """The CLI flag of a setting: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


def _argparse_kwargs(f) -> dict:
    kwargs = {"help": f.metadata["help"], "default": default_of(f)}
    if f.type in ("bool", bool):
        # a switch that is on by default also gets its --no-... form
        kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        return kwargs
    kwargs["type"] = int if "int" in str(f.type) else float if "float" in str(f.type) else str
    kwargs.update(f.metadata["flag"])
    return kwargs


def checked_config(**flags) -> EvalConfig:
    """The run's :class:`EvalConfig`, with what it cannot check itself checked here, before the
    first phase: the model folder's family, the demo's family, the local swarm's device
    request, the tracker's package.
    """
    from dist_eval.backends.config_json import family_of_folder
    from dist_eval.backends.peft_adapter import refuse_as_model
    from dist_eval.demo import shipped_families
    from dist_eval.output.tracking import check_tracker
    from dist_eval.receipt import check_signing_key
    from dist_eval.swarm.devices import DEVICE_REQUEST

    if flags.get("shard") is None:  # a SLURM job array's task: its shard of the array
        flags["shard"] = shard_from_slurm(os.environ)
    config = EvalConfig(**flags)
    if not isinstance(config.local_device, str) or not DEVICE_REQUEST.fullmatch(config.local_device):
        raise UsageError("expected auto, cpu, cuda (every visible GPU) or cuda:K.", param="local_device",
                         value=config.local_device)
    check_tracker(config.report_to)  # a missing wandb/tensorboard fails here, before any work
    check_signing_key(config.sign)  # --sign KEY: an Ed25519 private key, before any work
    if config.model is not None:  # a file, or a PEFT adapter's folder, named as what it is
        refuse_as_model(config.model)
    if config.model is not None and os.path.isdir(config.model):  # a hub id: once its config is fetched
        family_of_folder(config.model)  # a family petals cannot serve is refused here
    elif config.demo_family is not None and config.demo_family not in shipped_families():
        raise UsageError(f"expected one of {', '.join(shipped_families())} (the families whose demo ships with "
                         "dist_eval).", param="demo_family", value=config.demo_family)
    return config


def _print_error(message: str) -> None:
    # One line, on rank 0 only when the failure is shared by every rank.
    print(f"dist_eval: error: {message}", file=sys.stderr, flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    from dist_eval.backends.compat import quiet_third_party_output

    quiet_third_party_output()
    args = build_parser().parse_args(argv)
    with flag_names():  # errors name --flags, not API arguments
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    config, config_error = None, None
    try:
        config = checked_config(**vars(args))
    except UsageError as e:
        config_error = e  # every rank finds the same one: agreed on below, printed by rank 0
    owns_group = False
    # torchrun stops the surviving ranks with SIGTERM when one fails; by default that kills
    # Python on the spot, orphaning the petals client's DHT and p2pd children and (on rank
    # 0) the local swarm. Turned into an exception, every cleanup below runs.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)
        _reset_signals_in_forked_children()
        _exit_within_grace_after_a_signal()
    global _cli_running, _exit_decided
    _cli_running, _exit_decided = True, False
    try:
        timeout = config.dist_timeout if config else EvalConfig.dist_timeout  # its default
        try:
            owns_group = ranks.init_process_group_from_env(timeout, config.dist_backend if config else "gloo")
        except UsageError as e:  # no NCCL here: the ranks agree on it over gloo, and rank 0 prints it once
            owns_group = ranks.init_process_group_from_env(timeout, "gloo")
            config_error = config_error or e
        # Even a flag error goes through an agreement: a rank that exited at once would
        # make torchrun stop rank 0 before it had printed the error.
        global _siblings
        _siblings = sibling_ranks()  # every rank exists once the group is joined
        with ranks.phase("checking the flags"):
            if config_error is not None:
                raise config_error
        from dist_eval.pipeline import run

        return run(config)
    except ranks.RankFailure as e:
        _decided()
        if ranks.get_rank() == 0 or not (e.usage or e.shared):  # a failure every rank met: printed once
            _print_error(str(e))
        ranks.barrier_if_alive()  # no rank exits (and gets rank 0 stopped) before rank 0 has printed
        return EXIT_USAGE if e.usage else EXIT_FAILURE
    except UsageError as e:
        _decided()
        _print_error(str(e))
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        _report_interrupt(e)
        return 130
    finally:
        if owns_group:
            ranks.destroy_process_group()
        _cli_running = False


def _report_interrupt(e: KeyboardInterrupt) -> None:
    """One line for the whole run: from rank 0 (every rank was signalled), or, when rank 0
    itself died, from the lowest surviving rank of its node.
    """
    kept = "nothing reported; finished batches are kept for a resume"
    _signal_checked.wait(timeout=2.0)  # the watcher's look at rank 0 when the signal came
    dead = _dead_main_rank_at_signal
    if dead is not None:
        _print_error(f"rank 0 (pid {dead}) died (killed, or out of memory: see the system log); torchrun stopped "
                     f"the other ranks; {kept}")
    elif ranks.get_rank() == 0:
        why = " (torchrun stops every rank when one of them fails; a job scheduler on cancel)" if isinstance(
            e, Terminated) else ""
        _print_error(f"interrupted by {str(e) or 'SIGINT'}{why}; stopped cleanly, {kept}")


class Terminated(KeyboardInterrupt):
    """SIGTERM received (torchrun stopping this rank, or a job scheduler)."""


# After SIGINT/SIGTERM, a rank has this long to clean up (stop its client, flush its
# partial results, stop the local swarm: benchmarks/RESULTS.md) before it exits regardless.
STOP_GRACE_SECONDS = 10.0
_cli_running = False
_exit_decided = False  # set once the exit code is known: a later SIGTERM lets it stand
_siblings: Siblings = {}  # this node's ranks, noted at the start (see dist_eval.ranks.siblings)
_dead_main_rank_at_signal: Optional[int] = None  # rank 0's pid if it was dead when this rank was signalled
_signal_checked = threading.Event()
_grace_watch_started = False
_fork_hook_registered = False
_wakeup_sockets = None


def _exit_within_grace_after_a_signal() -> None:
    """Make SIGINT/SIGTERM end this process within ``STOP_GRACE_SECONDS``, stuck or not.

    The Python handler that turns SIGTERM into an exception runs only when the main
    thread runs Python code; a rank blocked in a collective, or in a C call waiting on a
    frozen peer, would not stop until torchrun's SIGKILL 30 s later. Python writes each
    signal's number to the wakeup fd at once, from C; a thread reading it gives the
    cleanup its grace, then exits the process. The watchdogs of the client's helpers and
    of the local swarm then stop what the process started.
    """
    global _grace_watch_started, _wakeup_sockets
    if _grace_watch_started:
        return
    import socket

    reader, writer = _wakeup_sockets = socket.socketpair()  # kept: closing them would free the fd
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def watch() -> None:
        global _dead_main_rank_at_signal
        while True:
            received = reader.recv(1)
            if received and received[0] in (signal.SIGINT, signal.SIGTERM):
                break
        stopping.set()  # at once, from C's note of the signal: requests it cuts short blame no server
        # Now, not later: rank 0 already gone when the signal comes means torchrun is stopping
        # the survivors of its death; alive means it got the signal too (and reports it).
        _dead_main_rank_at_signal = dead_main_rank(_siblings, ranks.get_rank())
        _signal_checked.set()
        time.sleep(STOP_GRACE_SECONDS)
        if _cli_running:
            if ranks.get_rank() == 0 or _dead_main_rank_at_signal is not None:
                _print_error(f"stopped by {signal.Signals(received[0]).name}: the cleanup was still waiting "
                             f"{STOP_GRACE_SECONDS:.0f} s later (on another rank or the swarm); exited at once")
            os._exit(128 + received[0])

    threading.Thread(target=watch, name="dist_eval-signal-grace", daemon=True).start()
    _grace_watch_started = True


def _reset_signals_in_forked_children() -> None:
    """Processes forked from a rank (hivemind's DHT process) get SIGTERM's default back and
    drop the rank's wakeup fd: the rank's handler printed a traceback ending in
    ``Terminated: SIGTERM`` in a helper instead of letting it stop.
    """
    global _fork_hook_registered
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_reset_signal_handling_in_child)
        _fork_hook_registered = True


def _reset_signal_handling_in_child() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(ValueError):  # only the main thread may; a fork from a thread has none
        signal.set_wakeup_fd(-1)


def _decided() -> None:
    """The run's exit code is decided (a failure agreed on, or met alone): a SIGTERM from now
    on does not change it. Under ``srun --kill-on-bad-exit`` the first node to exit gets the
    others' processes signalled while they exit with the same code (dist_eval.launcher).
    """
    global _exit_decided
    _exit_decided = True


def _raise_interrupt(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: do not interrupt the cleanup itself
    if not _exit_decided:
        raise Terminated(signal.Signals(signum).name)
