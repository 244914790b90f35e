"""The trainable part of a prompt-tuned classifier: prompt embeddings + ``score`` head, read
from every form users hold it in (one reader: :func:`load_checkpoint`).

dist_eval's own file (``torch.save`` of a plain dict, written by :func:`save_checkpoint`)::

    {"format": "dist_eval.checkpoint/1",
     "tuning_mode": None | "ptune" | "deep_ptune", "pre_seq_len": int, "num_labels": int,
     "family": None | model_type,                                          # optional
     "state_dict": {"score.weight": [K, H],
                    "prompt_embeddings.weight": [P, H],                    # ptune, deep_ptune
                    "intermediate_prompt_embeddings.weight": [P, L*H]}}    # deep_ptune

Also read, for a model of a given family (:class:`~dist_eval.backends.families.Family`):

- a state dict (``torch.save`` of a dict of tensors, or a ``.safetensors`` file), the
  trainable tensors only or the full ``model.state_dict()`` of a petals
  ``Distributed*ForSequenceClassification``, with the family's checkpoint prefix
  (``Family.checkpoint_prefix``) or none. The frozen model tensors of a full state dict
  (``Family.frozen``, ``lm_head``) are recognised by name and not used;
- petals issue #268's export, ``torch.save(model.transformer.prompt_embeddings, f)``: a
  pickled ``nn.Embedding`` (ptune) or a tuple/list of two (deep_ptune). It has no head:
  ``score.weight`` comes from ``head`` (a second file in one of the forms above, or the
  model folder when it holds a trained ``score.weight``);
- a Hugging Face PEFT prompt-learning adapter (PROMPT_TUNING, P_TUNING; SEQ_CLS or CAUSAL_LM), by its
  folder, its weights file or its hub id: :mod:`dist_eval.backends.peft_adapter` finds it and says what
  is read and refused; its prompts are ptune's (``TrainableState.adapter`` keeps what its config says,
  checked against the model by :func:`~dist_eval.backends.peft_adapter.check_base`).

Nothing runs arbitrary pickled code: every file is read with ``torch.load(...,
weights_only=True)``, with ``torch.nn.Embedding`` the only class added to its allow-list.
Refused, naming the keys: a prompt-looking key that is not one of the above, a key of
another family's model, any other key, and a checkpoint without a head.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Tuple

import torch

from dist_eval.atomic import atomic_write, file_sha256
from dist_eval.backends.families import FAMILIES, Family, checkpoint_prefixes, family_named, family_of_key
from dist_eval.errors import UsageError, param_name

if TYPE_CHECKING:
    from dist_eval.backends.peft_adapter import Adapter

FORMAT = "dist_eval.checkpoint/1"
HEAD = "score.weight"
PROMPT = "prompt_embeddings.weight"
DEEP_PROMPT = "intermediate_prompt_embeddings.weight"
TRAINABLE = (HEAD, PROMPT, DEEP_PROMPT)
SAFE_CLASSES = (torch.nn.Embedding,)  # what a #268 export pickles, beyond weights_only's own


@dataclass
class TrainableState:
    tuning_mode: Optional[str]
    pre_seq_len: int
    num_labels: int
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    adapter: Optional[Adapter] = None  # a PEFT adapter's: what its adapter_config.json says (checked on the model)


def save_checkpoint(
    path: str, tuning_mode: Optional[str], tensors: Dict[str, torch.Tensor], family: Optional[str] = None
) -> None:
    """Write prompts + head atomically (a reader never sees a half-written file).

    ``tensors``: short names (``score.weight``, ...) or any family's prefixed names.
    ``family`` (a model_type, optional) is stored and checked when the file is read.
    """
    state = _to_state(_trainable(tensors, None, path), path)
    if tuning_mode != state.tuning_mode:
        raise ValueError(f"tuning_mode={tuning_mode!r} but the tensors are those of {state.tuning_mode!r}")
    if family is not None:
        named = family_named(family)  # a family's alias (model.config.model_type of such a folder): its family
        if named is None:
            raise ValueError(f"family={family!r}: expected one of {sorted(FAMILIES)}")
        family = named.model_type
    payload = {
        "format": FORMAT,
        "tuning_mode": state.tuning_mode,
        "pre_seq_len": state.pre_seq_len,
        "num_labels": state.num_labels,
        "family": family,
        "state_dict": state.tensors,
    }
    atomic_write(path, lambda f: torch.save(payload, f), binary=True)


def load_checkpoint(path: str, family: Optional[Family] = None, head: Optional[str] = None) -> TrainableState:
    """Read ``path`` (any form above) for a ``family`` model (None: keys of any family).

    ``head``: where ``score.weight`` comes from when ``path`` has none (petals #268's prompt
    export): a second checkpoint file or a model folder holding a trained ``score.weight``.
    """
    tensors, adapter = _read_any(path, family)
    if head is None:
        if adapter is not None and HEAD not in tensors:
            raise UsageError(
                f"a PEFT {adapter.peft_type} adapter for task_type {adapter.task_type}: prompts for the language "
                f"model, no classifier head. Score the classes with {param_name('label_words')} W0 W1 ... (one word "
                f"per class), or give a trained head with {param_name('head')}.", param="checkpoint", value=path)
        return _with_adapter(_to_state(tensors, path), adapter)
    if HEAD in tensors:
        raise UsageError(f"it holds a classifier head, and so does {head}; pass only one of them.",
                         param="checkpoint", value=path)
    tensors[HEAD] = _head_tensor(head, family)
    return _with_adapter(_to_state(tensors, f"{path} + {head}"), adapter)


def _read_any(path: str, family: Optional[Family]) -> Tuple[Dict[str, torch.Tensor], Optional[Adapter]]:
    """(the trainable tensors of ``path``, the PEFT adapter it is or None): any form above."""
    from dist_eval.backends import peft_adapter

    adapter = peft_adapter.find(path, "checkpoint")
    if adapter is None:
        return _read(path, family, "checkpoint"), None
    raw = _load_safely(adapter.weights, "checkpoint")
    if not isinstance(raw, dict):
        raise UsageError(f"{os.path.basename(adapter.weights)} holds a {type(raw).__name__}, not PEFT's tensors. Save "
                         "the adapter again with save_pretrained().", param="checkpoint", value=path)
    return peft_adapter.trainable(adapter, raw, family.head if family else None, PROMPT, HEAD), adapter


def _with_adapter(state: TrainableState, adapter: Optional[Adapter]) -> TrainableState:
    state.adapter = adapter
    return state


def checkpoint_digest(path: str) -> str:
    """The SHA-256 of what decides a checkpoint's tensors: its file's bytes; for a PEFT adapter, its
    adapter_config.json's and weights' (a hub id's, in the HF cache).
    """
    from dist_eval.backends import peft_adapter

    adapter = peft_adapter.find(path, "checkpoint")
    if adapter is None:
        return file_sha256(path)
    config = os.path.join(os.path.dirname(adapter.weights), peft_adapter.CONFIG)
    return hashlib.sha256(f"{file_sha256(config)}:{file_sha256(adapter.weights)}".encode()).hexdigest()


def load_head(head: str, family: Optional[Family] = None) -> TrainableState:
    """A classifier head alone, no prompts (``--head`` without ``--checkpoint``): the head of a
    causal LM folder (a family without ``*ForSequenceClassification`` saves, e.g. GLM-4.5).
    """
    return _to_state({HEAD: _head_tensor(head, family)}, head)


def _head_tensor(head: str, family: Optional[Family]) -> torch.Tensor:
    """``score.weight`` of ``head``: a file holding it alone, or a model folder holding a trained one."""
    if os.path.isdir(head):
        from dist_eval.backends.peft_adapter import is_adapter_folder

        if is_adapter_folder(head):
            raise UsageError(f"a PEFT adapter's folder, not a head: pass it as {param_name('checkpoint')} (a SEQ_CLS "
                             "adapter's head is read from it).", param="head", value=head)
        state = model_dir_trainable_state(head)
        if state is None:
            raise UsageError("the model folder has no score.weight to use as the classifier head.",
                             param="head", value=head)
        return state.tensors[HEAD]
    head_tensors = _read(head, family, "head")
    if set(head_tensors) != {HEAD}:
        raise UsageError(f"a head file holds only score.weight; this one holds {sorted(head_tensors)}.",
                         param="head", value=head)
    return head_tensors[HEAD]


def load_prompts(path: str, family: Optional[Family], num_labels: int) -> tuple:
    """(the prompts of ``path`` as the state of a ``num_labels``-class zero-shot model, whether
    the file also held a classifier head, which is not used). Refuses a file without prompts.
    """
    tensors, adapter = _read_any(path, family)
    had_head = tensors.pop(HEAD, None) is not None
    if PROMPT not in tensors:
        raise UsageError(
            "it holds no prompt embeddings (only a classifier head), and label words use none of the rest: the "
            "language model's head scores them. Drop --checkpoint, or pass a ptune/deep_ptune checkpoint.",
            param="checkpoint", value=path,
        )
    return _with_adapter(_to_state(tensors, path, num_labels), adapter), had_head


def _short(keys: Iterable[str], limit: int = 6) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def _load_safely(path: str, param: str):
    """``torch.load`` with ``weights_only=True`` and ``nn.Embedding`` allowed (or a safetensors file)."""
    if os.path.isdir(path):
        raise UsageError(_folder_given(path), param=param, value=path)
    if not os.path.isfile(path):
        raise UsageError("no such file or folder. Pass the file with the trained prompts and head, or a PEFT "
                         "adapter's folder, weights file or hub id.", param=param, value=path)
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        with torch.serialization.safe_globals(list(SAFE_CLASSES)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        try:
            refused = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # not a torch zip file at all
            refused = []
        allowed = {f"{c.__module__}.{c.__name__}" for c in SAFE_CLASSES}
        refused = [name for name in refused if name not in allowed]
        if refused:
            raise UsageError(
                f"it pickles classes that are not read, to keep arbitrary code from running: {', '.join(refused)}. "
                "Save tensors instead: torch.save(model.state_dict(), f), or "
                "torch.save(model.transformer.prompt_embeddings, f) (an nn.Embedding is read).",
                param=param, value=path,
            ) from e
        raise UsageError(f"not a readable torch checkpoint ({type(e).__name__}: {e}).",
                         param=param, value=path) from e


def _folder_given(path: str) -> str:
    """What a folder given for a checkpoint file is, and the fix."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return (f"a model folder (config.json), not a checkpoint file. Pass it as {param_name('model_dir')}, or as "
                f"{param_name('head')} to use the score.weight trained in it; a checkpoint is a file, or a PEFT "
                "adapter's folder (adapter_config.json).")
    files = sorted(n for n in os.listdir(path) if n.endswith((".pt", ".pth", ".bin", ".safetensors")))
    held = f"it holds {_short(files, 4)}" if files else "it holds no .pt, .bin or .safetensors file"
    return (f"a folder, not a checkpoint file, and no PEFT adapter (no adapter_config.json in it; {held}). Pass the "
            "checkpoint file itself, or a PEFT adapter's folder.")


def _read(path: str, family: Optional[Family], param: str) -> Dict[str, torch.Tensor]:
    """The trainable tensors (short names) of one file, any form."""
    obj = _load_safely(path, param)
    embedded = _embedding_form(obj, path, param)
    if embedded is not None:
        return embedded
    if not isinstance(obj, dict):
        raise UsageError(
            f"holds a {type(obj).__name__}; expected a state dict, dist_eval's checkpoint or an nn.Embedding "
            "(petals issue #268's export).", param=param, value=path,
        )
    if "prompt_embeddings" in obj:  # PEFT's key (petals' is prompt_embeddings.weight)
        raise UsageError("holds a PEFT adapter's weights (prompt_embeddings) without the adapter_config.json that "
                         "says what they are. Pass the adapter's folder, or its weights file with adapter_config.json "
                         "beside it, as save_pretrained() wrote them.", param=param, value=path)
    if obj.get("format") == FORMAT:
        saved = obj.get("family")
        if saved is not None and family is not None and saved != family.model_type:
            raise UsageError(f"saved for a {saved} model; the model is {family.model_type}. Pass the matching "
                             "--model or --checkpoint.", param=param, value=path)
        obj = obj["state_dict"]
    return _trainable(obj, family, path, param)


def _embedding_form(obj, path: str, param: str) -> Optional[Dict[str, torch.Tensor]]:
    """Petals #268: an nn.Embedding, or a tuple/list of two for deep_ptune."""
    if isinstance(obj, torch.nn.Embedding):
        return {PROMPT: obj.weight.detach()}
    if isinstance(obj, (tuple, list)) and obj and all(isinstance(o, torch.nn.Embedding) for o in obj):
        if len(obj) != 2:
            raise UsageError(
                f"a sequence of {len(obj)} nn.Embedding modules; expected one (ptune) or two "
                "(deep_ptune: prompt_embeddings, intermediate_prompt_embeddings).", param=param, value=path,
            )
        first, second = (o.weight.detach() for o in obj)
        if first.shape[1] > second.shape[1]:  # intermediate prompts are L*H wide, the prompts H
            first, second = second, first
        return {PROMPT: first, DEEP_PROMPT: second}
    return None


def _is_frozen(short: str, families: List[Family]) -> bool:
    return short.startswith("lm_head.") or any(short.split(".", 1)[0] in f.frozen for f in families)


def _classify(key: str, family: Optional[Family]) -> tuple:
    """(kind, short name): kind is trainable, frozen, foreign or unknown."""
    prefixes = (family.checkpoint_prefix,) if family else checkpoint_prefixes()
    others = set(checkpoint_prefixes()) - set(prefixes)
    short = next((key[len(p):] for p in prefixes if key.startswith(p)), key)
    if short == key and short not in TRAINABLE and any(key.startswith(p) for p in others):
        return "foreign", key
    if short in TRAINABLE:
        return "trainable", short
    if "prompt" in short:
        return "unknown", short
    named = family_of_key(key)
    if family is not None and named and named != (family.built_on or family.model_type):  # keys as its base's
        return "foreign", key
    families = [family] if family else list(FAMILIES.values())
    return ("frozen" if _is_frozen(short, families) else "unknown"), short


def _owners(key: str) -> List[str]:
    """The families a foreign key may come from: by its name, else by its prefix."""
    named = family_of_key(key)
    return [named] if named else [f.model_type for f in FAMILIES.values()
                                  if not f.built_on and key.startswith(f.checkpoint_prefix)]  # not twice a layout


def _trainable(raw, family: Optional[Family], path: str, param: str = "checkpoint") -> Dict[str, torch.Tensor]:
    """The trainable tensors of a state dict (short names); refuses keys it cannot place."""
    not_tensors = [str(k) for k, v in raw.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise UsageError(f"expected a state dict (names -> tensors); these entries are not tensors: "
                         f"{_short(not_tensors)}. Save model.state_dict() itself.", param=param, value=path)
    tensors: Dict[str, torch.Tensor] = {}
    seen: Dict[str, List[str]] = {"foreign": [], "unknown": [], "frozen": []}
    for key in raw:
        kind, short = _classify(key, family)
        if kind != "trainable":
            seen[kind].append(key)
        elif short in tensors:
            raise UsageError(f"{short} appears twice (with and without a prefix).", param=param, value=path)
        else:
            tensors[short] = raw[key]
    name = family.model_type if family else "dist_eval"
    if seen["foreign"]:
        owners = sorted({owner for key in seen["foreign"] for owner in _owners(key)} - {name})
        raise UsageError(
            f"keys {_short(seen['foreign'])} are those of a {' or '.join(owners)} model, and the model is {name}. "
            "Pass the checkpoint trained for this model, or the model it was trained for.", param=param, value=path,
        )
    if seen["unknown"]:
        raise UsageError(
            f"keys not recognised for a {name} model: {_short(seen['unknown'])}. Read are {', '.join(TRAINABLE)} "
            "(with the family's prefix or none) and the model's own tensors; nothing is ignored, so rename or "
            "remove these.", param=param, value=path,
        )
    return tensors


def _to_state(tensors: Dict[str, torch.Tensor], source: str, num_labels: Optional[int] = None) -> TrainableState:
    """The state of ``tensors``; ``num_labels`` given: a model without a classifier head (zero-shot)."""
    if HEAD not in tensors and num_labels is None:
        raise UsageError(
            "no classifier head (score.weight) in it. Pass a checkpoint with the head, or give the head "
            "with --head FILE|MODEL_DIR (petals issue #268's prompt export has none).",
            param="checkpoint", value=source,
        )
    if DEEP_PROMPT in tensors and PROMPT not in tensors:
        raise UsageError(f"{DEEP_PROMPT} without {PROMPT}; deep_ptune trains both.", param="checkpoint", value=source)
    for key, value in tensors.items():
        if value.ndim != 2:
            raise UsageError(f"{key} has shape {list(value.shape)}; expected a matrix.",
                             param="checkpoint", value=source)
    mode = "deep_ptune" if DEEP_PROMPT in tensors else "ptune" if PROMPT in tensors else None
    pre_seq_len = int(tensors[PROMPT].shape[0]) if mode else 0
    if mode == "deep_ptune" and tensors[DEEP_PROMPT].shape[0] != pre_seq_len:
        raise UsageError(
            f"{PROMPT} has {pre_seq_len} prompt vectors but {DEEP_PROMPT} has {tensors[DEEP_PROMPT].shape[0]}; "
            "they are trained together.", param="checkpoint", value=source,
        )
    clean = {k: v.detach().to(torch.float32).cpu().contiguous() for k, v in tensors.items()}
    return TrainableState(mode, pre_seq_len, int(clean[HEAD].shape[0]) if num_labels is None else num_labels, clean)


def model_dir_trainable_state(model_dir: str) -> Optional[TrainableState]:
    """The head stored in the model folder itself (a fine-tuned classifier), if any."""
    from safetensors import safe_open

    names = []
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map[k] for k in weight_map if k.endswith(HEAD)))
    elif os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        names = ["model.safetensors"]
    for name in names:
        with safe_open(os.path.join(model_dir, name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                if key.endswith(HEAD):
                    return _to_state({HEAD: f.get_tensor(key)}, model_dir)
    return None
