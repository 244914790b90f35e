"""The CLI run, phase by phase: ``python -m dist_eval`` -> :func:`dist_eval.cli.main` -> :func:`run`.

A run is a plan of (checkpoint, set) pairs (:mod:`dist_eval.plan`); a single run is a plan
of one pair. Every run goes through the same loop::

    preparing the run -> starting the local swarm -> loading the data (the first set)
      -> loading the model                                       (once: what the pairs share)
      -> for each pair: loading the data (a set not seen yet) -> finding the stored partial
         results -> loading the checkpoint (another pair's) -> evaluate() -> writing the report
      -> writing the summary (several pairs) -> shutting down

Every phase is a :func:`dist_eval.ranks.phase`: a failure on one rank fails every rank
together. Rank 0 alone prints, starts the local swarm and writes the reports. What a
report's ``metrics.json`` says of the run is built in one place, :func:`_run_facts`.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import platform
import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from dist_eval import ranks
from dist_eval.backends.kinds import backend_kind
from dist_eval.config import EvalConfig, Settings
from dist_eval.errors import UsageError, short_error
from dist_eval.plan import Checkpoint, EvalSet, Pair, Plan


@dataclass
class Job:
    """What this run evaluates: the flags', or the built-in demo's model, data and columns."""

    model_dir: str
    split: Optional[str]
    settings: Settings
    plan: Plan
    demo: bool
    head: Optional[str] = None
    dht_prefix: Optional[str] = None  # petals' default for a --model hub id


@dataclass
class _Clock:
    started: float  # perf_counter at the start of run()
    started_at: str  # the same moment, ISO 8601 UTC

    @classmethod
    def now(cls) -> _Clock:
        return cls(time.perf_counter(), datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


@dataclass
class _Session:
    """What every pair of the run shares: the flags, the job, the loaded model, the swarm, the clock."""

    config: EvalConfig
    job: Job
    swarm: Tuple[Optional[list], Optional[str]]  # (initial peers, DHT prefix)
    clock: _Clock
    say: object
    model: object = None
    tokenizer: object = None
    loaded: Optional[Checkpoint] = None  # whose prompts + head the model holds
    shared_phases: Dict[str, float] = field(default_factory=dict)  # phases before the first pair
    datasets: Dict[Optional[str], tuple] = field(default_factory=dict)  # set name -> (dataset, sample facts)


@dataclass
class _Report:
    """Rank 0: a report written, completed with the shutdown's times once every process has stopped."""

    folder: str
    metrics: dict
    phases: Dict[str, float]


def run(config: EvalConfig) -> int:
    """The CLI run on this rank; returns the exit code (a failure raises :class:`RankFailure`)."""
    from dist_eval.output.files import release_output_dirs

    try:
        return _run(config)
    finally:
        release_output_dirs()  # rank 0's hold on --output-dir (a no-op elsewhere)


def _run(config: EvalConfig) -> int:
    clock = _Clock.now()
    ranks.phase_seconds.clear()
    main = ranks.is_main_process()
    say = print if main and not config.quiet else (lambda *a, **k: None)

    with ranks.phase("preparing the run"):
        job = _prepare(config, say) if main else None
    job = _model_on_this_node(config, ranks.broadcast_object(job))
    reports: List[_Report] = []
    with contextlib.ExitStack() as cleanup:
        session = _Session(config, job, _swarm_address(config, job, cleanup, say), clock, say)
        _load_model(session, cleanup)
        pairs = job.plan.pairs()
        if job.settings.stop_when_decided:  # two checkpoints on the same rows, together
            reports.extend(_run_compared(session, pairs))
        else:
            for number, pair in enumerate(pairs, 1):
                report = _run_pair(session, pair, f"[{number}/{len(pairs)}]")
                if report is not None:
                    reports.append(report)
        if job.plan.several:
            with ranks.phase("writing the summary"):
                if main:
                    from dist_eval.output.pairs import write_pairs_summary

                    print(write_pairs_summary(config.output_dir, pairs), flush=True)
        shutdown_began = time.perf_counter()
    if main:
        _record_shutdown(reports, clock, shutdown_began, say)
    return 0


def _prepare(config: EvalConfig, say) -> Job:
    """Rank 0: check the output folder; with no --model, build (or find) the demo's assets."""
    from dist_eval.output.files import check_output_dir, hold_output_dir

    check_output_dir(config.output_dir)
    hold_output_dir(config.output_dir)  # one run at a time per folder
    if not config.is_demo:
        if config.plan.several:
            say(f"dist_eval: {len(config.plan.checkpoints)} checkpoint(s) x {len(config.plan.sets)} set(s) = "
                f"{len(config.plan.pairs())} evaluations, one model load; reports under {config.output_dir}",
                flush=True)
        from dist_eval.backends.hub import resolve_model

        model_dir, dht_prefix = resolve_model(config.model, config.backend, config.initial_peers, config.revision,
                                              whole=config.fetch_whole_model)
        return Job(model_dir, config.split, config.settings, config.plan, demo=False, head=config.head,
                   dht_prefix=dht_prefix)
    from dist_eval.demo import demo_assets

    demo = demo_assets(log=lambda line: say(f"dist_eval: {line}", flush=True), family=config.demo_family)
    settings = replace(config.settings, text_column=demo.text_column, label_column=demo.label_column)
    plan = Plan((EvalSet(None, (demo.data_dir,)),), (Checkpoint(None, demo.checkpoint),))
    return Job(demo.model_dir, demo.split, settings, plan, demo=True)


def _model_on_this_node(config: EvalConfig, job: Job) -> Job:
    """A hub id's files are in rank 0's HF cache; a rank whose HF cache is another (another node
    without a shared HF_HOME) fetches the same snapshot (its commit) into its own cache.
    """
    from dist_eval.backends.arguments import is_hub_id

    if job.demo or not is_hub_id(config.model):  # the same on every rank: all enter the phase or none
        return job
    with ranks.phase("finding the model on this node"):
        from huggingface_hub import constants

        own_cache = os.path.realpath(constants.HF_HUB_CACHE)
        if not os.path.realpath(job.model_dir).startswith(own_cache + os.sep):
            from dist_eval.backends.hub import resolve_model

            commit = os.path.basename(os.path.normpath(job.model_dir))  # a snapshot folder is named by its commit
            model_dir, _ = resolve_model(config.model, config.backend, config.initial_peers, commit,
                                         whole=config.fetch_whole_model)
            job = replace(job, model_dir=model_dir)
    return job


def _swarm_address(config: EvalConfig, job: Job, cleanup: contextlib.ExitStack, say) -> tuple:
    """(initial peers, DHT prefix) of the swarm: the flags', or a local swarm's, started by
    rank 0 (and stopped when the run ends) while every rank imports its client.
    """
    if not backend_kind(config.backend).on_swarm or config.initial_peers:
        return config.initial_peers, config.dht_prefix or job.dht_prefix
    with ranks.phase("starting the local swarm"):
        swarm = _start_swarm(config, job, cleanup, say) if ranks.is_main_process() else None
        from dist_eval.backends.compat import import_petals

        import_petals()  # each rank imports its client (seconds of CPU) while the servers start
        address = (swarm.wait_started().initial_peers, swarm.dht_prefix) if swarm is not None else None
    return ranks.broadcast_object(address)


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


def _load_model(session: _Session, cleanup: contextlib.ExitStack) -> None:
    """Every rank: the first set's data (a mistake in it shows before the model loads), then the
    model with the first pair's checkpoint; every other checkpoint is checked against it.
    """
    from dist_eval.backends import load_model
    from dist_eval.backends.tokenizer import load_tokenizer

    config, job = session.config, session.job
    first = job.plan.pairs()[0]
    _dataset(session, first.data)
    with ranks.phase("loading the model"):
        session.tokenizer = load_tokenizer(job.model_dir)
        with _unreadable_model_files(job.model_dir):
            session.model = load_model(
                config.backend, job.model_dir, checkpoint=first.checkpoint.path, head=job.head,
                tuning_mode=config.tuning_mode, pre_seq_len=config.pre_seq_len, num_labels=config.num_labels,
                initial_peers=session.swarm[0], dht_prefix=session.swarm[1], swarm_timeout=config.swarm_timeout,
                device=config.device, label_words=job.settings.label_words, tokenizer=session.tokenizer,
            )
        session.loaded = first.checkpoint
        cleanup.push(_barrier_unless_interrupted)  # no rank's client still talks when rank 0 stops the swarm
        cleanup.callback(session.model.close)
        for checkpoint in job.plan.checkpoints[1:]:
            session.model.check_structure(_trainable(session, checkpoint), checkpoint.path)
    session.shared_phases = dict(ranks.phase_seconds)


@contextlib.contextmanager
def _unreadable_model_files(model_dir: str):
    """A file of the model folder that cannot be read (a truncated safetensors file, one
    missing) is the user's input to fix: a usage error (exit 2), not an internal one.
    """
    from json import JSONDecodeError

    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, JSONDecodeError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
        raise UsageError(f"a file of the folder cannot be read ({short_error(e, 120)}): it is broken or incomplete. "
                         "Save or copy the model again.", param="model_dir", value=model_dir) from e


def _trainable(session: _Session, checkpoint: Checkpoint):
    """The prompts + head of ``checkpoint``, read and checked as ``load_model`` would."""
    from dist_eval.backends.classifier import read_trainable

    config, job = session.config, session.job
    return read_trainable(job.model_dir, checkpoint.path, job.head, config.tuning_mode, config.pre_seq_len,
                          config.num_labels, job.settings.label_words)


def _barrier_unless_interrupted(exc_type, exc, tb) -> None:
    """An exit callback: wait for the other ranks, except after SIGINT/SIGTERM, when they
    may be gone (torchrun stops them all when one dies) and a collective would fail.
    """
    if exc_type is None or not issubclass(exc_type, KeyboardInterrupt):
        ranks.barrier_if_alive()


def _run_pair(session: _Session, pair: Pair, numbered: str) -> Optional[_Report]:
    """One pair: its data, its stored results, its checkpoint, evaluate(), its report (rank 0
    returns it). A pair whose folder holds its finished report is skipped (several pairs).
    """
    ranks.phase_seconds.clear()  # this pair's own phases (the shared ones: session.shared_phases)
    pair_started = time.perf_counter()
    out = os.path.join(session.config.output_dir, pair.folder)
    if session.job.plan.several:
        session.say(f"dist_eval: {numbered} checkpoint {pair.checkpoint.name or pair.checkpoint.path or '-'}, "
                    f"set {pair.data.name or '-'} -> {out}", flush=True)
    dataset, sample = _dataset(session, pair.data)
    folder, key = _stored_results(session, out, pair, dataset)
    if folder is None:
        return None
    _load_checkpoint(session, pair.checkpoint)
    result = _evaluate(session, dataset, folder)
    return _report_pair(session, pair, result, (out, folder, key), dataset, sample, pair_started)


def _run_compared(session: _Session, pairs: List[Pair]) -> List[_Report]:
    """--stop-when-decided: the two checkpoints on the same rows of the one set, in rounds, until
    the interval of their difference says stop (:mod:`dist_eval.stopping`); a report for each.
    """
    from dist_eval.evaluation import EvalResult, evaluate_once
    from dist_eval.progress import GlobalProgress
    from dist_eval.stopping import evaluate_in_rounds

    config = session.config
    ranks.phase_seconds.clear()
    pair_started = time.perf_counter()
    dataset, sample = _dataset(session, pairs[0].data)
    outs = [os.path.join(config.output_dir, pair.folder) for pair in pairs]
    stored = [_stored_results(session, out, pair, dataset) for out, pair in zip(outs, pairs)]
    if all(folder is None for folder, _ in stored):
        return []  # both reports of this very comparison are there (--resume)

    def evaluator(checkpoint: Checkpoint):
        def evaluate_rows(data, **keywords):
            _load_checkpoint(session, checkpoint)
            return evaluate_once(session.model, data, tokenizer=session.tokenizer, num_labels=None, pad_token_id=None,
                                 metrics=None, **keywords)
        return evaluate_rows

    settings = session.job.settings
    session.say(f"dist_eval: comparing {pairs[0].checkpoint.name} and {pairs[1].checkpoint.name} on up to "
                f"{len(dataset)} rows of the same set, in rounds of {settings.stop_round_rows}, until the 95% interval "
                f"of the difference in {settings.stop_metric} excludes 0 ...", flush=True)
    model = session.model
    with GlobalProgress(2 * len(dataset), config.progress, quiet=config.quiet) as progress:
        results = evaluate_in_rounds(
            [evaluator(pair.checkpoint) for pair in pairs], dataset, settings, config.options, label_names=None,
            model_names=list(model.id2label.values()) if model.id2label else None, user_metrics=None,
            sample_metrics=None, on_batch_done=progress.update, resume_folders=[folder for folder, _ in stored],
        )
    reports = []
    for pair, out, (folder, key), (metrics, merged) in zip(pairs, outs, stored, results):
        report = _report_pair(session, pair, EvalResult(metrics, merged), (out, folder, key), dataset, sample,
                              pair_started)
        if report is not None:
            reports.append(report)
    return reports


def _stored_results(session: _Session, out: str, pair: Pair, dataset) -> Tuple[Optional[str], str]:
    """(this pair's folder of partial results, or None when its finished report is there; its run key)."""
    with ranks.phase("finding the stored partial results"):
        found = _partial_folder(session, out, pair, dataset) if ranks.is_main_process() else None
    return ranks.broadcast_object(found)


def _load_checkpoint(session: _Session, checkpoint: Checkpoint) -> None:
    """The model holds ``checkpoint``'s prompts + head (loaded only when it holds another's)."""
    if checkpoint != session.loaded:
        with ranks.phase("loading the checkpoint"):
            session.model.load_trainable(_trainable(session, checkpoint), checkpoint.path)
        session.loaded = checkpoint


def _report_pair(session: _Session, pair: Pair, result, where: tuple, dataset, sample: dict,
                 pair_started: float) -> Optional[_Report]:
    """Rank 0: the pair's report written in ``where`` = (its folder, the partial results' folder,
    the run key); returned for the shutdown's times.
    """
    from dist_eval import resume

    out, folder, key = where
    options = session.config.options
    if options.slice_by is not None and "slices" not in result.metrics:  # two checkpoints stopping early
        from dist_eval.evaluation import slice_values, with_slices

        settings = session.job.settings
        result = with_slices(result, slice_values(dataset, settings, options)[0], options, len(dataset),
                             (session.tokenizer, settings, dataset))
    facts = _run_facts(session, pair, pair_started)
    result.metrics["run"].update(facts, run_key=key, sample=sample)
    with ranks.phase("writing the report"):
        if ranks.is_main_process():
            _write_report(session.config, out, result, session.say,
                          _texts(session.config, session.job.settings, dataset, getattr(result, "slices", None)))
    if not ranks.is_main_process():
        return None
    if folder is not None:
        resume.finished(folder)  # the report is complete: the partial results have served
    return _Report(out, result.metrics, _report_phases(session))


def _dataset(session: _Session, data: EvalSet) -> tuple:
    """(the set's rows, what the report records of its --limit sample): loaded once per set,
    in a phase, by every rank.
    """
    from dist_eval.data.load import fills_cache, load_split

    if data.name not in session.datasets:
        job = session.job
        with ranks.phase("loading the data", main_first=fills_cache(list(data.files))):  # rank 0 fills the cache
            sample = _sample(job.settings, load_split(list(data.files), job.split))
        session.datasets[data.name] = (sample.pop("dataset"), sample)
    dataset, sample = session.datasets[data.name]
    return dataset, dict(sample)


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


def _partial_folder(session: _Session, out: str, pair: Pair, dataset) -> Tuple[Optional[str], str]:
    """Rank 0: (this pair's folder of partial results, its run key, made of everything that
    decides the results); (None, key) when the folder holds the finished report of this very
    pair (skipped; several pairs only: a single run is run again).
    """
    from dist_eval import resume
    from dist_eval.output.files import check_output_dir

    config, job = session.config, session.job
    check_output_dir(out)
    key = resume.run_key(job.model_dir, pair.checkpoint.path, dataset, job.split, session.model, job.settings,
                         job.head)
    if job.plan.several and config.resume and resume.finished_report(out, key):
        session.say(f"dist_eval: already finished (the report in {out} is of this checkpoint, data and settings): "
                    "skipped", flush=True)
        return None, key
    return resume.resume_folder(out, key, config.resume, session.say), key


def _evaluate(session: _Session, dataset, folder: str):
    """evaluate() over the dataset, with the global progress shown by rank 0."""
    from dist_eval.evaluation import evaluate
    from dist_eval.progress import GlobalProgress

    config = session.config
    settings = session.job.settings
    stops = (f", in rounds of {settings.stop_round_rows} until the 95% interval of {settings.stop_metric} is at most "
             f"{settings.stop_at_width} wide" if settings.stop_at_width is not None else "")
    session.say(f"dist_eval: evaluating {'up to ' if stops else ''}{len(dataset)} rows on {ranks.get_world_size()} "
                f"rank(s) with the {config.backend} backend{stops} ...", flush=True)
    # every rank creates it here (one broadcast); rank 0 shows all ranks' rows on stderr
    progress = GlobalProgress(len(dataset), config.progress, quiet=config.quiet)
    try:
        progress.start()
        result = evaluate(session.model, dataset, tokenizer=session.tokenizer, settings=session.job.settings,
                          options=config.options, return_logits=True, on_batch_done=progress.update,
                          resume_folder=folder)
    except BaseException:
        progress.close(completed=False)  # ends a bar's line
        raise
    progress.close()
    return result


def _run_facts(session: _Session, pair: Pair, pair_started: float) -> dict:
    """What a report's metrics.json records of the run, besides what the merge measured. For a
    plan of one pair, its times count from the run's start; with several, from the pair's, and
    ``pair`` names it and the phases the pairs shared.
    """
    config, job, several = session.config, session.job, session.job.plan.several
    facts = dict(
        backend=config.backend,
        model=os.path.abspath(job.model_dir),
        data_files=[os.path.abspath(p) if os.path.exists(p) else p for p in pair.data.files],
        split=job.split,
        checkpoint=os.path.abspath(pair.checkpoint.path) if pair.checkpoint.path else None,
        head=os.path.abspath(job.head) if job.head else None,
        demo=job.demo,
        label_words=list(job.settings.label_words) if job.settings.label_words else None,
        template=job.settings.template,
        batch_size=job.settings.batch_size,
        max_length=job.settings.max_length,
        max_batch_tokens=job.settings.max_batch_tokens or 0,
        length_buckets=job.settings.length_buckets,
        in_flight=config.options.in_flight,
        initial_peers=list(session.swarm[0] or []),
        dht_prefix=session.swarm[1],
        started_at=session.clock.started_at,
        wall_seconds=time.perf_counter() - (pair_started if several else session.clock.started),
        startup_seconds=_startup_seconds(session.clock.started),
        phase_seconds=_rounded(_report_phases(session)),
        versions=_versions(),
    )
    if several:
        facts["pair"] = {"checkpoint": pair.checkpoint.name, "set": pair.data.name, "folder": pair.folder,
                         "shared_phase_seconds": _rounded(session.shared_phases)}
    swarm = session.model.provenance() if ranks.is_main_process() else None
    if swarm is not None:  # a petals run: the servers as announced in the DHT
        facts["swarm"] = swarm
    return facts


def _report_phases(session: _Session) -> Dict[str, float]:
    """The phases a report records, so far: the pair's own; for a plan of one pair, the run's
    shared ones before them too (with several pairs they go to ``pair.shared_phase_seconds``).
    """
    own = dict(ranks.phase_seconds)
    return own if session.job.plan.several else {**session.shared_phases, **own}


def _record_shutdown(reports: List[_Report], clock: _Clock, shutdown_began: float, say) -> None:
    """Rank 0, once every process of the run has stopped: each report's metrics.json gains
    the times of its report and of the shutdown (the client, the other ranks, the local
    swarm), and the run's total from the launch; one line says them.
    """
    from dist_eval.output.files import write_metrics

    shutdown = round(time.perf_counter() - shutdown_began, 3)
    for report in reports:
        run = report.metrics["run"]
        run["phase_seconds"] = {**_rounded(report.phases), "shutting down": shutdown}
        run["total_seconds"] = round((run.get("startup_seconds") or 0.0) + time.perf_counter() - clock.started, 3)
        write_metrics(report.folder, report.metrics)
    if reports:
        run = reports[-1].metrics["run"]
        say(f"dist_eval: done in {run['total_seconds']:.1f} s from the launch (writing the report "
            f"{run['phase_seconds'].get('writing the report', 0.0):.1f} s, shutting down {shutdown:.1f} s)",
            flush=True)


def _startup_seconds(started: float) -> Optional[float]:
    """Seconds from this process's start to ``started`` (a perf_counter time): the run's own
    start-up and imports, before the first phase, by the kernel's clock.

    Not from torchrun's start (this process's parent): /proc gives a process's fork time, and
    a shell that ``exec``s torchrun after other work (``bash -c './launch/install.sh &&
    torchrun ...'``) hands torchrun its own start, so the install counted as the launch.
    torchrun's own start-up, before it starts the ranks, is not counted.
    """
    alive = _seconds_alive(os.getpid())
    return None if alive is None else round(max(0.0, alive - (time.perf_counter() - started)), 3)


def _rounded(phases: Dict[str, float]) -> Dict[str, float]:
    """{phase: seconds}, in order, to the millisecond."""
    return {name: round(seconds, 3) for name, seconds in phases.items()}


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


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for package in ("dist_eval", "torch", "transformers", "datasets", "petals", "hivemind"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def _texts(config: EvalConfig, settings: Settings, dataset, slices: Optional[dict] = None) -> Optional[dict]:
    """Rank 0: with --save-text, {"text": ..., "text_pair": ...} of every row, in row order; with
    --slice-by, {"slice": {column: value}} of every row.
    """
    out = {}
    if config.save_text:
        columns = {"text": settings.text_column, "text_pair": settings.text_pair_column}
        out.update({key: dataset[column] for key, column in columns.items() if column})
    if slices:  # each row's slices (evaluate()'s EvalResult.slices)
        out["slice"] = [dict(zip(slices, row)) for row in zip(*slices.values())]
    return out or None


def _write_report(config: EvalConfig, out: str, result, say, texts: Optional[dict] = None) -> None:
    """Rank 0: predictions.jsonl, metrics.json and the report files in ``out``; the summary; the tracker."""
    from dist_eval.output.files import write_metrics, write_predictions, write_report_files
    from dist_eval.output.summary import format_summary
    from dist_eval.output.tracking import log_to_tracker

    metrics = result.metrics
    write_predictions(out, result.predictions, metrics.get("label_names"), config.save_logits, texts)
    path = write_metrics(out, metrics)
    files = write_report_files(out, metrics)
    if config.quiet:
        stop = metrics.get("stopping")
        stopped = (f" (stopped after {stop['rows_used']} of {stop['rows_in_set']} rows: {stop['reason']}, "
                   f"95% {'time-uniform' if stop['interval']['time_uniform'] else 'fixed-width rule'} interval "
                   f"[{stop['interval']['low']:.4f}, {stop['interval']['high']:.4f}])"
                   if stop else "")
        print(f"dist_eval: accuracy {metrics['accuracy']:.4f} on {metrics['num_samples']} samples{stopped} -> {path}")
    else:
        print(format_summary(metrics))
        names = ", ".join(os.path.basename(f) for f in [path, os.path.join(out, "predictions.jsonl"), *files])
        print(f"  report: {os.path.join(out, 'report.html')} ({names} in {out})", flush=True)
    png = os.path.join(out, "confusion_matrix.png")
    where = log_to_tracker(config.report_to, metrics, out, png if png in files else None)
    if where:
        say(f"  logged to {config.report_to}: {where}", flush=True)
