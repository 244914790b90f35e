"""Token ids of rows (checked, truncated) and right-padded batches."""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from dist_eval.data.labels import TaskColumns
from dist_eval.errors import UsageError


def tokenize_rows(tokenizer, dataset, rows: np.ndarray, columns: TaskColumns, max_length: int, pad_token_id: int):
    """Token ids of ``rows`` (lists, unpadded), and how many were truncated to max_length."""
    if not len(rows):
        return [], 0
    if dataset.format["type"] is None:
        # One read of just these rows and text columns: select() and then a column read was
        # several times slower (benchmarks/RESULTS.md), and it runs inside the timed loop.
        text_columns = list(dict.fromkeys([columns.text] + ([columns.text_pair] if columns.text_pair else [])))
        picked = dataset.select_columns(text_columns)[rows.tolist()]
    else:  # a format or a transform (which may read other columns) decides what a read gives
        picked = dataset.select(rows.tolist())
    texts = list(picked[columns.text])
    pairs = list(picked[columns.text_pair]) if columns.text_pair else None
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
    # only the ids: the masks and token type ids a call builds by default cost more than the
    # tokenization itself on short rows (a Python list per row each; benchmarks/RESULTS.md)
    encoded = tokenizer(texts, pairs, truncation=False, add_special_tokens=True, return_attention_mask=False,
                        return_token_type_ids=False)["input_ids"]
    num_truncated = 0
    out = []
    for offset, ids in enumerate(encoded):
        if len(ids) > max_length:
            ids = ids[:max_length]
            num_truncated += 1
        if not ids:
            raise UsageError(
                f"row {int(rows[offset])} is empty after tokenization; the model "
                "has no token to classify. Drop empty rows from the data.",
                param="text_column", value=columns.text,
            )
        if pad_token_id in ids:
            raise UsageError(
                f"row {int(rows[offset])} contains the pad token id {pad_token_id} inside its text; with "
                "right padding and no attention mask the model would classify the wrong position. Use a tokenizer "
                "whose pad token never occurs in text (set pad_token_id in config.json).",
                param="tokenizer",
            )
        out.append(ids)
    return out, num_truncated


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
    longest = max(len(s) for s in sequences)
    batch = torch.full((len(sequences), longest), pad_token_id, dtype=torch.long)
    for i, ids in enumerate(sequences):
        batch[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return batch
