"""A model folder's tokenizer, read as the transformers that saved it reads it.

The pinned transformers (4.33) predates tokenizers saved since late 2024; dist_eval runs it
beside a current ``tokenizers`` (launch/install.sh), which parses merges saved as pairs
(tokenizers >= 0.20) and honours ``ignore_merges`` (tokenizers >= 0.19). Two things
remain, handled here in one place for every caller (the run, label words):

- a ``tokenizer_class`` in tokenizer_config.json that the pinned transformers does not know
  (a newer family's) is read as the fast tokenizer its tokenizer.json is: the
  classes of the families served add nothing to the ids a fast tokenizer computes;
- a tokenizer feature the installed ``tokenizers`` cannot honour is refused in one line,
  never read differently (:func:`unsupported_tokenizer_feature`).
"""
from __future__ import annotations

import json
import os

from dist_eval.backends.patches import installed_version
from dist_eval.errors import UsageError

# (what tokenizer.json says, the tokenizers release that first reads it so)
_FEATURES = (("merges saved as pairs", (0, 20)), ("ignore_merges: true", (0, 19)))


def _version_tuple(version: str) -> tuple:
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


def tokenizer_features(model_dir: str) -> list:
    """The features of the folder's tokenizer.json that older ``tokenizers`` read differently."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        model = json.load(f).get("model") or {}
    merges = model.get("merges") or []
    found = []
    if merges and isinstance(merges[0], list):
        found.append(_FEATURES[0])
    if model.get("ignore_merges"):
        found.append(_FEATURES[1])
    return found


def unsupported_tokenizer_feature(model_dir: str) -> str:
    """Why the installed ``tokenizers`` cannot read the folder's tokenizer as saved ('' when it can)."""
    installed = installed_version("tokenizers") or "0"
    for feature, first in tokenizer_features(model_dir):
        if _version_tuple(installed) < first:
            needs = ".".join(map(str, first))
            return (f"its tokenizer.json has {feature}, which tokenizers {installed} (installed) does not "
                    f"read as saved; tokenizers >= {needs} does. Run ./launch/install.sh, or "
                    f"pip install 'tokenizers>={needs}'")
    return ""


def load_tokenizer(model_dir: str, param: str = "model_dir"):
    """The tokenizer saved in ``model_dir``, as its own transformers reads it; one-line refusals."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    why = unsupported_tokenizer_feature(model_dir)
    if why:
        raise UsageError(why + ".", param=param, value=model_dir)
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:
        unknown_class = "does not exist or is not currently imported" in str(e)
        if not (unknown_class and os.path.isfile(os.path.join(model_dir, "tokenizer.json"))):
            raise UsageError(f"no usable tokenizer in the folder ({type(e).__name__}: {str(e)[:160]}). Save the "
                             "tokenizer there too (tokenizer.save_pretrained(folder)).", param=param,
                             value=model_dir) from e
    # a newer family's tokenizer class: its tokenizer.json is the whole of its ids
    return PreTrainedTokenizerFast.from_pretrained(model_dir)
