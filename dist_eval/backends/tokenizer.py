"""A model folder's tokenizer, read as the transformers that saved it reads it.

The pinned transformers (4.33) predates tokenizers saved since late 2024; dist_eval runs it
beside a current ``tokenizers`` (launch/install.sh), which parses merges saved as pairs
(tokenizers >= 0.20) and honours ``ignore_merges`` (tokenizers >= 0.19). Two things
remain, handled here in one place for every caller (the run, label words):

- a ``tokenizer_class`` in tokenizer_config.json that the pinned transformers does not know
  (a newer family's) is read as the fast tokenizer its tokenizer.json is: the
  classes of the families served add nothing to the ids a fast tokenizer computes; a folder saved with the generic
  ``PreTrainedTokenizerFast`` is read as that on any transformers (5.x's AutoTokenizer would build the family's own
  class from its vocabulary instead: other ids);
- a tokenizer feature the installed ``tokenizers`` cannot honour is refused in one line,
  never read differently (:func:`unsupported_tokenizer_feature`).

A JSON file of the folder that does not parse (tokenizer.json cut short, tokenizer_config.json,
special_tokens_map.json, ...) is named in that line (:func:`refuse_broken_json`), whichever reader met it.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from dist_eval.backends.compat import installed_version
from dist_eval.errors import UsageError, short_error

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


def broken_json_files(model_dir: str) -> list:
    """The JSON files of the folder ``model_dir`` that do not parse, as ``[(name, error)]`` in name order:
    looked for once a reader failed, to name the file (no reader of JSON says which file it read).
    """
    broken = []
    names = sorted(os.listdir(model_dir)) if os.path.isdir(model_dir) else []
    for name in names:
        path = os.path.join(model_dir, name)
        if not name.endswith(".json") or not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as f:
                json.loads(f.read().decode("utf-8"))
        except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
            broken.append((name, e))
    return broken


def refuse_broken_json(model_dir: str, param: str = "model_dir", cause: Optional[BaseException] = None) -> None:
    """A UsageError naming the first JSON file of ``model_dir`` that does not parse (and the others that do
    not), when there is one; ``cause``: the failure that sent us looking.
    """
    broken = broken_json_files(model_dir)
    if not broken:
        return
    name, error = broken[0]
    others = f" (nor do {', '.join(n for n, _ in broken[1:])})" if broken[1:] else ""
    raise UsageError(f"{name}: expected a whole JSON file (as save_pretrained() writes it); it does not parse "
                     f"({short_error(error, 120)}){others}: it is cut short or broken. Save or copy the model folder "
                     "again.", param=param, value=model_dir) from (cause or error)


# tokenizer_config.json's tokenizer_class of the generic fast tokenizer (its tokenizer.json is the whole of it), as
# transformers 4.x and 5.x save it
GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _saved_as_generic_fast(model_dir: str) -> bool:
    """Whether the folder's tokenizer is saved as the generic fast tokenizer: tokenizer_config.json's
    ``tokenizer_class`` one of :data:`GENERIC_FAST`, beside a tokenizer.json.
    """
    if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return False
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            return json.load(f).get("tokenizer_class") in GENERIC_FAST
    except (OSError, ValueError):
        return False


def _config_of_a_type_unknown_here(model_dir: str) -> dict:
    """``{"config": ...}`` for AutoTokenizer where config.json's model_type is one the installed transformers does
    not know (a family dist_eval builds) and tokenizer_config.json names its class: transformers 5.x reads
    config.json before that class, as its generic config, which refuses such a family's RoPE fields; 4.x reads
    the class alone. ``{}`` otherwise (transformers reads it as ever).
    """
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from dist_eval.backends.config_json import saved_model_type

    model_type = saved_model_type(model_dir)
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            named = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return {}
    return {"config": PretrainedConfig()} if named and model_type and model_type not in CONFIG_MAPPING else {}


def load_tokenizer(model_dir: str, param: str = "model_dir"):
    """The tokenizer saved in ``model_dir``, as its own transformers reads it; one-line refusals (a JSON
    file of the folder that does not parse is named).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        why = unsupported_tokenizer_feature(model_dir)
    except ValueError as e:
        refuse_broken_json(model_dir, param, e)
        raise
    if why:
        raise UsageError(why + ".", param=param, value=model_dir)
    try:
        if _saved_as_generic_fast(model_dir):
            # as saved: transformers 5.x's AutoTokenizer reads a generic tokenizer_class as the config's model
            # type's own class, rebuilt from the vocabulary with that family's pre-tokenizer (the demo's qwen2
            # folder: other ids, most unknown, an accuracy of 0.30 for 1.00; a word-level one saved by 5.x as
            # TokenizersBackend: no id at all); 4.x reads tokenizer.json
            return PreTrainedTokenizerFast.from_pretrained(model_dir)
        return AutoTokenizer.from_pretrained(model_dir, **_config_of_a_type_unknown_here(model_dir))
    except Exception as e:
        refuse_broken_json(model_dir, param, e)
        unknown_class = "does not exist or is not currently imported" in str(e)
        if not (unknown_class and os.path.isfile(os.path.join(model_dir, "tokenizer.json"))):
            raise UsageError(f"no usable tokenizer in the folder ({type(e).__name__}: {str(e)[:160]}). Save the "
                             "tokenizer there too (tokenizer.save_pretrained(folder)).", param=param,
                             value=model_dir) from e
    # a newer family's tokenizer class: its tokenizer.json is the whole of its ids
    return PreTrainedTokenizerFast.from_pretrained(model_dir)
