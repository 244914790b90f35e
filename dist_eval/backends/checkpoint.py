"""The trainable part of a prompt-tuned classifier: prompt embeddings + ``score`` head.

File format (``torch.save`` of a plain dict, loaded with ``weights_only=True``)::

    {"format": "dist_eval.checkpoint/1",
     "tuning_mode": None | "ptune" | "deep_ptune", "pre_seq_len": int, "num_labels": int,
     "state_dict": {"score.weight": [K, H],
                    "prompt_embeddings.weight": [P, H],                    # ptune, deep_ptune
                    "intermediate_prompt_embeddings.weight": [P, L*H]}}    # deep_ptune

A bare state dict works too, e.g. the trainable tensors of a petals
``Distributed*ForSequenceClassification`` saved after prompt tuning (its prompts under
the family's checkpoint prefix, e.g. ``<prefix>prompt_embeddings.weight``, and
``score.weight``): the prefix (:attr:`dist_eval.backends.families.Family.checkpoint_prefix`)
is dropped and the tuning mode is read from which tensors are present.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from dist_eval.atomic import atomic_write
from dist_eval.backends.families import Family, checkpoint_prefixes
from dist_eval.errors import UsageError

FORMAT = "dist_eval.checkpoint/1"
_KEYS = ("score.weight", "prompt_embeddings.weight", "intermediate_prompt_embeddings.weight")


@dataclass
class TrainableState:
    tuning_mode: Optional[str]
    pre_seq_len: int
    num_labels: int
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)


def save_checkpoint(path: str, tuning_mode: Optional[str], tensors: Dict[str, torch.Tensor]) -> None:
    """Write prompts + head atomically (a reader never sees a half-written file)."""
    state = _normalise(tensors, path)
    if tuning_mode != state.tuning_mode:
        raise ValueError(f"tuning_mode={tuning_mode!r} but the tensors are those of {state.tuning_mode!r}")
    payload = {
        "format": FORMAT,
        "tuning_mode": state.tuning_mode,
        "pre_seq_len": state.pre_seq_len,
        "num_labels": state.num_labels,
        "state_dict": {k: v.detach().to(torch.float32).cpu().contiguous() for k, v in state.tensors.items()},
    }
    atomic_write(path, lambda f: torch.save(payload, f), binary=True)


def _prefixes(family: Optional[Family]) -> tuple:
    return (family.checkpoint_prefix,) if family is not None else checkpoint_prefixes()


def _normalise(raw: Dict[str, torch.Tensor], source: str, family: Optional[Family] = None) -> TrainableState:
    tensors = {}
    prefixes = _prefixes(family)
    for key, value in raw.items():
        short = next((key[len(p):] for p in prefixes if key.startswith(p)), key)
        if short in _KEYS:
            tensors[short] = value
    if "score.weight" not in tensors:
        raise UsageError(
            f"no classifier head ('score.weight') in it; found {sorted(raw)[:6]}. "
            "Pass a checkpoint saved by dist_eval or the trainable state dict of a prompt-tuned model.",
            param="checkpoint", value=source,
        )
    if "intermediate_prompt_embeddings.weight" in tensors:
        tuning_mode = "deep_ptune"
    elif "prompt_embeddings.weight" in tensors:
        tuning_mode = "ptune"
    else:
        tuning_mode = None
    pre_seq_len = int(tensors["prompt_embeddings.weight"].shape[0]) if tuning_mode else 0
    return TrainableState(tuning_mode, pre_seq_len, int(tensors["score.weight"].shape[0]), tensors)


def load_checkpoint(path: str, family: Optional[Family] = None) -> TrainableState:
    """Read a checkpoint written by :func:`save_checkpoint` or a bare state dict (whose
    keys may carry ``family``'s checkpoint prefix; any family's when None).
    """
    if not os.path.isfile(path):
        raise UsageError(
            "no such file. Pass the file with the trained prompts and head.", param="checkpoint", value=path
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(
            f"not a readable torch checkpoint ({type(e).__name__}: {e}).", param="checkpoint", value=path
        ) from e
    if not isinstance(payload, dict):
        raise UsageError(f"expected a dict of tensors, got {type(payload).__name__}.", param="checkpoint", value=path)
    raw = payload["state_dict"] if payload.get("format") == FORMAT else payload
    return _normalise(raw, path, family)


def model_dir_trainable_state(model_dir: str, family: Optional[Family] = None) -> Optional[TrainableState]:
    """The head stored in the model folder itself (a fine-tuned classifier), if any."""
    from safetensors import safe_open

    names = []
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map[k] for k in weight_map if k.endswith("score.weight")))
    elif os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        names = ["model.safetensors"]
    for name in names:
        with safe_open(os.path.join(model_dir, name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                if key.endswith("score.weight"):
                    return _normalise({"score.weight": f.get_tensor(key)}, model_dir, family)
    return None
