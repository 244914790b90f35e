"""What a CLI run evaluates (:class:`Job`): the flags' model, data and columns, or the built-in
demo's; made by rank 0 (:func:`prepare`: the output folder held, a hub id resolved, the demo's
assets built or found, each pair's folder made ready), sent to every rank, and found on each node
(:func:`on_this_node`).
"""
from __future__ import annotations

from dataclasses import replace

from dist_eval import ranks
from dist_eval.config import EvalConfig
from dist_eval.plan import Checkpoint, EvalSet, Plan
from dist_eval.run_context import Job


def prepare(config: EvalConfig, say) -> Job:
    """Rank 0: the output folder checked and held, then the job (the flags', or the demo's assets built
    or found), then each of its pairs' folders made ready (:func:`~dist_eval.output.files.prepare_pair_folders`).
    """
    from dist_eval.output.files import check_output_dir, hold_output_dir, prepare_pair_folders

    check_output_dir(config.output_dir)
    hold_output_dir(config.output_dir)  # one run at a time per folder
    job = _demo_job(config, say) if config.is_demo else _flags_job(config, say)
    prepare_pair_folders(config.output_dir, [pair.folder for pair in job.plan.pairs()])
    return job


def _flags_job(config: EvalConfig, say) -> Job:
    """The flags' model (a hub id resolved), data and checkpoints."""
    from dist_eval.backends.hub import resolve_model

    if config.plan.several:
        say(f"dist_eval: {len(config.plan.checkpoints)} checkpoint(s) x {len(config.plan.sets)} set(s) = "
            f"{len(config.plan.pairs())} evaluations, one model load; reports under {config.output_dir}", flush=True)
    model_dir, dht_prefix = resolve_model(config.model, config.backend, config.initial_peers, config.revision,
                                          whole=config.fetch_whole_model,
                                          stream=config.stream_blocks)
    return Job(model_dir, config.split, config.settings, config.plan, demo=False, head=config.head,
               dht_prefix=dht_prefix)


def _demo_job(config: EvalConfig, say) -> Job:
    """The built-in demo's model, data and checkpoint (built, or found built)."""
    from dist_eval.demo import demo_assets

    demo = demo_assets(log=lambda line: say(f"dist_eval: {line}", flush=True), family=config.demo_family)
    settings = replace(config.settings, text_column=demo.text_column, label_column=demo.label_column)
    plan = Plan((EvalSet(None, (demo.data_dir,)),), (Checkpoint(None, demo.checkpoint),))
    return Job(demo.model_dir, demo.split, settings, plan, demo=True)


def on_this_node(config: EvalConfig, job: Job) -> Job:
    """A hub id's files are in rank 0's HF cache; a rank whose HF cache is another (another node
    without a shared HF_HOME) fetches the same snapshot into its own.
    """
    from dist_eval.backends.arguments import is_hub_id

    if job.demo or not is_hub_id(config.model):  # the same on every rank: all enter the phase or none
        return job
    with ranks.phase("finding the model on this node"):
        from dist_eval.backends.hub import snapshot_on_this_node

        model_dir = snapshot_on_this_node(job.model_dir, config.model, config.backend, config.initial_peers,
                                          whole=config.fetch_whole_model,
                                          stream=config.stream_blocks)
    return replace(job, model_dir=model_dir)
