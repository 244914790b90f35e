"""How many rows the bounded-memory code (issue 51) takes at once: each chunk size, read at every call.

A chunk bounds a step's memory, never its result: the rows are taken one chunk after another, in
order, so every output is the same bits whatever the sizes (tests/test_memory_bounded.py: a set that
crosses every boundary several times, with uneven remainders, against one chunk of each, on 1 and 3
ranks). ``DIST_EVAL_CHUNK_ROWS`` overrides them, for the tests (not a user setting: a size changes only
the memory and the time): ``NAME=SIZE,NAME=SIZE,...`` the named sizes (:data:`DEFAULT_ROWS`' names), or
one ``SIZE`` for every one; read at each call, so a test may set it in its own process, and the ranks
it launches inherit it.
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Dict

from dist_eval.errors import UsageError

ENV = "DIST_EVAL_CHUNK_ROWS"

DEFAULT_ROWS: Dict[str, int] = {
    # data.shard: rows tokenized at once by the passes over a rank's rows (the length pass, a shard's rows,
    # token_lengths; PackedIds.select's copy): the tokenizer's encodings of a call are held until it returns
    # (about 150 bytes a token), so a call per chunk bounds them; only the ids are kept, packed (4 bytes a token)
    "tokenize": 4096,
    # data.shard: rows of a rank's block sent to their owners in one round of the exchange
    "exchange": 65536,
    # data.shard: token ids (not rows) copied at once from one spill file to another
    "copy_tokens": 1 << 20,
    # data.sample: rows read and keyed at once (the --limit sample's keys, the rows' content keys)
    "keys": 16384,
    # data.groups: rows of a --slice-by column read at once
    "slice_read": 16384,
    # rowstore: rows whose texts are read at once for their row-store keys
    "store_keys": 16384,
    # data.batches: rows whose logits are known (the row store's) in one batch of their own
    "known": 4096,
    # output.files: predictions.jsonl lines made and written at once (and --save-text cells read at once)
    "lines": 16384,
    # output: from this many rows on, rank 0's report writes half of predictions.jsonl's lines and draws the
    # figures in forked children beside it (dist_eval.aside), on cores the other ranks leave idle; below, the
    # forks would cost more than they save (the result is the same bytes either way)
    "aside": 131072,
    # merge: row indices merged at once on rank 0 (stream_to_main), rows put in order at once (merge_parts)
    "merge": 65536,
    # scoring: rows whose probabilities are computed at once (above it, into a mapped file)
    "softmax": 65536,
    # metrics: rows of the Brier score's and top-k's per-row values computed at once
    "metrics": 65536,
}


def chunk_rows(name: str) -> int:
    """The chunk size ``name`` (a key of :data:`DEFAULT_ROWS`): ``$DIST_EVAL_CHUNK_ROWS``'s, else the default."""
    if name not in DEFAULT_ROWS:
        raise KeyError(f"no chunk size named {name!r}: expected one of {', '.join(DEFAULT_ROWS)}")
    return _sizes(os.environ.get(ENV, "")).get(name, DEFAULT_ROWS[name])


@lru_cache(maxsize=8)
def _sizes(spec: str) -> Dict[str, int]:
    """The sizes ``spec`` (the variable's value) sets: {} for none."""
    spec = spec.strip()
    if not spec:
        return {}
    if "=" not in spec:
        return dict.fromkeys(DEFAULT_ROWS, _size(spec, spec))
    sizes = {}
    for part in spec.split(","):
        name, _, size = part.partition("=")
        if name.strip() not in DEFAULT_ROWS:
            raise UsageError(f"{ENV}={spec!r}: {name.strip()!r} names no chunk size: expected NAME=SIZE,... with "
                             f"NAME one of {', '.join(DEFAULT_ROWS)}. Fix the name, or unset {ENV} for the defaults.")
        sizes[name.strip()] = _size(size, spec)
    return sizes


def _size(text: str, spec: str) -> int:
    try:
        size = int(text.strip())
    except ValueError:
        size = 0
    if size < 1:
        raise UsageError(f"{ENV}={spec!r}: {text.strip()!r} is no size: expected a positive integer (rows), as "
                         f"SIZE or NAME=SIZE,... Give one, or unset {ENV} for the defaults.")
    return size
