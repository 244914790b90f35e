"""Several evaluation sets and checkpoints in one run: the model loaded (and the swarm
connected) once, then one full evaluation per (checkpoint, set) pair.

The flags (checked when :class:`dist_eval.config.EvalConfig` is built, so a mistake is one
line naming the flag before any work)::

    --data-files dev=dev.jsonl test=test_a.jsonl,test_b.jsonl    named sets: NAME=FILE[,FILE...]
    --checkpoint epoch1.pt --checkpoint last=run/final.pt         repeated: named by the file's
                                                                  stem, or NAME=FILE

A token that is an existing path is a path, never a ``NAME=`` (hive-style ``split=test/``
folders stay usable). Names are folder names: letters, digits, ``_``, ``-``, ``.``.

Each pair's report goes to its own folder under ``--output-dir``, one level per plural
(named) dimension: ``OUT/<checkpoint>/<set>/`` with several checkpoints and named sets,
``OUT/<set>/`` with named sets and one plain ``--checkpoint`` (or none), ``OUT/<checkpoint>/``
with several checkpoints and plain ``--data-files``. A run with one plain checkpoint and
plain files is the single run of :func:`dist_eval.pipeline.run`, unchanged. Each pair
folder holds a single run's files (metrics.json, predictions.jsonl, report.html, ...)
and its own resume store (``<pair folder>/partial/<run key>``); ``OUT/summary.md`` and
``OUT/summary.json`` compare the pairs.

Pairs run checkpoint by checkpoint (the prompts + head swapped in place between two,
:meth:`dist_eval.backends.LoadedModel.load_trainable`), so every checkpoint must have the
structure of the first (tuning mode, prompt vectors, classes): checked before any
evaluation. A pair whose folder holds the complete report of this very pair (its run key
in metrics.json, no partial results left) is skipped on a re-run; the others resume from
their partial results or start.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from dist_eval import ranks
from dist_eval.errors import UsageError

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")
_RESERVED = {"partial", "summary.md", "summary.json"}  # what else lives in --output-dir or a pair folder


@dataclass(frozen=True)
class EvalSet:
    name: Optional[str]  # None: plain --data-files (no folder level)
    files: Tuple[str, ...]


@dataclass(frozen=True)
class Checkpoint:
    name: Optional[str]  # None: one plain --checkpoint, or none (no folder level)
    path: Optional[str]  # None: the model folder's own head


@dataclass(frozen=True)
class Pair:
    checkpoint: Checkpoint
    data: EvalSet
    folder: str  # relative to --output-dir; "" for the single run

    @property
    def label(self) -> str:
        return " / ".join(n for n in (self.checkpoint.name, self.data.name) if n) or "run"


@dataclass(frozen=True)
class Plan:
    """What the flags ask to evaluate: sets x checkpoints."""

    sets: Tuple[EvalSet, ...]
    checkpoints: Tuple[Checkpoint, ...]

    @property
    def several(self) -> bool:
        """More than the single run: a named set, several checkpoints or a named one."""
        return any(s.name for s in self.sets) or any(c.name for c in self.checkpoints)

    def pairs(self) -> List[Pair]:
        """Checkpoint by checkpoint (one swap each), every set for each."""
        return [Pair(c, s, os.path.join(*[n for n in (c.name, s.name) if n] or [""]))
                for c in self.checkpoints for s in self.sets]


def _named(token: str, param: str, what: str) -> Optional[Tuple[str, str]]:
    """(name, value) of a ``NAME=VALUE`` token, None for a plain path; refuses a bad name or value."""
    if "=" not in token or os.path.exists(token):
        return None
    name, value = token.split("=", 1)
    form = f"expected NAME={what} (NAME: letters, digits, '_', '-', '.'; a folder name in --output-dir)"
    if not _NAME.match(name) or name in _RESERVED:
        raise UsageError(f"{form}; {name!r} cannot name one.", param=param, value=token)
    if not value.strip(","):
        raise UsageError(f"{form}; {name!r} has no {what.split('[')[0]} after '='.", param=param, value=token)
    return name, value


def _check_unique(names: Sequence[str], param: str, hint: str) -> None:
    seen = set()
    for name in names:
        if name in seen:
            raise UsageError(f"the name {name!r} is given twice; each needs its own folder. {hint}", param=param,
                             value=name)
        seen.add(name)


def parse_sets(tokens: Sequence[str]) -> Tuple[EvalSet, ...]:
    """``--data-files``: plain files (one set), or named sets ``NAME=FILE[,FILE...]``."""
    named = [_named(t, "data_files", "FILE[,FILE...]") for t in tokens]
    if not any(named):
        return (EvalSet(None, tuple(tokens)),)
    if not all(named):
        plain = next(t for t, n in zip(tokens, named) if n is None)
        raise UsageError(f"mixes named sets (NAME=FILE) with the plain file {plain!r}: name every set, or none.",
                         param="data_files", value=" ".join(tokens))
    _check_unique([n for n, _ in named], "data_files", "A set of several files is NAME=FILE1,FILE2.")
    return tuple(EvalSet(name, tuple(f for f in value.split(",") if f)) for name, value in named)


def parse_checkpoints(values) -> Tuple[Checkpoint, ...]:
    """``--checkpoint`` (repeatable): one plain file, or several, each named by its stem or NAME=FILE."""
    values = [values] if isinstance(values, str) else list(values or [])
    if not values:
        return (Checkpoint(None, None),)
    named = [_named(v, "checkpoint", "FILE") for v in values]
    if len(values) == 1 and named[0] is None:
        return (Checkpoint(None, values[0]),)
    out = []
    for value, pair in zip(values, named):
        name, path = pair or (os.path.splitext(os.path.basename(value.rstrip("/")))[0], value)
        if not _NAME.match(name) or name in _RESERVED:
            raise UsageError(f"its file name {name!r} cannot name a folder; pass NAME={value}.", param="checkpoint",
                             value=value)
        out.append(Checkpoint(name, path))
    _check_unique([c.name for c in out], "checkpoint", "Name them apart: --checkpoint NAME=FILE.")
    return tuple(out)


def parse_plan(data_files, checkpoint) -> Plan:
    """The run's sets x checkpoints, from the flags (a UsageError naming the flag if malformed)."""
    return Plan(parse_sets(data_files), parse_checkpoints(checkpoint))


# ---------------------------------------------------------------- the run over the pairs


@dataclass
class _Run:
    """What every pair shares: the flags, the loaded model, the swarm, the clock, the datasets."""

    config: object
    job: object
    model: object
    tokenizer: object
    swarm: tuple  # (initial peers, DHT prefix)
    cleanup: object
    say: object
    clock: tuple  # (perf_counter at the start, ISO start time)
    shared_phases: dict
    datasets: dict = dataclasses.field(default_factory=dict)  # set name -> (dataset, sample facts)
    loaded: Optional[Checkpoint] = None  # whose prompts + head the model holds


def run_pairs(config, job, swarm: tuple, cleanup, say, clock: tuple) -> int:
    """Every (checkpoint, set) pair of ``job.plan`` with one model load; then the summary table."""
    from dist_eval import pipeline

    pairs = job.plan.pairs()
    say(f"dist_eval: {len(job.plan.checkpoints)} checkpoint(s) x {len(job.plan.sets)} set(s) = {len(pairs)} "
        f"evaluations, one model load; reports under {config.output_dir}", flush=True)
    with ranks.phase("loading the model"):
        tokenizer, model = pipeline._load_model(config, job, *swarm)
        _check_checkpoints(config, job, model)
    cleanup.push(pipeline._barrier_unless_interrupted)  # as in pipeline.run
    cleanup.callback(model.close)
    run = _Run(config, job, model, tokenizer, swarm, cleanup, say, clock, dict(ranks.phase_seconds),
               loaded=pairs[0].checkpoint)
    for number, pair in enumerate(pairs, 1):
        say(f"dist_eval: [{number}/{len(pairs)}] checkpoint {pair.checkpoint.name or pair.checkpoint.path or '-'}, "
            f"set {pair.data.name or '-'} -> {os.path.join(config.output_dir, pair.folder)}", flush=True)
        _run_pair(run, pair)
    with ranks.phase("writing the summary"):
        if ranks.is_main_process():
            from dist_eval.output.pairs import write_pairs_summary

            print(write_pairs_summary(config.output_dir, pairs), flush=True)
    return 0


def _check_checkpoints(config, job, model) -> None:
    """Every rank: each checkpoint readable, checked against the model and of the first one's structure."""
    from dist_eval.backends.classifier import read_trainable

    for checkpoint in job.plan.checkpoints[1:]:
        state = read_trainable(job.model_dir, checkpoint.path, job.head, config.tuning_mode, config.pre_seq_len,
                               config.num_labels, job.settings.label_words)
        model.check_structure(state, checkpoint.path)


def _run_pair(run: _Run, pair: Pair) -> None:
    """One pair: its data (loaded once per set), its stored results, the checkpoint swap, evaluate(), its report."""
    from dist_eval import pipeline, resume

    ranks.phase_seconds.clear()
    pair_started = time.perf_counter()
    main = ranks.is_main_process()
    job = dataclasses.replace(run.job, data_files=list(pair.data.files), checkpoint=pair.checkpoint.path, plan=None)
    config = copy.copy(run.config)
    config.output_dir = os.path.join(run.config.output_dir, pair.folder)
    dataset, sample = _dataset(run, pair, job)
    with ranks.phase("finding the stored partial results"):
        found = _pair_folder(config, job, dataset, run.model, run.say) if main else None
    folder, key = ranks.broadcast_object(found)
    if folder is None:
        return
    if pair.checkpoint != run.loaded:
        with ranks.phase("loading the checkpoint"):
            _swap(run, job)
        run.loaded = pair.checkpoint
    result = pipeline._evaluate(config, job, run.model, run.tokenizer, dataset, folder, run.cleanup, run.say)
    facts = pipeline._run_facts(config, job, *run.swarm, *run.clock)
    facts.update(wall_seconds=time.perf_counter() - pair_started, run_key=key, sample=sample,
                 pair={"checkpoint": pair.checkpoint.name, "set": pair.data.name, "folder": pair.folder,
                       "shared_phase_seconds": {k: round(v, 3) for k, v in run.shared_phases.items()}})
    result.metrics["run"].update(facts)
    provenance = getattr(run.model.module, "provenance", None)
    if main and provenance is not None:
        result.metrics["run"]["swarm"] = provenance()
    with ranks.phase("writing the report"):
        if main:
            pipeline._write_report(config, result, run.say, pipeline._texts(config, job, dataset))
    if main:
        resume.finished(folder)


def _dataset(run: _Run, pair: Pair, job) -> tuple:
    """(the set's rows, the sample's facts): loaded once per set, by every rank."""
    from dist_eval import pipeline

    if pair.data.name not in run.datasets:
        run.datasets[pair.data.name] = pipeline._load_data(job)
    dataset, sample = run.datasets[pair.data.name]
    return dataset, dict(sample)


def _pair_folder(config, job, dataset, model, say) -> Tuple[Optional[str], Optional[str]]:
    """Rank 0: (this pair's folder of partial results, its run key); (None, key) when the
    pair's folder already holds its complete report (skipped).
    """
    from dist_eval import resume
    from dist_eval.output.files import check_output_dir

    check_output_dir(config.output_dir)
    key = resume.run_key(job.model_dir, job.checkpoint, dataset, job.split, model, job.settings, job.head)
    if config.resume and finished_report(config.output_dir, key):
        say(f"dist_eval: already finished (the report in {config.output_dir} is of this checkpoint, data and "
            "settings): skipped", flush=True)
        return None, key
    return resume.resume_folder(config.output_dir, key, config.resume, say), key


def finished_report(folder: str, key: str) -> bool:
    """``folder`` holds the complete report of the run ``key``: its metrics.json records the
    key, predictions.jsonl is there and no partial results are left (they are removed last).
    """
    from dist_eval import resume

    try:
        with open(os.path.join(folder, "metrics.json")) as f:
            recorded = json.load(f).get("run", {}).get("run_key")
    except (OSError, ValueError, AttributeError):
        return False
    return (recorded == key and os.path.isfile(os.path.join(folder, "predictions.jsonl"))
            and not os.path.isdir(os.path.join(folder, resume.SUBDIR, key)))


def _swap(run: _Run, job) -> None:
    """Every rank: the pair's prompts + head into the loaded model (no reload, no reconnect)."""
    from dist_eval.backends.classifier import read_trainable

    config = run.config
    state = read_trainable(job.model_dir, job.checkpoint, job.head, config.tuning_mode, config.pre_seq_len,
                           config.num_labels, job.settings.label_words)
    run.model.load_trainable(state, job.checkpoint)
