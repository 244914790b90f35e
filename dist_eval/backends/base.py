"""The backend contract: what a :class:`~dist_eval.backends.classifier.LoadedModel` computes with.

A backend is the module that turns a batch of token ids into one row of logits per class.
The local (:class:`~dist_eval.backends.local.PromptTunedClassifier`), petals
(:class:`~dist_eval.backends.petals.backend.PetalsClassifier`) and zero-shot
(:class:`~dist_eval.backends.zeroshot.ZeroShotScorer`) backends derive from :class:`Backend`,
and so does what :mod:`dist_eval.backends.objects` builds around a user's model object.

Why a base class and not a ``typing.Protocol``: a backend must also be an ``nn.Module``
(``load_model`` puts it in eval mode, ``evaluate`` restores every submodule's ``training``
flag afterwards, the local backend is moved with ``.to``), which a Protocol cannot require;
the defaults most backends share (no swarm: no provenance; nothing held: nothing to close)
are written once here; and ``isinstance(module, Backend)`` checks the whole contract, where a
runtime-checkable Protocol only checks that the names exist. ``forward`` is abstract: a
backend without it cannot be built.

A minimal backend, complete (``tests/test_backends_base.py`` evaluates it with ``evaluate``)::

    class MeanEmbeddingClassifier(Backend):
        def __init__(self, vocab_size, hidden_size, num_labels, pad_token_id):
            super().__init__()
            self.embeddings = nn.Embedding(vocab_size, hidden_size)
            self.head = nn.Linear(hidden_size, num_labels)
            self.pad_token_id = pad_token_id

        def forward(self, input_ids):
            real = input_ids.ne(self.pad_token_id).unsqueeze(-1).float()
            mean = (self.embeddings(input_ids) * real).sum(1) / real.sum(1).clamp(min=1)
            return self.head(mean)

    model = LoadedModel(MeanEmbeddingClassifier(100, 16, 3, 0), num_labels=3, pad_token_id=0, backend="mean")
    result = dist_eval.evaluate(model, dataset, tokenizer=tokenizer)
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from dist_eval.backends.checkpoint import TrainableState


class Backend(nn.Module, metaclass=abc.ABCMeta):
    """``module(input_ids) -> logits``, plus what a run asks of the module beyond its logits."""

    @abc.abstractmethod
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [batch, seq]`` (right-padded, no pad inside a row) -> ``logits [batch, num_labels]``."""

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final (normed) hidden states of the tokens ``[batch, seq, hidden]``, prompts removed
        (what :class:`~dist_eval.backends.zeroshot.ZeroShotScorer` scores label words from).
        """
        raise NotImplementedError(
            f"{type(self).__name__} computes no hidden states, so label words cannot be scored with it. "
            "Implement hidden_states(input_ids), or evaluate it with its own logits (no label words)."
        )

    def hidden_states_at(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final hidden states at ``positions`` ``[batch, n]`` (token positions, prompts not counted) ->
        ``[batch, n, hidden]``: read from :meth:`hidden_states`; a backend that computes a row's positions apart
        overrides it (petals' for DeepSeek-V4:
        :meth:`~dist_eval.backends.petals.backend.PetalsClassifier.hidden_states_at`).
        """
        hidden = self.hidden_states(input_ids)
        rows = torch.arange(input_ids.shape[0]).unsqueeze(1)
        return hidden[rows.to(hidden.device), positions.to(hidden.device)]

    def load_trainable(self, state: TrainableState) -> None:
        """Swap in ``state``'s trained prompts and head, in place, as if loaded with them."""
        raise NotImplementedError(
            f"{type(self).__name__} holds no trained prompts or head to swap, so one load cannot evaluate "
            "several checkpoints. Implement load_trainable(state), or load each checkpoint on its own."
        )

    def provenance(self) -> Optional[dict]:
        """Who computed the logits, for the report (the swarm's servers); None where no swarm is used."""
        return None

    def close(self) -> None:
        """Release what the backend holds (a client, threads, processes); nothing by default."""
