"""Token ids of rows (checked, truncated) and right-padded batches."""
from __future__ import annotations

import gc
from contextlib import contextmanager
from itertools import chain
from typing import Iterator, List, Optional

import numpy as np
import torch

from dist_eval.data.labels import TaskColumns
from dist_eval.data.sample import column_values
from dist_eval.errors import UsageError


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused, if it runs, for a block that builds many
    objects and no reference cycles (a list of token ids per row): every collection their
    allocations trigger walks the objects built so far, which made a big set's ids take
    several times as long (benchmarks/RESULTS.md). Objects are still freed by reference
    counting.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def trim_heap() -> None:
    """Give the heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere nothing):
    glibc keeps what a phase freed (a chunk of the tokenizer's encodings), and a later phase's growth
    would hide in it, so a rank's peak would be set by its largest phase and never come down.
    """
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def tokenize_rows(tokenizer, dataset, rows: np.ndarray, columns: TaskColumns, max_length: int, pad_token_id: int,
                  calling_the_base: frozenset = frozenset()):
    """Token ids of ``rows`` (lists, unpadded), and how many were truncated to max_length.
    ``calling_the_base``: names of fast tokenizer classes whose own ``_batch_encode_plus`` only
    checks its arguments before calling the base class's (the model table's,
    ``backends.families.tokenizers_calling_the_base()``): their Rust backend is called directly too.
    """
    if not len(rows):
        return [], 0
    with cyclic_gc_paused():
        return _tokenize_rows(tokenizer, dataset, rows, columns, max_length, pad_token_id, calling_the_base)


def _tokenize_rows(tokenizer, dataset, rows: np.ndarray, columns: TaskColumns, max_length: int, pad_token_id: int,
                   calling_the_base: frozenset):
    # one read of just these rows and text columns (it runs inside the timed loop)
    read = column_values(dataset, [columns.text] + ([columns.text_pair] if columns.text_pair else []), rows)
    texts = list(read[0])
    pairs = list(read[1]) if columns.text_pair else None
    for param, name, values in (("text_column", columns.text, texts), ("text_pair_column", columns.text_pair, pairs)):
        if values is None:
            continue
        for offset, value in enumerate(values):
            if not isinstance(value, str):
                raise UsageError(
                    f"row {int(rows[offset])} holds {type(value).__name__} {value!r}, expected text. "
                    "Fix the data or pick the text column.",
                    param=param, value=name,
                )
    if columns.template is not None:  # one text per row: the template filled in (no tokenizer pair)
        texts = [apply_template(columns.template, text, pairs[i] if pairs else None) for i, text in enumerate(texts)]
        pairs = None
    encoded = _token_ids(tokenizer, texts, pairs, calling_the_base)
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    truncated = np.flatnonzero(lengths > max_length)
    for offset in truncated.tolist():
        encoded[offset] = encoded[offset][:max_length]
    # C-level tests per row: the per-row Python loop they replace was a tenth of the
    # tokenization's time on short rows. The first bad row in row order is the one named.
    empty = np.flatnonzero(lengths == 0)
    with_pad = next((offset for offset, ids in enumerate(encoded) if pad_token_id in ids), None)
    if empty.size and (with_pad is None or empty[0] < with_pad):
        raise UsageError(
            f"row {int(rows[empty[0]])} is empty after tokenization; the model "
            "has no token to classify. Drop empty rows from the data.",
            param="text_column", value=columns.text,
        )
    if with_pad is not None:
        raise UsageError(
            f"row {int(rows[with_pad])} contains the pad token id {pad_token_id} inside its text; with "
            "right padding and no attention mask the model would classify the wrong position. Use a tokenizer "
            "whose pad token never occurs in text (set pad_token_id in config.json).",
            param="tokenizer",
        )
    return encoded, int(truncated.size)


def _token_ids(tokenizer, texts: List[str], pairs: Optional[List[str]], calling_the_base: frozenset) -> List[List[int]]:
    """Each text's (or pair's) token ids with the special tokens, as ``tokenizer(texts, pairs)``
    gives them. A plain fast tokenizer's Rust backend is called directly: transformers' call
    turns every row's encoding into a dict of lists (the masks, offsets, ...), which cost more
    than the tokenization itself on short rows (benchmarks/RESULTS.md). Anything else, or a
    backend set to truncate or pad (transformers' call would switch that off), goes through
    the tokenizer's own call.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if _backend_gives_the_same_ids(tokenizer, backend, calling_the_base):
        batch = texts if pairs is None else list(zip(texts, pairs))
        return [encoding.ids for encoding in backend.encode_batch(batch, add_special_tokens=True)]
    # only the ids: the masks and token type ids a call builds by default are a list per row each
    return tokenizer(texts, pairs, truncation=False, add_special_tokens=True, return_attention_mask=False,
                     return_token_type_ids=False)["input_ids"]


# the steps of transformers 4.x's call of a batch; a class overriding one is called as itself
_CALL_STEPS = ("__call__", "_call_one", "batch_encode_plus", "_batch_encode_plus")


def _backend_gives_the_same_ids(tokenizer, backend, calling_the_base: frozenset = frozenset()) -> bool:
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - both come with transformers' fast tokenizers
        return False
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or not isinstance(backend, Tokenizer):
        return False
    bases = (PreTrainedTokenizerBase, PreTrainedTokenizerFast)
    # the steps of a batch's call: 4.x's __call__ goes through batch_encode_plus to _batch_encode_plus; 5.x has
    # neither, its __call__ encodes a batch in _encode_plus (which 4.x's batch call never reaches, so a 4.x class
    # overriding it alone is still called directly)
    steps = _CALL_STEPS if hasattr(PreTrainedTokenizerFast, "_batch_encode_plus") else _CALL_STEPS + ("_encode_plus",)
    for method in steps:
        defined_in = next((k for k in type(tokenizer).__mro__ if method in vars(k)), None)
        if defined_in is None:  # gone from this transformers (5.x has no batch_encode_plus): nothing overrides it
            continue
        if defined_in not in bases and not (method == "_batch_encode_plus"
                                            and defined_in.__name__ in calling_the_base):
            return False
    return backend.truncation is None and backend.padding is None


def apply_template(template: str, text: str, text_pair: Optional[str] = None) -> str:
    """``template`` with ``{text}`` (and ``{text_pair}``) replaced; other braces are kept as they are."""
    import re

    # one pass: a placeholder inside a row's own text is never replaced
    return re.sub(r"\{text(_pair)?\}", lambda m: text_pair if m.group(1) else text, template)


def right_pad(sequences: List[List[int]], pad_token_id: int) -> torch.Tensor:
    """[batch, longest] int64, padded on the right. No attention mask is built: the
    petals client refuses any mask that is not all ones, and causal attention means
    pads after a sequence do not change its earlier positions.
    """
    lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
    batch = np.full((len(sequences), int(lengths.max())), pad_token_id, dtype=np.int64)
    # every id in one read, placed by a mask of the real positions (row-major, as the ids
    # come): a tensor per row was most of the batch's building time on short rows
    batch[np.arange(batch.shape[1]) < lengths[:, None]] = np.fromiter(
        chain.from_iterable(sequences), dtype=np.int64, count=int(lengths.sum()))
    return torch.from_numpy(batch)
