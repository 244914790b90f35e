"""What a run evaluates: a plan of (checkpoint, set) pairs, parsed from the flags.

A single run is a plan of one pair whose folder is ``--output-dir`` itself; named sets and
several (or named) checkpoints make more pairs, each reported in its own folder::

    --data-files dev=dev.jsonl test=test_a.jsonl,test_b.jsonl    named sets: NAME=FILE[,FILE...]
    --checkpoint epoch1.pt --checkpoint last=run/final.pt         repeated: named by the file's
                                                                  stem, or NAME=FILE

A token that is an existing path is a path, never a ``NAME=`` (hive-style ``split=test/``
folders stay usable). Names are folder names: letters, digits, ``_``, ``-``, ``.``.

A pair's folder under ``--output-dir`` has one level per plural (named) dimension:
``OUT/<checkpoint>/<set>/`` with several checkpoints and named sets, ``OUT/<set>/`` with
named sets and one plain ``--checkpoint`` (or none), ``OUT/<checkpoint>/`` with several
checkpoints and plain ``--data-files``, ``OUT/`` itself for the single run. The run itself
is :func:`dist_eval.pipeline.run`. Standard library only: :mod:`dist_eval.config` parses
the flags with it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

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
