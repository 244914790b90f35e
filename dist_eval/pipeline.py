"""The CLI run, phase by phase: ``python -m dist_eval`` -> :func:`dist_eval.cli.main` -> :func:`run`.

    preparing the run -> starting the local swarm -> loading the data -> loading the model
      -> finding the stored partial results -> evaluate() -> writing the report

Every phase is a :func:`dist_eval.ranks.phase`: a failure on one rank fails every rank
together. Rank 0 alone prints, starts the local swarm and writes the report.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import platform
import time
from dataclasses import dataclass
from typing import List, Optional

from dist_eval import ranks
from dist_eval.config import EvalConfig, Settings
from dist_eval.errors import UsageError
from dist_eval.jobs import Plan


@dataclass
class Job:
    """What this run evaluates: the flags', or the built-in demo's model, data and columns."""

    model_dir: str
    data_files: List[str]
    split: Optional[str]
    checkpoint: Optional[str]
    settings: Settings
    demo: bool
    head: Optional[str] = None
    plan: Optional[Plan] = None  # several sets and/or checkpoints (dist_eval.jobs); None: this one run


def run(config: EvalConfig) -> int:
    """The CLI run on this rank; returns the exit code (a failure raises :class:`RankFailure`)."""
    started = time.perf_counter()
    ranks.phase_seconds.clear()
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    main = ranks.is_main_process()
    say = print if main and not config.quiet else (lambda *a, **k: None)

    with ranks.phase("preparing the run"):
        job = _prepare(config, say) if main else None
    job = ranks.broadcast_object(job)
    with contextlib.ExitStack() as cleanup:
        initial_peers, dht_prefix = config.initial_peers, config.dht_prefix
        if config.backend == "petals" and not initial_peers:
            with ranks.phase("starting the local swarm"):
                swarm = _start_swarm(config, job, cleanup, say) if main else None  # its servers start meanwhile:
                _import_client(config)  # each rank imports its client (seconds of CPU) while they start
                address = (swarm.wait_started().initial_peers, swarm.dht_prefix) if main else None
            initial_peers, dht_prefix = ranks.broadcast_object(address)
        if job.plan is not None:  # several sets and/or checkpoints: one model load, a loop over the pairs
            from dist_eval.jobs import run_pairs

            return run_pairs(config, job, (initial_peers, dht_prefix), cleanup, say, (started, started_at))
        dataset, sample = _load_data(job)
        with ranks.phase("loading the model"):
            tokenizer, model = _load_model(config, job, initial_peers, dht_prefix)
        cleanup.push(_barrier_unless_interrupted)  # no rank's client is still talking when rank 0 stops the swarm
        cleanup.callback(model.close)
        with ranks.phase("finding the stored partial results"):
            folder = _resume_folder(config, job, dataset, model, say) if main else None
        folder = ranks.broadcast_object(folder)

        result = _evaluate(config, job, model, tokenizer, dataset, folder, cleanup, say)
        result.metrics["run"].update(_run_facts(config, job, initial_peers, dht_prefix, started, started_at))
        provenance = getattr(model.module, "provenance", None)
        if main and provenance is not None:  # a petals run: the servers as announced in the DHT
            result.metrics["run"]["swarm"] = provenance()
        result.metrics["run"]["sample"] = sample
        with ranks.phase("writing the report"):
            if main:
                _write_report(config, result, say, _texts(config, job, dataset))
        if main:  # the report is complete: the partial results have served
            from dist_eval import resume

            resume.finished(folder)
        shutdown_began = time.perf_counter()
    if main:
        _record_shutdown(config, result.metrics, started, shutdown_began, say)
    return 0


def _record_shutdown(config: EvalConfig, metrics: dict, started: float, shutdown_began: float, say) -> None:
    """Rank 0, once every process of the run has stopped: metrics.json gains the times of
    the report and of the shutdown (the client, the other ranks, the local swarm), and the
    run's total from the launch; one line says them.
    """
    from dist_eval.output.files import write_metrics

    run = metrics["run"]
    run["phase_seconds"] = _phase_seconds()  # the report's phase too, now
    run["phase_seconds"]["shutting down"] = round(time.perf_counter() - shutdown_began, 3)
    run["total_seconds"] = round((run.get("startup_seconds") or 0.0) + time.perf_counter() - started, 3)
    write_metrics(config.output_dir, metrics)
    phases = run["phase_seconds"]
    say(f"dist_eval: done in {run['total_seconds']:.1f} s from the launch (writing the report "
        f"{phases.get('writing the report', 0.0):.1f} s, shutting down {phases['shutting down']:.1f} s)", flush=True)


def _barrier_unless_interrupted(exc_type, exc, tb) -> None:
    """An exit callback: wait for the other ranks, except after SIGINT/SIGTERM, when they
    may be gone (torchrun stops them all when one dies) and a collective would fail.
    """
    if exc_type is None or not issubclass(exc_type, KeyboardInterrupt):
        ranks.barrier_if_alive()


def _prepare(config: EvalConfig, say) -> Job:
    """Rank 0: check the output folder; with no --model, build (or find) the demo's assets."""
    from dist_eval.output.files import check_output_dir

    check_output_dir(config.output_dir)
    if not config.is_demo:
        first = config.plan.pairs()[0]  # the single run's own, or the first pair's (whose checkpoint is loaded)
        return Job(config.model, list(first.data.files), config.split, first.checkpoint.path, config.settings,
                   demo=False, head=config.head, plan=config.plan if config.plan.several else None)
    from dist_eval.demo import demo_assets

    demo = demo_assets(log=lambda line: say(line, flush=True), family=config.demo_family)
    settings = dataclasses.replace(config.settings, text_column=demo.text_column, label_column=demo.label_column)
    return Job(demo.model_dir, [demo.data_dir], demo.split, demo.checkpoint, settings, demo=True)


def _load_data(job: Job) -> tuple:
    """(the job's rows, what the report records of its --limit sample): a phase, every rank."""
    from dist_eval.data.load import fills_cache, load_split

    with ranks.phase("loading the data", main_first=fills_cache(job.data_files)):  # rank 0 fills the cache first
        sample = _sample(job.settings, load_split(job.data_files, job.split))
    return sample.pop("dataset"), sample


def _sample(settings: Settings, dataset) -> dict:
    """The --limit sample of the split (every rank draws the same rows: no collective), and
    what the report records of it: ``{"dataset", "limit", "limit_seed", "rows_in_data", "rows"}``.
    """
    from dist_eval.data.labels import TaskColumns
    from dist_eval.data.sample import sample_rows

    columns = TaskColumns.of(settings)
    rows_in_data = len(dataset)
    if settings.limit and all(name in dataset.column_names for _, name in columns.named()):
        dataset = sample_rows(dataset, settings.limit, settings.limit_seed, [name for _, name in columns.named()])
    # (a missing column is reported by evaluate(), naming the flag)
    return {"dataset": dataset, "limit": settings.limit, "limit_seed": settings.limit_seed,
            "rows_in_data": rows_in_data, "rows": len(dataset)}


def _import_client(config: EvalConfig) -> None:
    """Import the backend's client library now (petals: ~3 s of CPU), not in "loading the model"."""
    if config.backend == "petals":
        from dist_eval.backends.compat import import_petals

        import_petals()


def _start_swarm(config: EvalConfig, job: Job, cleanup: contextlib.ExitStack, say):
    """Rank 0: a local swarm serving the model, starting in the background (``wait_started()``),
    stopped when the run ends.
    """
    from dist_eval.swarm import LocalSwarm

    if ranks.launched_on_several_nodes():  # its servers listen on 127.0.0.1 of rank 0's node only
        raise UsageError(
            "--initial-peers: omitted on a run over several nodes, but the local swarm started then "
            "is reachable from rank 0's node only. Start servers every node can reach "
            "(launch/start_server.sh on a host, HOST=<its IP>) and pass the INITIAL_PEERS=... they "
            "print with --initial-peers, and their --dht-prefix."
        )
    swarm = LocalSwarm(job.model_dir, num_servers=config.local_servers, dht_prefix=config.dht_prefix,
                       device=config.local_device)
    plan = swarm.server_plan
    say(f"dist_eval: starting a local swarm of {plan.num_servers} server(s) ({plan.describe()}) "
        f"for {job.model_dir} ...", flush=True)
    cleanup.callback(swarm.stop)  # when the run ends, whatever happens (a start under way too)
    return swarm.start_in_background()


def _load_model(config: EvalConfig, job: Job, initial_peers, dht_prefix) -> tuple:
    """(tokenizer, :class:`dist_eval.backends.LoadedModel`) of the job's model folder."""
    from transformers import AutoTokenizer

    from dist_eval.backends import load_model

    try:
        tokenizer = AutoTokenizer.from_pretrained(job.model_dir)
    except Exception as e:
        raise UsageError(
            f"--model {job.model_dir}: no usable tokenizer in the folder ({type(e).__name__}). "
            "Save the tokenizer there too (tokenizer.save_pretrained(folder))."
        ) from e
    model = load_model(
        config.backend, job.model_dir, checkpoint=job.checkpoint, head=job.head, tuning_mode=config.tuning_mode,
        pre_seq_len=config.pre_seq_len, num_labels=config.num_labels, initial_peers=initial_peers,
        dht_prefix=dht_prefix, swarm_timeout=config.swarm_timeout, device=config.device,
        label_words=job.settings.label_words, tokenizer=tokenizer,
    )
    return tokenizer, model


def _resume_folder(config: EvalConfig, job: Job, dataset, model, say) -> str:
    """Rank 0: this run's folder of partial results, keyed by everything that decides them."""
    from dist_eval import resume

    key = resume.run_key(job.model_dir, job.checkpoint, dataset, job.split, model, job.settings, job.head)
    return resume.resume_folder(config.output_dir, key, config.resume, say)


def _evaluate(config: EvalConfig, job: Job, model, tokenizer, dataset, folder: str, cleanup, say):
    """evaluate() over the dataset, with the global progress shown by rank 0."""
    from dist_eval.evaluation import evaluate
    from dist_eval.progress import GlobalProgress

    say(
        f"dist_eval: evaluating {len(dataset)} rows on {ranks.get_world_size()} rank(s) with the {config.backend} "
        "backend ...",
        flush=True,
    )
    # every rank creates it here (one broadcast); rank 0 shows all ranks' rows on stderr
    progress = GlobalProgress(len(dataset), config.progress, quiet=config.quiet)
    cleanup.callback(progress.close, completed=False)  # ends a bar's line if the evaluation fails
    progress.start()
    result = evaluate(
        model, dataset, tokenizer=tokenizer, **job.settings.as_dict(), **config.options.as_dict(),
        return_logits=True, on_batch_done=progress.update, resume_folder=folder,
    )
    progress.close()
    return result


def _startup_seconds(started: float) -> Optional[float]:
    """Seconds from the launch to ``started`` (a perf_counter time): the launcher's own
    start-up and this process's imports, before the first phase. The launch is the start
    of torchrun's agent (this process's parent under torchrun), else of this process,
    by the kernel's clock.
    """
    launched_by = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else os.getpid()
    alive = _seconds_alive(launched_by)
    return None if alive is None else round(max(0.0, alive - (time.perf_counter() - started)), 3)


def _phase_seconds() -> dict:
    """{phase: seconds} of this rank's phases so far, in order."""
    return {name: round(seconds, 3) for name, seconds in ranks.phase_seconds.items()}


def _seconds_alive(pid: int) -> Optional[float]:
    """How long process ``pid`` has been running (from /proc; None where that is unknown)."""
    from dist_eval.procs import start_time

    try:
        start_ticks = int(start_time(pid))
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError, TypeError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def _run_facts(config: EvalConfig, job: Job, initial_peers, dht_prefix, started: float, started_at: str) -> dict:
    """What metrics.json records about the run, besides what the merge measured."""
    return dict(
        backend=config.backend,
        model=os.path.abspath(job.model_dir),
        data_files=[os.path.abspath(p) if os.path.exists(p) else p for p in job.data_files],
        split=job.split,
        checkpoint=os.path.abspath(job.checkpoint) if job.checkpoint else None,
        head=os.path.abspath(job.head) if job.head else None,
        demo=job.demo,
        label_words=list(job.settings.label_words) if job.settings.label_words else None,
        template=job.settings.template,
        batch_size=config.batch_size,
        max_length=config.max_length,
        max_batch_tokens=config.max_batch_tokens,
        length_buckets=config.length_buckets,
        in_flight=config.in_flight,
        initial_peers=list(initial_peers or []),
        dht_prefix=dht_prefix,
        started_at=started_at,
        wall_seconds=time.perf_counter() - started,
        startup_seconds=_startup_seconds(started),
        phase_seconds=_phase_seconds(),
        versions=_versions(),
    )


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for package in ("dist_eval", "torch", "transformers", "datasets", "petals", "hivemind"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def _texts(config: EvalConfig, job: Job, dataset) -> Optional[dict]:
    """Rank 0, with --save-text: {"text": ..., "text_pair": ...} of every row, in row order."""
    if not config.save_text:
        return None
    columns = {"text": job.settings.text_column, "text_pair": job.settings.text_pair_column}
    return {key: dataset[column] for key, column in columns.items() if column}


def _write_report(config: EvalConfig, result, say, texts: Optional[dict] = None) -> None:
    """Rank 0: predictions.jsonl, metrics.json and the report files; the summary; the tracker."""
    from dist_eval.output.files import write_metrics, write_predictions, write_report_files
    from dist_eval.output.summary import format_summary
    from dist_eval.output.tracking import log_to_tracker

    metrics, out = result.metrics, config.output_dir
    write_predictions(out, result.predictions, metrics.get("label_names"), config.save_logits, texts)
    path = write_metrics(out, metrics)
    files = write_report_files(out, metrics)
    if config.quiet:
        print(f"dist_eval: accuracy {metrics['accuracy']:.4f} on {metrics['num_samples']} samples -> {path}")
    else:
        print(format_summary(metrics))
        names = ", ".join(os.path.basename(f) for f in [path, os.path.join(out, "predictions.jsonl"), *files])
        print(f"  report: {os.path.join(out, 'report.html')} ({names} in {out})", flush=True)
    png = os.path.join(out, "confusion_matrix.png")
    where = log_to_tracker(config.report_to, metrics, out, png if png in files else None)
    if where:
        say(f"  logged to {config.report_to}: {where}", flush=True)
