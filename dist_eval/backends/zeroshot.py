"""Zero-shot classification with label words (a verbalizer): the causal LM scores each class.

Class ``k``'s logit is the log-probability, under the model's language-model head, of the
tokens of label word ``k`` following the row's (templated) text::

    logits[k] = sum_j log p(w_k[j] | text, w_k[:j])

so the classes are compared as lm-evaluation-harness compares multiple-choice answers
(summed, not length-normalised, log-probabilities). The scorer has the classifier's
interface (``input_ids -> logits [batch, num_labels]``): batches, shards, the merge,
metrics and report are those of any classifier.

**The tokens of a label word** are the ones it has after a space in running text, fixed per
class (not re-tokenized per row): the tokens of ``"a " + word`` after those of ``"a"``, both
without special tokens. So with a byte-level BPE tokenizer ``great`` is scored as
``Ġgreat``, with a SentencePiece one as ``▁great``, exactly the tokens that
follow ``... was`` in ``... was great``. A template should therefore end where the word's
space begins (``"Review: {text} Sentiment:"``, not ``"... Sentiment: "``). The row's own
tokens are the tokenizer's for the templated text (special tokens included: e.g. a BOS
first); the word's tokens are appended after them.

**Cost**: one forward per distinct ``w_k[:-1]`` (the tokens appended to the row before the
last one scored): a single forward when every label word is one token, the usual
verbalizer. The LM head is applied only at the positions that predict a label token.

Backends: locally the family's ``*ForCausalLM`` from transformers; on petals its
``Distributed*ForCausalLM``, whose blocks run on the swarm while the embeddings, prompts,
final norm and LM head (tied to the embeddings or not) run here. Both hand
:class:`ZeroShotScorer` the final hidden states, and the scorer's arithmetic is the same
code on both: in fp32 on CPU the logits are bitwise equal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dist_eval.backends.base import Backend
from dist_eval.backends.checkpoint import TrainableState
from dist_eval.errors import UsageError

# the text a label word follows when its tokens are read (see the module docstring)
ANCHOR = "a"


@dataclass(frozen=True)
class LabelWords:
    """The label words, their token ids (one tuple per class) and the model's pad token id."""

    words: Tuple[str, ...]
    token_ids: Tuple[Tuple[int, ...], ...]
    pad_token_id: int

    @property
    def appended_tokens(self) -> int:
        """The most tokens a forward appends to a row (every word's tokens but its last)."""
        return max(len(ids) for ids in self.token_ids) - 1


def _ids(tokenizer, text: str) -> List[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def label_word_tokens(tokenizer, words: Sequence[str], pad_token_id: int) -> LabelWords:
    """Each word's token ids after a space in running text; refuses a word the tokenizer does
    not know (its unknown token), one holding the pad token, and two words with the same tokens.
    """
    anchor = _ids(tokenizer, ANCHOR)
    unk = getattr(tokenizer, "unk_token_id", None)
    token_ids = []
    for word in words:
        full = _ids(tokenizer, f"{ANCHOR} {word}")
        ids = full[len(anchor):] if full[: len(anchor)] == anchor else _ids(tokenizer, " " + word)
        why = ("has no tokens" if not ids else
               f"is the unknown token {unk} to the tokenizer" if unk is not None and unk in ids else
               f"holds the pad token {pad_token_id}" if pad_token_id in ids else "")
        if why:
            raise UsageError(f"the word {word!r} {why}; pick a word in the model's vocabulary.",
                             param="label_words", value=list(words))
        token_ids.append(tuple(ids))
    for k, ids in enumerate(token_ids):
        same = [j for j in range(k) if token_ids[j] == ids]
        if same:
            raise UsageError(
                f"the words {words[same[0]]!r} and {words[k]!r} have the same tokens {list(ids)}: their classes would "
                "always score the same. Pick words that differ.", param="label_words", value=list(words),
            )
    return LabelWords(tuple(words), tuple(token_ids), int(pad_token_id))


def _groups(token_ids: Sequence[Tuple[int, ...]]) -> Dict[Tuple[int, ...], List[int]]:
    """{tokens appended to the row (a word's tokens but its last): the classes read from that forward}."""
    groups: Dict[Tuple[int, ...], List[int]] = {}
    for k, ids in enumerate(token_ids):
        groups.setdefault(ids[:-1], []).append(k)
    return groups


class ZeroShotScorer(Backend):
    """``input_ids [B, T]`` (right-padded, no pad inside a row) -> ``logits [B, K]``: per class
    the summed log-probabilities of its label word's tokens after the row (module docstring).

    ``base.hidden_states_at(input_ids, positions)`` returns the final (normed) hidden states of the tokens at
    ``positions`` ``[B, n]`` (prompt vectors not counted), ``[B, n, H]``; ``lm_head.weight`` is the LM head ``[V, H]``.
    The rest of the :class:`Backend` contract is ``base``'s (a petals client's provenance and
    close, another checkpoint's prompts).
    """

    def __init__(self, base: Backend, lm_head: nn.Module, label_words: LabelWords):
        super().__init__()
        self.base = base
        self.lm_head = lm_head
        self.label_words = label_words
        self._groups = _groups(label_words.token_ids)

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``base``'s: the label words' tokens are scored from them, not hidden states of their own."""
        return self.base.hidden_states(input_ids)

    def hidden_states_at(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``base``'s."""
        return self.base.hidden_states_at(input_ids, positions)

    def load_trainable(self, state: TrainableState) -> None:
        """Another checkpoint's prompts into ``base`` (the LM head is the model's own, not trained)."""
        self.base.load_trainable(state)

    def provenance(self) -> Optional[dict]:
        """``base``'s: the swarm's servers for a petals client, else None."""
        return self.base.provenance()

    def close(self) -> None:
        """``base``'s client, helpers and threads released."""
        self.base.close()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        input_ids = input_ids.cpu()
        batch = input_ids.shape[0]
        lengths = torch.ne(input_ids, self.label_words.pad_token_id).sum(-1)
        scores = torch.empty(batch, len(self.label_words.token_ids), dtype=torch.float32)
        for appended, classes in self._groups.items():
            ids = self._with_appended(input_ids, lengths, appended)
            # positions L-1 .. L-1+len(appended) predict the label word's tokens
            positions = (lengths - 1).unsqueeze(1) + torch.arange(len(appended) + 1)
            picked = self.base.hidden_states_at(ids, positions)  # [B, n, H]
            weight = self.lm_head.weight
            log_probs = torch.nn.functional.linear(picked.to(weight.dtype), weight).float().log_softmax(-1).cpu()
            steps = torch.arange(len(appended) + 1)
            for k in classes:
                tokens = torch.tensor(self.label_words.token_ids[k])
                scores[:, k] = log_probs[:, steps, tokens].sum(-1)
        return scores

    def _with_appended(self, input_ids: torch.Tensor, lengths: torch.Tensor, appended: tuple) -> torch.Tensor:
        """Each row with ``appended`` written right after its last token (pads after)."""
        if not appended:
            return input_ids
        extra = len(appended)
        ids = torch.full((input_ids.shape[0], input_ids.shape[1] + extra), self.label_words.pad_token_id,
                         dtype=input_ids.dtype)
        ids[:, : input_ids.shape[1]] = input_ids
        positions = lengths.unsqueeze(1) + torch.arange(extra)
        ids.scatter_(1, positions, torch.tensor(appended, dtype=ids.dtype).expand(ids.shape[0], -1))
        return ids


def _saved_head_keys(family) -> Tuple[str, ...]:
    """The names the LM head's weight is saved under: the causal LM's own, then the release's (``saved_lm_head``)."""
    return (f"{family.lm_head}.weight",) + ((f"{family.saved_lm_head}.weight",) if family.saved_lm_head else ())


def check_lm_head(model_dir: str, config, family) -> None:
    """The folder holds the LM head's weights (under the causal LM's name, or the release's: ``Family.saved_lm_head``),
    or the config ties them to the embeddings; else transformers and petals would both draw it at random.
    """
    from dist_eval.backends.petals_folder import weight_map

    if getattr(config, "tie_word_embeddings", True):
        return
    names = weight_map(model_dir)  # read once: a single-file folder's names come from its header
    if any(key.split(".")[-2:-1] == [family.lm_head] or key.startswith(family.lm_head + ".") for key in names):
        return
    if family.saved_lm_head and f"{family.saved_lm_head}.weight" in names:
        return
    expected = " or ".join(f"'{key}'" for key in _saved_head_keys(family))
    raise UsageError(
        f"the folder holds no language-model head ({expected}) and config.json does not tie it to "
        "the embeddings, so label words cannot be scored (the head would be random). Pass the folder of the "
        "causal LM (a *ForCausalLM save), not of a classifier or a base model.",
        param="model_dir", value=model_dir,
    )


def read_saved_lm_head(lm_head: nn.Module, model_dir: str, config, family) -> None:
    """``lm_head``'s weight, of a causal LM just loaded from ``model_dir``, read from the folder's
    ``Family.saved_lm_head`` (DeepSeek-V4's ``head.weight``, as released and as transformers 5.x saves it): the pinned
    transformers and petals load ``lm_head.weight`` alone and would leave it drawn at random. Nothing where the config
    ties the head to the embeddings or the folder holds ``lm_head.weight`` (their loader read it).
    """
    from dist_eval.backends.petals_folder import read_tensor, weight_map

    if not family.saved_lm_head or getattr(config, "tie_word_embeddings", True):
        return
    names = weight_map(model_dir)
    if f"{family.lm_head}.weight" in names:
        return
    key = f"{family.saved_lm_head}.weight"
    tensor = read_tensor(model_dir, key)  # a UsageError naming it where absent (check_lm_head refused that first)
    if tuple(tensor.shape) != tuple(lm_head.weight.shape):
        raise UsageError(
            f"{key} has shape {list(tensor.shape)}, expected {list(lm_head.weight.shape)} (vocab_size x hidden_size "
            "in config.json): the folder's head is another model's. Pass a folder whose weights and config.json "
            "are one model's.", param="model_dir", value=model_dir,
        )
    weight = lm_head.weight
    if weight.is_meta:  # petals' client leaves a weight it found no tensor for unmaterialised
        lm_head.weight = nn.Parameter(tensor.to(weight.dtype), requires_grad=weight.requires_grad)
        return
    with torch.no_grad():
        weight.copy_(tensor)  # in the loaded model's dtype (the release's bf16 as float32: exact)
