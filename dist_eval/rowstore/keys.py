"""What a row's key and a key folder's are made of: each row's text hashed (:func:`row_keys`), the settings
and library versions that change a row's tokens or logits.
"""
from __future__ import annotations

import hashlib
from typing import List, Optional

import numpy as np

from dist_eval.backends.provenance import KEYED_LIBRARIES, library_versions  # noqa: F401 - also the resume key's

KEY_BYTES = 16


# settings that decide which rows are evaluated, or how they are batched, not their logits
NOT_IN_KEY = ("label_column", "batch_size", "length_buckets", "max_batch_tokens", "limit", "limit_seed",
              "stop_at_width", "stop_when_decided", "stop_metric", "stop_round_rows", "stop_rule")


def settings_facts(settings) -> dict:
    """The settings that change a row's tokens or logits (not which rows, nor their batches)."""
    return {name: value for name, value in settings.as_dict().items() if name not in NOT_IN_KEY}


def _text_bytes(value) -> bytes:
    """A cell's bytes, length first (so that text and pair cannot run into each other)."""
    data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else repr(value).encode()
    return len(data).to_bytes(8, "little") + data


def row_keys(texts: List, pairs: Optional[List]) -> np.ndarray:
    """[n, 16] uint8: each row's key, a BLAKE2b of its text and text pair (each length-prefixed)."""
    from dist_eval.data.sample import digest_each

    base = hashlib.blake2b(digest_size=KEY_BYTES, person=b"dist_eval-row")
    rows = (_text_bytes(text) + (b"\x00" if pairs is None else b"\x01" + _text_bytes(pairs[i]))
            for i, text in enumerate(texts))
    return np.frombuffer(digest_each(base, rows), dtype=np.uint8).reshape(len(texts), KEY_BYTES)
