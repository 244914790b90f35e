"""Hugging Face PEFT's prompt-learning adapters, read as ``PeftModel.save_pretrained`` saves them.

An adapter is found (:func:`find`) as a folder holding ``adapter_config.json`` and
``adapter_model.safetensors`` (an older PEFT's ``adapter_model.bin``), as that weights file named alone
(``adapter_config.json`` beside it), or as a hub id whose repository holds them: adapter_config.json is
fetched first, and the weights only once it is read (:func:`dist_eval.backends.hub.adapter_folder`). Both
files are plain (JSON, safetensors): PEFT is not needed to read them.

Read, what petals' ptune computes (prompt vectors before the text, on the client; the blocks untouched):

- ``peft_type`` ``PROMPT_TUNING`` and ``P_TUNING``: ``prompt_embeddings`` [num_virtual_tokens, hidden], the
  prompts. For ``P_TUNING`` PEFT's save stores what its prompt encoder computes, and PEFT's loaded adapter
  prepends those vectors as they are: nothing is computed from them here either;
- ``task_type`` ``SEQ_CLS``: the classifier head, from ``modules_to_save``, under the name PEFT writes:
  ``base_model.`` + the family's head (``Family.head``, ``score`` in every family here) + ``.weight``;
- ``task_type`` ``CAUSAL_LM``: the prompts alone; the classes are scored with label words through the LM head.

Checked: adapter_config.json's ``num_virtual_tokens`` is the saved prompts' count, and against the model
(:func:`check_base`) its ``token_dim`` and ``num_layers`` are the model's and its ``base_model_name_or_path``
names the model given. Refused from adapter_config.json alone, before a weight is read or fetched: the
methods that change what the blocks compute (PREFIX_TUNING's keys and values in every block, LoRA and
every other weight adapter: the blocks run on the servers), the other prompt methods, the other tasks.
Any key but the prompts and the head is refused by name: nothing is applied in part.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, Optional

from dist_eval.errors import UsageError, param_name

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # PEFT's names, the safetensors first
READ = ("PROMPT_TUNING", "P_TUNING")
TASKS = ("SEQ_CLS", "CAUSAL_LM")
PROMPTS = "prompt_embeddings"  # PEFT's key of the prompts, both methods
# the methods that put learned keys and values (or gated prompts) inside the blocks' attention
IN_THE_BLOCKS = ("PREFIX_TUNING", "CARTRIDGE", "ADAPTION_PROMPT")
READ_ARE = "PROMPT_TUNING and P_TUNING adapters are read (prompts before the text, computed here)"
_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")


@dataclass(frozen=True)
class Adapter:
    """A PEFT adapter found: its files and what adapter_config.json says of it."""

    source: str  # what was given: a folder, the weights file or a hub id
    weights: str  # the weights file (local)
    peft_type: str
    task_type: str
    num_virtual_tokens: int
    token_dim: Optional[int]
    num_layers: Optional[int]
    base: str  # base_model_name_or_path ("" when not saved)


def find(path: str, param: str = "checkpoint") -> Optional[Adapter]:
    """The PEFT adapter ``path`` names (a folder, its weights file, or a hub id), its config read and
    checked; None where ``path`` is no adapter (another checkpoint form, or nothing: the reader says which).
    """
    if os.path.isdir(path):
        return _local(path, os.path.join(path, CONFIG), _weights_in(path), param) if is_adapter_folder(path) else None
    if os.path.isfile(path):
        beside = os.path.join(os.path.dirname(path) or ".", CONFIG)
        named = os.path.basename(path).startswith("adapter_model.")
        return _local(path, beside, path, param) if named and os.path.isfile(beside) else None
    if looks_like_hub_id(path):
        from dist_eval.backends.hub import adapter_folder

        folder = adapter_folder(path, (CONFIG, WEIGHTS), lambda config_file: read_config(config_file, path, param),
                                param)
        return _local(path, os.path.join(folder, CONFIG), _weights_in(folder), param)
    return None


def is_adapter_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG))


def looks_like_hub_id(path: str) -> bool:
    """``org/name`` that is no path here, not a checkpoint file's name (a missing ``out/ck.pt`` is a typo) and a
    name the hub allows (``runs/my adapter``, a folder mistyped, is no hub id: its reader says it is not there).
    """
    if os.path.exists(path) or path.count("/") != 1 or path.startswith((".", "/", "~")) or not all(path.split("/")) \
            or path.lower().endswith(_CHECKPOINT_SUFFIXES):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def _weights_in(folder: str) -> str:
    return next((os.path.join(folder, n) for n in WEIGHTS if os.path.isfile(os.path.join(folder, n))),
                os.path.join(folder, WEIGHTS[0]))


def _local(source: str, config_file: str, weights: str, param: str) -> Adapter:
    adapter = read_config(config_file, source, param)
    if not os.path.isfile(weights):
        raise UsageError(f"a PEFT adapter without its weights: {CONFIG} is there but not {' or '.join(WEIGHTS)}. "
                         "Save it again with save_pretrained(), or copy the weights file beside it.",
                         param=param, value=source)
    return Adapter(source, weights, *adapter)


def read_config(config_file: str, source: str, param: str) -> tuple:
    """(peft_type, task_type, num_virtual_tokens, token_dim, num_layers, base) of ``config_file``; a method
    or task that is not read is refused here, before any weight is read or fetched.
    """
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read the PEFT adapter's {CONFIG} ({type(e).__name__}: {e}). Save the adapter "
                         "again with save_pretrained().", param=param, value=source) from e
    if not isinstance(config, dict):
        raise UsageError(f"{CONFIG} holds a {type(config).__name__}, not PEFT's JSON object. Save the adapter again "
                         "with save_pretrained().", param=param, value=source)
    peft_type, task_type = str(config.get("peft_type")), str(config.get("task_type"))
    refuse_method(peft_type, source, param)
    if task_type not in TASKS:
        raise UsageError(f"a PEFT {peft_type} adapter for task_type {task_type}: read are SEQ_CLS (the prompts and "
                         "the classifier head) and CAUSAL_LM (the prompts, the classes scored with --label-words). "
                         "Train it with task_type SEQ_CLS or CAUSAL_LM.", param=param, value=source)
    submodules = config.get("num_transformer_submodules") or 1
    if submodules != 1:
        raise UsageError(f"a PEFT adapter of an encoder-decoder model (num_transformer_submodules {submodules} in "
                         f"{CONFIG}); the models here are decoder-only. Pass an adapter trained on --model.",
                         param=param, value=source)
    tokens = config.get("num_virtual_tokens")
    if not isinstance(tokens, int) or tokens < 1:
        raise UsageError(f"num_virtual_tokens {tokens!r} in {CONFIG}: expected a positive count of prompt vectors. "
                         "Save the adapter again with save_pretrained().", param=param, value=source)
    return (peft_type, task_type, tokens, config.get("token_dim"), config.get("num_layers"),
            str(config.get("base_model_name_or_path") or ""))


def refuse_method(peft_type: str, source: str, param: str) -> None:
    """A UsageError for a method that is not read: why (what it changes) and what would serve it."""
    if peft_type in READ:
        return
    why, serve = _refusal(peft_type)
    raise UsageError(f"a PEFT {peft_type} adapter: {why}, so it is not read (nothing of it applied). {serve}",
                     param=param, value=source)


def _refusal(peft_type: str) -> tuple:
    """(why a ``peft_type`` adapter is not read, what would serve it)."""
    if peft_type in IN_THE_BLOCKS:
        return ("it adds learned keys and values inside the blocks' attention, and the blocks run on the swarm's "
                "servers, which compute them as saved", "What serves it is the whole model with PEFT "
                "(PeftModel.from_pretrained) on one machine; " + READ_ARE + ".")
    if peft_type == "MULTITASK_PROMPT_TUNING":
        return ("its prompts depend on a task id given with each row, which dist_eval does not take",
                "Evaluate it with PEFT (task_ids=...), or train a PROMPT_TUNING adapter for the task; "
                + READ_ARE + ".")
    if peft_type == "CPT":
        return ("its prompts are built from context examples' tokens with trained offsets", READ_ARE + ".")
    return ("it changes the blocks' weights, and the blocks run on the swarm's servers, which compute them as "
            "saved", "Merge it into the model and serve that: PeftModel.from_pretrained(base, ADAPTER)"
            f".merge_and_unload().save_pretrained(DIR), then {param_name('model_dir')} DIR; " + READ_ARE + ".")


def trainable(adapter: Adapter, raw: dict, head: Optional[str], prompt_key: str, head_key: str) -> Dict:
    """The prompts (``prompt_key``) and, for SEQ_CLS, the head (``head_key``) of ``raw`` (the weights file's
    tensors); ``head``: the family's classifier name (None: ``score``, every family's). Any other key is refused.
    """
    raw = dict(raw)
    prompts = raw.pop(PROMPTS, None)
    source, where = adapter.source, f"the PEFT {adapter.peft_type} adapter's weights"
    if prompts is None or getattr(prompts, "ndim", 0) != 2:
        raise UsageError(f"{where} hold no {PROMPTS} matrix (keys: {', '.join(sorted(raw)) or 'none'}). Save the "
                         "adapter again with save_pretrained().", param="checkpoint", value=source)
    if prompts.shape[0] != adapter.num_virtual_tokens:
        raise UsageError(f"num_virtual_tokens {adapter.num_virtual_tokens} in {CONFIG}, but {PROMPTS} holds "
                         f"{prompts.shape[0]} prompt vectors: the two files are of different adapters. Save the "
                         "adapter again with save_pretrained().", param="checkpoint", value=source)
    tensors = {prompt_key: prompts}
    saved_head = f"base_model.{head or 'score'}.weight"
    if adapter.task_type == "SEQ_CLS":
        if saved_head not in raw:
            raise UsageError(f"a SEQ_CLS adapter without its classifier head: {where} hold no {saved_head} (PEFT "
                             f"saves it from modules_to_save, {head or 'score'} by default). Save the adapter with "
                             "the head in modules_to_save.", param="checkpoint", value=source)
        tensors[head_key] = raw.pop(saved_head)
    if raw:
        raise UsageError(f"{where} hold {', '.join(sorted(raw))}, which are not read: dist_eval applies the prompts "
                         "and the classifier head, nothing else (other modules_to_save would change the model's own "
                         "weights), and ignores nothing. Save the adapter without them.",
                         param="checkpoint", value=source)
    return tensors


def check_base(adapter: Adapter, config, model_dir: str) -> None:
    """The adapter was trained on this model: adapter_config.json's ``token_dim`` and ``num_layers`` are
    ``config``'s, and its ``base_model_name_or_path`` names ``model_dir`` (:func:`names_the_model`).
    """
    # each a hub id where it is the HF cache's snapshot of one: what the user gave, and what survives a download
    shown, base = _hub_repo(model_dir) or model_dir, _hub_repo(adapter.base) or adapter.base
    model = param_name("model_dir", shown)
    saved, has = (adapter.token_dim, adapter.num_layers), (config.hidden_size, config.num_hidden_layers)
    if any(s is not None and s != h for s, h in zip(saved, has)):
        raise UsageError(
            f"a PEFT adapter trained on {base or 'another model'} (token_dim {saved[0]}, num_layers "
            f"{saved[1]} in {CONFIG}), and {model} has hidden size {has[0]} and {has[1]} layers. Pass the model it "
            f"was trained on as {param_name('model_dir')}, or the adapter trained on this one.",
            param="checkpoint", value=adapter.source)
    if adapter.base and not names_the_model(adapter.base, model_dir):
        raise UsageError(
            f"a PEFT adapter trained on {base} (base_model_name_or_path in {CONFIG}), and {model} is another "
            f"model. Pass {param_name('model_dir', base)}; if {shown} is that model under another name, "
            f"name its folder {os.path.basename(os.path.normpath(base))} or set base_model_name_or_path in "
            f"{CONFIG} to {shown}.", param="checkpoint", value=adapter.source)


def names_the_model(base: str, model_dir: str) -> bool:
    """``base`` (a folder or hub id, as PEFT saved it) names ``model_dir``: the same folder, the same hub
    repository (a snapshot of the HF cache), the name config.json saved (``_name_or_path``), or the same
    folder or repository name (a copy of the model under its own name).
    """
    if os.path.isdir(base) and os.path.realpath(base) == os.path.realpath(model_dir):
        return True
    model = {model_dir, os.path.realpath(model_dir), _saved_name(model_dir) or model_dir}
    return bool(_names(base) & set().union(*map(_names, model)))


def _names(path: str) -> set:
    """A folder's or hub id's names (lower case): itself, its last part, the hub repository of an HF cache folder."""
    path = os.path.normpath(path)
    found = {path.lower(), os.path.basename(path).lower()}
    repo = _hub_repo(path)
    return found | ({repo.lower(), repo.split("/")[-1].lower()} if repo else set())


def _hub_repo(path: str) -> Optional[str]:
    """``org/name`` of a folder of the HF cache (``.../models--org--name/snapshots/<commit>``), else None."""
    parts = os.path.normpath(path).split(os.sep)
    for i, part in enumerate(parts[:-2]):
        if part.startswith("models--") and parts[i + 1] == "snapshots":
            return part[len("models--"):].replace("--", "/")
    return None


def _saved_name(model_dir: str) -> Optional[str]:
    """config.json's ``_name_or_path`` (what transformers saved the model from), if any."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            name = json.load(f).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name else None


def refuse_as_model(path: str, param: str = "model_dir") -> None:
    """A PEFT adapter's folder or file given where the model folder goes, named as what it is."""
    adapter = os.path.isdir(path) and is_adapter_folder(path) and not os.path.isfile(os.path.join(path, "config.json"))
    if adapter:
        try:
            with open(os.path.join(path, CONFIG), encoding="utf-8") as f:
                base = json.load(f).get("base_model_name_or_path") or "the model it was trained on"
        except (OSError, ValueError, AttributeError):
            base = "the model it was trained on"
        raise UsageError(f"a PEFT adapter's folder ({CONFIG}), not a model. Pass it as {param_name('checkpoint')}, and "
                         f"its base model ({base}) as {param_name(param)}.", param=param, value=path)
    if os.path.isfile(path):
        what = "a PEFT adapter's weights file" if os.path.basename(path).startswith("adapter_model.") else "a file"
        raise UsageError(f"{what}, not a model folder. Pass the folder saved with save_pretrained() (config.json, "
                         "weights, tokenizer); prompts and a head (a checkpoint, a PEFT adapter) go to "
                         f"{param_name('checkpoint')}.", param=param, value=path)
