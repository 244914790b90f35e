"""Model objects a caller holds in memory, as the :class:`LoadedModel` that ``load_model`` gives.

A training loop evaluates the model it trains, right after an epoch, without saving it:

- petals' ``Distributed*ForSequenceClassification`` of a family (as petals' prompt-tuning
  workflow holds it: ``tuning_mode`` "ptune"/"deep_ptune", trained prompts and ``score``
  head, blocks on the swarm) is run by the petals backend's adapter
  (:class:`~dist_eval.backends.petals.backend.PetalsClassifier`), which leaves the caller's
  client running when the evaluation ends;
- transformers' ``*ForSequenceClassification`` of a family is run by the local backend's
  (:class:`~dist_eval.backends.local.PromptTunedClassifier`, no prompts).

Both adapters implement :class:`~dist_eval.backends.base.Backend`, as ``load_model``'s backends do.
The same code as ``load_model``'s, on the same weights: the logits are the same, bit for
bit. During :func:`evaluation_model` the model is in eval mode; afterwards every module
has its own ``training`` flag back. A ``DistributedDataParallel`` wrapper is looked
through (its ``.module`` is evaluated; no gradient is computed). Another class of a
family (a ``*ForCausalLM``), or a transformers model of another architecture that is not
a ``*ForSequenceClassification``, is refused; any other callable ``input_ids -> logits``
is used as it is.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

from torch import nn

from dist_eval.backends.arguments import DEFAULT_SWARM_TIMEOUT, read_label_words
from dist_eval.backends.classifier import LoadedModel, class_names
from dist_eval.backends.families import Family, family_of_object
from dist_eval.errors import UsageError


class _Shown(str):
    """A value shown in an error as ``<ClassName>``, not as a quoted string."""

    def __repr__(self) -> str:
        return f"<{self}>"


@dataclass
class Task:
    """What the model tells about the task, completed by the caller's arguments (:func:`task_of`)."""

    model: object  # the model as evaluated (:func:`evaluation_model`'s)
    forward: Callable
    num_labels: Optional[int]
    pad_token_id: Optional[int]
    label_names: Optional[Sequence[str]]
    prompt_tokens: int  # tokens a forward adds to each row: prompt vectors, appended label-word tokens
    label_words: Optional[tuple] = None  # a zero-shot model's
    attention_window: int = 0  # positions a row may span, prompts included (0: any)
    attention_limit: str = "sliding attention window"  # what attention_window is (the refusal names it)


@contextmanager
def evaluation_task(model, num_labels=None, pad_token_id=None, label_names=None, label_words=None) -> Iterator[Task]:
    """:func:`evaluation_model` of ``model`` and its task's facts (:func:`task_of`), for the evaluation."""
    with evaluation_model(model) as adapted:
        yield task_of(adapted, num_labels, pad_token_id, label_names, label_words)


def task_of(model, num_labels, pad_token_id, label_names, label_words=None) -> Task:
    """The forward callable and the task's facts: from a LoadedModel, else from ``model.config``; the
    arguments given win. ``label_words`` given must be the model's.
    """
    if isinstance(model, LoadedModel):
        return Task(
            model=model,
            forward=model.module,
            num_labels=num_labels or model.num_labels,
            pad_token_id=model.pad_token_id if pad_token_id is None else pad_token_id,
            label_names=label_names or (list(model.id2label.values()) if model.id2label else None),
            prompt_tokens=model.prompt_tokens + model.appended_tokens,
            label_words=_label_words_of(model.label_words, label_words),
            attention_window=model.attention_window,
            attention_limit=model.attention_limit,
        )
    config = getattr(model, "config", None)
    return Task(
        model=model,
        forward=model,
        num_labels=num_labels if num_labels is not None else getattr(config, "num_labels", None),
        pad_token_id=pad_token_id if pad_token_id is not None else getattr(config, "pad_token_id", None),
        label_names=label_names,
        prompt_tokens=0,
        label_words=_label_words_of(None, label_words),
    )


def _label_words_of(own: Optional[tuple], label_words) -> Optional[tuple]:
    """The model's label words (``own``); ``label_words`` given must be them."""
    given = read_label_words(label_words)
    if given is not None and own is None:
        raise UsageError("the model scores the classes with a classifier head, not label words. Load it with "
                         "load_model(..., label_words=...) to score words.", param="label_words", value=list(given))
    if given is not None and given != own:
        raise UsageError(f"the model was loaded to score {list(own)}; pass those or none.",
                         param="label_words", value=list(given))
    return own


@contextmanager
def evaluation_model(model, swarm_timeout: float = DEFAULT_SWARM_TIMEOUT) -> Iterator[object]:
    """``model`` as ``evaluate`` computes with it, in eval mode, restored on exit: a
    :class:`LoadedModel` (given, or adapted from a model object), else the callable itself.
    """
    adapted = as_loaded_model(model, swarm_timeout)
    module = adapted.module if isinstance(adapted, LoadedModel) else adapted
    modes = [(m, m.training) for m in module.modules()] if isinstance(module, nn.Module) else []
    attention = _attention_as_loaded(module) if adapted is not model else None
    try:
        if modes:
            module.eval()
        yield adapted
    finally:
        for m, training in modes:
            m.training = training
        if attention is not None:
            attention[0]._attn_implementation = attention[1]
        if adapted is not model and isinstance(adapted, LoadedModel):
            adapted.close()  # the adapter's own parts only; the caller's client stays up


def _attention_as_loaded(module) -> Optional[tuple]:
    """A caller's transformers classifier set, for the evaluation, to the attention ``load_model`` builds its family
    with (Family.local_attention, where transformers offers a choice: its default rounds otherwise, and the object
    would not give load_model's bits): (its config, the attention it had) to put back, or None where nothing changed.
    """
    from dist_eval.backends.compat import attention_choice

    config = getattr(getattr(module, "hf_model", None), "config", None)
    wanted = attention_choice(module.family).get("attn_implementation") if config is not None else None
    if wanted is None or config._attn_implementation == wanted:
        return None
    had, config._attn_implementation = config._attn_implementation, wanted
    return config, had


def as_loaded_model(model, swarm_timeout: float = DEFAULT_SWARM_TIMEOUT):
    """A :class:`LoadedModel` for a family's sequence classifier object (petals' or
    transformers'); ``model`` itself for a LoadedModel or another usable callable;
    a UsageError for a model object that cannot classify.
    """
    if isinstance(model, LoadedModel):
        return model
    parallel = sys.modules.get("torch.nn.parallel")
    if parallel is not None and isinstance(model, parallel.DistributedDataParallel):
        model = model.module
    _refuse_a_prompt_learning_peft_model(model)  # inside DistributedDataParallel too: a training loop's
    transformers = sys.modules.get("transformers")  # a transformers model: transformers is loaded
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return model
    family, kind = family_of_object(model)
    if not kind:
        if family is None and type(model).__name__.endswith("ForSequenceClassification"):
            return model  # another architecture's classifier: called as it is (its .logits)
        raise _refused(model, family, "not a sequence classifier (its logits are not one row per class)")
    head = _head(model, family)
    pad_token_id = getattr(model.config, "pad_token_id", None)
    if pad_token_id is None:
        raise UsageError(
            "its config has no pad_token_id; right-padded batches need one to find each row's last token. "
            "Set model.config.pad_token_id = tokenizer.pad_token_id.",
            param="model", value=_Shown(type(model).__name__),
        )
    tuning_mode, pre_seq_len = _prompts_of(model, kind)
    if kind == "petals":
        module = _petals_module(model, family, swarm_timeout)
    else:
        from dist_eval.backends.local import PromptTunedClassifier

        module = PromptTunedClassifier(model, None, 0, family)
    return LoadedModel(module, head.out_features, int(pad_token_id), kind,
                       class_names(model.config, head.out_features), pre_seq_len if tuning_mode else 0,
                       attention_window=family.attention_window(model.config),  # refused longer rows: load_model's
                       attention_limit=family.attention_limit(model.config))


def _refuse_a_prompt_learning_peft_model(model) -> None:
    """A UsageError for PEFT's model object with a prompt-learning adapter: called as it is, it hands the base model
    its prompts and rows as embeddings without the ids, so that on a right-padded batch the head reads a pad for
    every row shorter than the longest (other logits, and no error). Its saved adapter is read right.
    """
    peft = sys.modules.get("peft")  # a PEFT model: peft is loaded
    config = getattr(model, "active_peft_config", None) if peft is not None and isinstance(model, peft.PeftModel) \
        else None
    if getattr(config, "is_prompt_learning", False):
        raise UsageError(
            f"a PEFT model with a {config.peft_type.value} adapter: PEFT passes its prompts and rows to the base model "
            "as embeddings, so that each row's last real token is not found in a padded batch. Expected the adapter "
            "saved: model.save_pretrained(ADAPTER_DIR), then evaluate load_model(\"local\", BASE_MODEL_DIR, "
            "checkpoint=ADAPTER_DIR) (docs/models-and-checkpoints.md, PEFT adapters).",
            param="model", value=_Shown(type(model).__name__),
        )


def _head(model, family: Family) -> nn.Linear:
    """The classifier head, refused unless a linear layer with one output per class."""
    try:
        head = family.get(model, family.head)
    except AttributeError:
        head = None
    weight = getattr(head, "weight", None)
    if not isinstance(head, nn.Linear) or weight is None or weight.is_meta or head.out_features < 1:
        raise _refused(model, family, f"no usable classifier head ({family.head!r}: {type(head).__name__})")
    return head


def _prompts_of(model, kind: str) -> tuple:
    """(tuning_mode, pre_seq_len) of a petals object's config; (None, 0) for transformers'."""
    if kind != "petals":
        return None, 0
    tuning_mode = getattr(model.config, "tuning_mode", None)
    return tuning_mode, int(getattr(model.config, "pre_seq_len", 0) or 0)


def _petals_module(model, family: Family, swarm_timeout: float) -> nn.Module:
    from dist_eval.backends.petals.backend import PetalsClassifier

    # the adapter applies every client patch (backends.petals.shims), the stub lock included
    return PetalsClassifier(model, family, swarm_timeout, owns_client=False)


def _refused(model, family, why: str) -> UsageError:
    expected = (f"petals' {family.petals_class} or transformers' {family.local_class}" if family
                else "a petals Distributed*ForSequenceClassification or a transformers *ForSequenceClassification")
    return UsageError(
        f"{why}. Expected a sequence classifier with its trained head: {expected}, or a LoadedModel "
        "from load_model(...). Load the classifier class from the same folder, or pass "
        "a callable input_ids -> logits.", param="model", value=_Shown(type(model).__name__),
    )
