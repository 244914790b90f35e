"""What ``load_model`` and ``--model`` take, read once (no torch imported): its options (:class:`LoadOptions`),
the label words, a hub id, the swarm timeout's default, the audit's share. The CLI's settings
(:mod:`dist_eval.config`) validate with these; the backends read them here, never from the settings module
above them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from dist_eval.errors import UsageError

# Seconds a swarm may take to serve every block (and a batch to be retried when every server of a
# block failed): --swarm-timeout's default, and load_model's.
DEFAULT_SWARM_TIMEOUT = 60.0

# --audit (dist_eval.backends.petals.audit): the share of requests replayed on other servers, on a swarm
# dist_eval did not start (the run's own: none); $DIST_EVAL_AUDIT names another default (the suite's
# is 0: tests/conftest.py)
DEFAULT_AUDIT_SHARE = 0.03
AUDIT_ENV = "DIST_EVAL_AUDIT"


@dataclass(frozen=True)
class LoadOptions:
    """How :func:`~dist_eval.backends.classifier.load_model` loads a model besides its backend and folder: one
    field per keyword of ``load_model`` (which documents each), with its default. The CLI carries its
    model-loading flags in one (:meth:`dist_eval.config.EvalConfig.load_options`).
    """

    checkpoint: Optional[str] = None
    head: Optional[str] = None
    tuning_mode: Optional[str] = None
    pre_seq_len: int = 0
    num_labels: Optional[int] = None
    initial_peers: Optional[list] = None
    dht_prefix: Optional[str] = None
    petals_client_options: Optional[dict] = None
    swarm_timeout: float = DEFAULT_SWARM_TIMEOUT
    device: str = "cpu"
    label_words: Union[Sequence[str], str, None] = None
    tokenizer: Any = None
    revision: Optional[str] = None
    fetch_whole_model: bool = False
    stream_blocks: bool = False
    audit: Optional[float] = None
    servers_started_from_4x_config: bool = False

    @classmethod
    def of(cls, options: Optional[LoadOptions], keywords: Dict[str, Any], caller: str = "load_model") -> LoadOptions:
        """``options`` (default: every default) with ``keywords`` set on them; a keyword that is no option is a
        TypeError naming the closest one, as Python's own for a function's keywords.
        """
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"{caller}(): options= expected a LoadOptions, got {type(options).__name__} "
                            f"{options!r}; pass the others as keywords ({caller}(backend, model_dir, checkpoint=...)).")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(keywords) - set(names))
        if unknown:
            import difflib

            close = difflib.get_close_matches(unknown[0], names, n=1)
            raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}"
                            + (f"; did you mean {close[0]!r}?" if close else ""))
        return replace(options or cls(), **keywords)


def is_hub_id(model: str) -> bool:
    """``org/name`` (or ``name``) that is not a path here: what ``--model`` names on the hub."""
    return not os.path.exists(model) and not model.startswith((".", "/", "~")) and model.count("/") <= 1


def read_label_words(value: Union[str, Sequence[str], None], param: str = "label_words") -> Optional[Tuple[str, ...]]:
    """The label words (one per class, in class-id order) as a tuple; None stays None.

    ``value``: the words, or ``"@PATH"`` (alone), a UTF-8 file with one word per line
    (surrounding whitespace stripped, blank lines skipped). At least 2 distinct, non-empty words.
    """
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    words = list(value)
    if len(words) == 1 and isinstance(words[0], str) and words[0].startswith("@"):
        path = words[0][1:]
        try:
            with open(path, encoding="utf-8") as f:
                words = [line.strip() for line in f if line.strip()]
        except OSError as e:
            raise UsageError(f"cannot read the file of label words ({e.strerror}). Pass @FILE with one word per "
                             "line, or the words themselves.", param=param, value=value[0]) from e
    bad = [w for w in words if not isinstance(w, str) or not w.strip()]
    if bad:
        raise UsageError(f"expected one non-empty word per class; got {bad[0]!r}.", param=param, value=words)
    words = [w.strip() for w in words]
    if len(words) < 2:
        raise UsageError(f"expected one word per class, at least 2; got {len(words)}.", param=param, value=words)
    repeated = sorted({w for w in words if words.count(w) > 1})
    if repeated:
        raise UsageError(f"{repeated} given for more than one class; each class needs its own word.",
                         param=param, value=words)
    return tuple(words)


def audit_share(share: Optional[float], param: str = "audit") -> float:
    """``share`` checked (0 to 1); None: $DIST_EVAL_AUDIT, else :data:`DEFAULT_AUDIT_SHARE`."""
    given = share
    if share is None:
        given = os.environ.get(AUDIT_ENV, DEFAULT_AUDIT_SHARE)
        param = AUDIT_ENV if AUDIT_ENV in os.environ else param
    try:
        value = float(given)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0.0 <= value <= 1.0:
        raise UsageError("expected the share of requests to replay on other servers, from 0 (no audit) to 1 "
                         f"(every request); the default is {DEFAULT_AUDIT_SHARE}.", param=param, value=given)
    return value
