"""The CLI run, phase by phase: ``python -m dist_eval`` -> :func:`dist_eval.cli.main` -> :func:`run`.

A run is a plan of (checkpoint, set) pairs (:mod:`dist_eval.plan`); a single run is a plan
of one pair. Every run goes through the same loop::

    preparing the run -> starting the local swarm -> loading the data (the first set)
      -> loading the model                                       (once: what the pairs share)
      -> for each pair (the two of --stop-when-decided together): loading the data (a set not seen
         yet) -> finding the stored partial results -> loading the checkpoint (another pair's)
         -> evaluate_models() (evaluate()'s path; evaluate_pair()'s for two) -> writing the reports
      -> writing the summary (several pairs) -> shutting down

Every phase is a :func:`dist_eval.ranks.phase`: a failure on one rank fails every rank
together. Rank 0 alone prints, starts the local swarm and writes the reports. What a
report's ``metrics.json`` says of the run is built in one place, :func:`dist_eval.output.report.run_facts`,
and the report is written there (:func:`dist_eval.output.report.report_pair`).
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import List

from dist_eval import ranks
from dist_eval.backends.kinds import backend_kind
from dist_eval.config import EvalConfig
from dist_eval.data.sample import Rows
from dist_eval.job import Job, on_this_node, prepare
from dist_eval.output.report import Written, record_shutdown, report_pair
from dist_eval.plan import EvalSet, Pair
from dist_eval.run_context import Clock, RunContext


def run(config: EvalConfig) -> int:
    """The CLI run on this rank; returns the exit code (a failure raises :class:`RankFailure`)."""
    from dist_eval.output.files import release_output_dirs

    try:
        return _run(config)
    finally:
        release_output_dirs()  # rank 0's hold on --output-dir (a no-op elsewhere)


def _run(config: EvalConfig) -> int:
    clock = Clock.now()
    ranks.phase_seconds.clear()
    main = ranks.is_main_process()
    say = print if main and not config.quiet else (lambda *a, **k: None)

    with ranks.phase("preparing the run"):
        job = prepare(config, say) if main else None
        # every rank at once, here: its second of CPU would else come one rank after the other, inside "loading
        # the data", where rank 0 fills the cache before the others start
        import datasets  # noqa: F401
    job = on_this_node(config, ranks.broadcast_object(job))
    reports: List[Written] = []
    with contextlib.ExitStack() as cleanup:
        on_swarm = backend_kind(config.backend).on_swarm
        context = RunContext(config, job, on_swarm, _swarm_address(config, job, on_swarm, cleanup, say), clock, say)
        _load_model(context, cleanup)
        pairs = job.plan.pairs()
        # --stop-when-decided: the two checkpoints on the same rows, together; else each pair alone
        together = [pairs] if job.settings.stop_when_decided else [[pair] for pair in pairs]
        for number, group in enumerate(together, 1):
            reports.extend(_run_pairs(context, group, f"[{number}/{len(together)}]"))
        if job.plan.several:
            with ranks.phase("writing the summary"):
                if main:
                    from dist_eval.compare import checkpoints_table
                    from dist_eval.output.pairs import write_pairs_summary

                    compared = checkpoints_table(config.output_dir, pairs)  # issue 52: Holm over them all
                    print(write_pairs_summary(config.output_dir, pairs, *compared), flush=True)
        shutdown_began = time.perf_counter()
    if main:
        record_shutdown(reports, clock, shutdown_began, say)
    return 0


def _swarm_address(config: EvalConfig, job: Job, on_swarm: bool, cleanup: contextlib.ExitStack, say) -> tuple:
    """(initial peers, DHT prefix) of the swarm: the flags', or a local swarm's, started by
    rank 0 (and stopped when the run ends) while every rank imports its client.
    """
    if not on_swarm or config.initial_peers:
        return config.initial_peers, config.dht_prefix or job.dht_prefix
    with ranks.phase("starting the local swarm"):
        swarm = None
        if ranks.is_main_process():
            from dist_eval.swarm.local import start_for_run

            swarm = start_for_run(job.model_dir, config.local_servers, config.dht_prefix, config.local_device, say)
            cleanup.callback(swarm.stop)  # when the run ends, whatever happens (a start under way too)
        from dist_eval.backends.petals.shims import import_petals

        import_petals()  # each rank imports its client (seconds of CPU) while the servers start
        address = (swarm.wait_started().initial_peers, swarm.dht_prefix) if swarm is not None else None
    return ranks.broadcast_object(address)


def _load_model(context: RunContext, cleanup: contextlib.ExitStack) -> None:
    """Every rank: the first set's data (a mistake in it shows before the model loads), then the
    model with the first pair's checkpoint; every other checkpoint is checked against it.
    """
    from dist_eval.backends import load_model
    from dist_eval.backends.classifier import model_files_readable
    from dist_eval.backends.tokenizer import load_tokenizer

    config, job = context.config, context.job
    first = job.plan.pairs()[0]
    _rows(context, first.data)
    with ranks.phase("loading the model"):
        context.tokenizer = load_tokenizer(job.model_dir)
        with model_files_readable(job.model_dir):
            options = config.load_options(checkpoint=first.checkpoint.path, head=job.head,
                                          label_words=job.settings.label_words, tokenizer=context.tokenizer,
                                          initial_peers=context.swarm[0], dht_prefix=context.swarm[1])
            context.model = load_model(config.backend, job.model_dir, options)
        cleanup.push(_barrier_unless_interrupted)  # no rank's client still talks when rank 0 stops the swarm
        cleanup.callback(context.model.close)
        for checkpoint in job.plan.checkpoints[1:]:
            context.model.check_structure(context.model.source.read(checkpoint.path), checkpoint.path)
    context.shared_phases = dict(ranks.phase_seconds)


def _barrier_unless_interrupted(exc_type, exc, tb) -> None:
    """An exit callback: wait for the other ranks, except after SIGINT/SIGTERM, when they
    may be gone (torchrun stops them all when one dies) and a collective would fail.
    """
    if exc_type is None or not issubclass(exc_type, KeyboardInterrupt):
        ranks.barrier_if_alive()


def _rows(context: RunContext, data: EvalSet) -> Rows:
    """The set's rows: loaded once per set, in a phase, by every rank."""
    from dist_eval.data.load import fills_cache, load_split
    from dist_eval.data.sample import draw_rows

    if data.name not in context.datasets:
        job = context.job
        with ranks.phase("loading the data", main_first=fills_cache(list(data.files))):  # rank 0 fills the cache
            rows = draw_rows(load_split(list(data.files), job.split), job.settings, context.config.options,
                             job.settings.stops_early)
        context.datasets[data.name] = rows
    return context.datasets[data.name]


def _run_pairs(context: RunContext, pairs: List[Pair], numbered: str) -> List[Written]:
    """Pairs evaluated together on the rows of one set, stage by stage: one pair (a run that does not
    compare), or the two of --stop-when-decided, in rounds until the interval of their difference says
    stop. Their rows (drawn once per set), each pair's stored results (several pairs: finished reports
    are skipped, those of a comparison when both are), each side's checkpoint swapped into the one model
    before its evaluations, the evaluation (:func:`dist_eval.evaluation.evaluate_models`: the path of
    :func:`dist_eval.evaluate`, or of :func:`dist_eval.evaluate_pair` for two; the global progress shown by
    rank 0), a report for each (rank 0 returns them).
    """
    from dist_eval.backends.classifier import swap_checkpoint
    from dist_eval.evaluation import evaluate_models
    from dist_eval.exact import Request
    from dist_eval.progress import GlobalProgress
    from dist_eval.resume import stored_results

    ranks.phase_seconds.clear()  # these pairs' own phases (the shared ones: context.shared_phases)
    pair_started = time.perf_counter()
    config, job, settings, say = context.config, context.job, context.job.settings, context.say
    outs = [os.path.join(config.output_dir, pair.folder) for pair in pairs]
    if job.plan.several and len(pairs) == 1:
        say(f"dist_eval: {numbered} checkpoint {pairs[0].checkpoint.name or pairs[0].checkpoint.path or '-'}, "
            f"set {pairs[0].data.name or '-'} -> {outs[0]}", flush=True)
    rows = _rows(context, pairs[0].data)
    stored = stored_results(outs, [(job.model_dir, pair.checkpoint.path, rows.dataset, job.split, context.model,
                                    settings, job.head) for pair in pairs],
                            resume=config.resume, skip_finished=job.plan.several, say=say)
    if all(folder is None for folder, _, _ in stored):
        return []  # the finished reports of these very pairs are there (--resume)

    def hold(side: int) -> None:  # before each evaluation of a side: its prompts + head in the one model
        swap_checkpoint(context.model, pairs[side].checkpoint.path)  # nothing read when it holds them

    if len(pairs) == 1:
        hold(0)  # before the line below and the progress, as a pair's stages go (evaluate_models' call: a no-op)
        stops = (f", in rounds of {settings.stop_round_rows} until the 95% interval of {settings.stop_metric} is at "
                 f"most {settings.stop_at_width} wide" if settings.stop_at_width is not None else "")
        say(f"dist_eval: evaluating {'up to ' if stops else ''}{len(rows)} rows on {ranks.get_world_size()} "
            f"rank(s) with the {config.backend} backend{stops} ...", flush=True)
    else:
        say(f"dist_eval: comparing {pairs[0].checkpoint.name} and {pairs[1].checkpoint.name} on up to "
            f"{len(rows)} rows of the same set, in rounds of {settings.stop_round_rows}, until the 95% interval "
            f"of the difference in {settings.stop_metric} excludes 0 ...", flush=True)
    # every rank creates it here (one broadcast); rank 0 shows all ranks' rows on stderr
    with GlobalProgress(len(pairs) * len(rows), config.progress, quiet=config.quiet) as progress:
        # evaluate() for one pair, evaluate_pair() for two: their one path, with the CLI's validated settings
        request = Request(context.tokenizer, num_labels=None, label_names=None, pad_token_id=None, return_logits=True,
                          metrics=None, sample_metrics=None, on_batch_done=progress.update,
                          resume_folders=[folder for folder, _, _ in stored], settings=settings,
                          options=config.options)
        results = evaluate_models([context.model] * len(pairs), rows, request, on_model=hold)
    reports = [report_pair(context, pair, result, (out, *found), rows, pair_started)
               for pair, out, found, result in zip(pairs, outs, stored, results)]
    return [report for report in reports if report is not None]
