"""``torchrun --nproc_per_node=N -m dist_eval [flags]``: flags -> config -> evaluate -> report.

Every phase that can fail on one rank ends in an agreement (all ranks learn of the
failure and exit non-zero together); rank 0 alone prints and writes the report.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import signal
import sys
import threading
import time
from typing import Callable, List, Optional

from dist_eval import distributed as D
from dist_eval.config import EvalConfig, config_fields
from dist_eval.errors import UsageError

EXIT_USAGE = 2
EXIT_FAILURE = 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node=N -m dist_eval",
        description=(
            "Evaluate a classifier served by a Petals swarm (or locally), sharded over torchrun ranks, "
            "exactly: every row counted once. With no --model/--data-files it runs the built-in demo "
            "(a local swarm, a small prompt-tuned model, a synthetic 4-class task)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in config_fields():
        flag = "--" + f.name.replace("_", "-")
        kwargs = {"help": f.metadata["help"], "default": f.default}
        if f.type in ("bool", bool):
            # a switch that is on by default also gets its --no-... form
            kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        else:
            kwargs["type"] = {"int": int, "float": float, "Optional[int]": int}.get(str(f.type), str)
            for key in ("nargs", "choices"):
                if key in f.metadata:
                    kwargs[key] = f.metadata[key]
        parser.add_argument(flag, dest=f.name, **kwargs)
    return parser


def _print_error(message: str) -> None:
    # One line, on rank 0 only when the failure is shared by every rank.
    print(f"dist_eval: error: {message}", file=sys.stderr, flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    from dist_eval.compat import quiet_third_party_output

    quiet_third_party_output()
    args = build_parser().parse_args(argv)
    config, config_error = None, None
    try:
        config = EvalConfig(**vars(args))
    except UsageError as e:
        config_error = e  # every rank finds the same one: agreed on below, printed by rank 0
    owns_group = False
    # torchrun stops the surviving ranks with SIGTERM when one fails; by default that kills
    # Python on the spot, orphaning the petals client's DHT and p2pd children and (on rank
    # 0) the local swarm. Turned into an exception, every cleanup below runs.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)
        _default_sigterm_in_forked_children()
        _exit_within_grace_after_a_signal()
    global _cli_running
    _cli_running = True
    try:
        timeout = config.dist_timeout if config else EvalConfig.__dataclass_fields__["dist_timeout"].default
        owns_group = D.init_process_group_from_env(timeout)
        # Even a flag error goes through an agreement: a rank that exited at once would
        # make torchrun stop rank 0 before it had printed the error.
        D.agree_on_failure("checking the flags", config_error)
        return _run(config)
    except D.RankFailure as e:
        if D.get_rank() == 0 or not e.usage:
            _print_error(str(e))
        D.barrier_if_alive()  # no rank exits (and gets rank 0 stopped) before rank 0 has printed
        return EXIT_USAGE if e.usage else EXIT_FAILURE
    except UsageError as e:
        _print_error(str(e))
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        why = " (torchrun stops every rank when one of them fails; a job scheduler on cancel)" if isinstance(
            e, Terminated) else ""
        if D.get_rank() == 0:  # every rank was signalled; rank 0 says so for all
            _print_error(f"interrupted by {e or 'SIGINT'}{why}; stopped cleanly, nothing reported; finished batches "
                         "are kept for a resume")
        return 130
    finally:
        if owns_group:
            D.destroy_process_group()
        _cli_running = False


class Terminated(KeyboardInterrupt):
    """SIGTERM received (torchrun stopping this rank, or a job scheduler)."""


_fork_hook_registered = False


def _default_sigterm_in_forked_children() -> None:
    """Processes forked from a rank (hivemind's DHT process) get SIGTERM's default back:
    the handler above belongs to the rank, and in a helper it printed a traceback ending
    in ``Terminated: SIGTERM`` instead of letting the helper stop."""
    global _fork_hook_registered
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_reset_signal_handling_in_child)
        _fork_hook_registered = True


def _reset_signal_handling_in_child() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(ValueError):  # the wakeup fd is the rank's (a fork from a thread keeps it)
        signal.set_wakeup_fd(-1)


# After SIGINT/SIGTERM, a rank has this long to clean up (stop its client, flush its
# partial results, stop the local swarm: 2-5 s measured) before it exits regardless.
STOP_GRACE_SECONDS = 10.0
_cli_running = False
_grace_watch_started = False
_wakeup_sockets = None


def _exit_within_grace_after_a_signal() -> None:
    """Make SIGINT/SIGTERM end this process within ``STOP_GRACE_SECONDS``, stuck or not.

    The Python handler that turns SIGTERM into an exception runs only when the main
    thread runs Python code; a rank blocked in a collective, or in a C call waiting on
    a dead peer, would not stop until torchrun's SIGKILL 30 s later (orphaning its
    helpers when no watchdog is there). Python writes each signal's number to the
    wakeup fd at once, from C; a thread reading it gives the cleanup its grace, then
    exits the process. The helpers' and the local swarm's watchdogs then stop what the
    process started.
    """
    global _grace_watch_started
    if _grace_watch_started:
        return
    import socket

    global _wakeup_sockets
    reader, writer = _wakeup_sockets = socket.socketpair()  # kept: closing them would free the fd
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            received = reader.recv(1)
            if received and received[0] in (signal.SIGINT, signal.SIGTERM):
                break
        time.sleep(STOP_GRACE_SECONDS)
        if _cli_running:
            if D.get_rank() == 0:
                _print_error(f"stopped by {signal.Signals(received[0]).name}: the cleanup was still waiting "
                             f"{STOP_GRACE_SECONDS:.0f} s later (on another rank or the swarm); exited at once")
            os._exit(128 + received[0])

    threading.Thread(target=watch, name="dist_eval-signal-grace", daemon=True).start()
    _grace_watch_started = True


def _barrier_unless_interrupted(exc_type, exc, tb) -> None:
    """An exit callback: wait for the other ranks, except after SIGINT/SIGTERM, when they
    may be gone (torchrun stops them all when one dies) and a collective would fail."""
    if exc_type is None or not issubclass(exc_type, KeyboardInterrupt):
        D.barrier_if_alive()


def _raise_interrupt(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: do not interrupt the cleanup itself
    raise Terminated(signal.Signals(signum).name)


def _attempt(fn: Callable):
    """(result, None) or (None, the exception): failures are shared, not raised alone."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - the other ranks must hear of it
        return None, e


def _on_main_then_broadcast(phase: str, fn: Callable):
    """Run ``fn`` on rank 0; every rank gets its result, or every rank raises."""
    result, error = _attempt(fn) if D.is_main_process() else (None, None)
    D.agree_on_failure(phase, error)
    return D.broadcast_object(result)


def _on_every_rank(phase: str, fn: Callable, main_first: bool = False):
    """Run ``fn`` on every rank; with ``main_first``, rank 0 runs it before the others
    (e.g. to fill the datasets cache they then read)."""
    if not main_first:
        result, error = _attempt(fn)
        D.agree_on_failure(phase, error)
        return result
    result, error = _attempt(fn) if D.is_main_process() else (None, None)
    D.agree_on_failure(phase, error)
    if not D.is_main_process():
        result, error = _attempt(fn)
    D.agree_on_failure(phase, error)
    return result


def _resume_folder(config, model_dir, checkpoint, dataset, split, text_column, label_column, model, say) -> Optional[str]:
    """Rank 0: the folder for this run's partial results, keyed by what decides them.

    Partial results of another model, checkpoint, data or settings are never mixed in:
    they are removed, and the run says so. With --no-resume everything stored is removed.
    """
    from dist_eval import partial

    key = partial.run_key(model_dir, checkpoint, partial.data_fingerprint(dataset), {
        "backend": config.backend, "split": split, "text": text_column, "text_pair": config.text_pair_column,
        "label": label_column, "num_labels": model.num_labels, "tuning_mode": config.tuning_mode,
        "pre_seq_len": config.pre_seq_len, "batch_size": config.batch_size, "max_length": config.max_length,
        "length_buckets": config.length_buckets, "max_batch_tokens": config.max_batch_tokens,
    })
    folder = os.path.join(config.output_dir, partial.SUBDIR, key)
    stale = partial.stale_runs(config.output_dir, key) + ([folder] if not config.resume and os.path.isdir(folder) else [])
    if stale:
        why = "--no-resume" if not config.resume else "made by another model, checkpoint, data or settings"
        # a warning, shown in --quiet mode too: stored work is being thrown away
        print(f"dist_eval: warning: removing stored partial results ({why}): {', '.join(stale)}; starting clean",
              file=sys.stderr, flush=True)
        partial.remove(stale)
    elif os.path.isdir(folder):
        say(f"dist_eval: resuming: reusing the stored results in {folder}", flush=True)
    os.makedirs(folder, exist_ok=True)
    return folder


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for package in ("dist_eval", "torch", "transformers", "datasets", "petals", "hivemind"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def _run(config: EvalConfig) -> int:
    started = time.perf_counter()
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    world_size = D.get_world_size()
    say = print if D.is_main_process() and not config.quiet else (lambda *a, **k: None)

    def prepare():
        from dist_eval.report import check_output_dir

        check_output_dir(config.output_dir)
        if not config.is_demo:
            return None
        from dist_eval.demo import demo_assets

        return demo_assets(log=lambda line: say(line, flush=True))

    demo = _on_main_then_broadcast("preparing the run", prepare)
    model_dir, data_files = config.model, config.data_files
    split, text_column, label_column, checkpoint = config.split, config.text_column, config.label_column, config.checkpoint
    if demo is not None:
        model_dir, data_files, split = demo.model_dir, [demo.data_dir], demo.split
        text_column, label_column, checkpoint = demo.text_column, demo.label_column, demo.checkpoint

    with contextlib.ExitStack() as cleanup:
        initial_peers, dht_prefix = config.initial_peers, config.dht_prefix
        if config.backend == "petals" and not initial_peers:

            def start_swarm():
                from dist_eval.swarm import LocalSwarm

                if D.launched_on_several_nodes():  # its servers listen on 127.0.0.1 of rank 0's node only
                    raise UsageError(
                        "--initial-peers: omitted on a run over several nodes, but the local swarm started then "
                        "is reachable from rank 0's node only. Start servers every node can reach "
                        "(launch/start_server.sh on a host, HOST=<its IP>) and pass the INITIAL_PEERS=... they "
                        "print with --initial-peers, and their --dht-prefix."
                    )
                say(f"dist_eval: starting a local swarm of {config.local_servers} server(s) for {model_dir} ...", flush=True)
                swarm = LocalSwarm(model_dir, num_servers=config.local_servers, dht_prefix=dht_prefix)
                cleanup.enter_context(swarm)  # stopped when the run ends, whatever happens
                return swarm.initial_peers, swarm.dht_prefix

            initial_peers, dht_prefix = _on_main_then_broadcast("starting the local swarm", start_swarm)

        def load_data():
            from dist_eval.data import load_split

            return load_split(data_files, split)

        # rank 0 first: it fills the datasets cache that the others then read
        dataset = _on_every_rank("loading the data", load_data, main_first=True)

        def load():
            from transformers import AutoTokenizer

            from dist_eval.backends import load_model

            try:
                tokenizer = AutoTokenizer.from_pretrained(model_dir)
            except Exception as e:
                raise UsageError(
                    f"--model {model_dir}: no usable tokenizer in the folder ({type(e).__name__}). "
                    "Save the tokenizer there too (tokenizer.save_pretrained(folder))."
                ) from e
            loaded = load_model(
                config.backend, model_dir, checkpoint=checkpoint, tuning_mode=config.tuning_mode,
                pre_seq_len=config.pre_seq_len, num_labels=config.num_labels, initial_peers=initial_peers,
                dht_prefix=dht_prefix, swarm_timeout=config.swarm_timeout,
            )
            return tokenizer, loaded

        tokenizer, model = _on_every_rank("loading the model", load)
        cleanup.push(_barrier_unless_interrupted)  # no rank's client is still talking when rank 0 stops the swarm
        cleanup.callback(model.close)

        def prepare_resume():
            return _resume_folder(config, model_dir, checkpoint, dataset, split, text_column, label_column, model, say)

        resume_folder = _on_main_then_broadcast("reading the stored partial results", prepare_resume)

        from dist_eval.progress import GlobalProgress
        from dist_eval.run import evaluate

        say(f"dist_eval: evaluating {len(dataset)} rows on {world_size} rank(s) with the {config.backend} backend ...", flush=True)
        # every rank creates it here (one broadcast); rank 0 shows all ranks' rows on stderr
        progress = GlobalProgress(len(dataset), config.progress, quiet=config.quiet)
        cleanup.callback(progress.close, completed=False)  # ends a bar's line if the evaluation fails
        progress.start()
        result = evaluate(
            model, dataset, tokenizer=tokenizer, text_column=text_column, text_pair_column=config.text_pair_column,
            label_column=label_column, batch_size=config.batch_size, max_length=config.max_length,
            return_logits=config.save_logits, length_buckets=config.length_buckets,
            max_batch_tokens=config.max_batch_tokens or None, in_flight=config.in_flight,
            on_batch_done=progress.update, bootstrap_resamples=config.bootstrap_resamples, bootstrap_seed=config.bootstrap_seed,
            resume_folder=resume_folder, save_interval=config.save_interval,
        )
        progress.close()
        metrics = result.metrics
        metrics["run"].update(
            backend=config.backend,
            model=os.path.abspath(model_dir),
            data_files=[os.path.abspath(p) if os.path.exists(p) else p for p in data_files],
            split=split,
            checkpoint=os.path.abspath(checkpoint) if checkpoint else None,
            demo=demo is not None,
            batch_size=config.batch_size,
            max_length=config.max_length,
            max_batch_tokens=config.max_batch_tokens,
            length_buckets=config.length_buckets,
            in_flight=config.in_flight,
            initial_peers=list(initial_peers or []),
            dht_prefix=dht_prefix,
            started_at=started_at,
            wall_seconds=time.perf_counter() - started,
            versions=_versions(),
        )

        def write_report():
            from dist_eval.report import format_summary, write_metrics, write_predictions, write_report_files
            from dist_eval.tracking import log_to_tracker

            write_predictions(config.output_dir, result.predictions, metrics.get("label_names"), config.save_logits)
            path = write_metrics(config.output_dir, metrics)
            files = write_report_files(config.output_dir, metrics)
            if config.quiet:
                print(f"dist_eval: accuracy {metrics['accuracy']:.4f} on {metrics['num_samples']} samples -> {path}")
            else:
                print(format_summary(metrics))
                names = ", ".join(os.path.basename(f) for f in [path, os.path.join(config.output_dir, "predictions.jsonl"), *files])
                print(f"  report: {os.path.join(config.output_dir, 'report.html')} ({names} in {config.output_dir})", flush=True)
            png = os.path.join(config.output_dir, "confusion_matrix.png")
            where = log_to_tracker(config.report_to, metrics, config.output_dir, png if png in files else None)
            if where:
                say(f"  logged to {config.report_to}: {where}", flush=True)

        _on_main_then_broadcast("writing the report", write_report)
        if D.is_main_process():  # the report is complete: the partial results have served
            from dist_eval import partial

            partial.remove([resume_folder])
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(resume_folder))
    return 0
