"""The local backend: the same model computed in-process with transformers (the reference).

Prompts are applied exactly as the Petals client and servers apply them, so both
backends give bitwise-equal fp32 logits.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch
from torch import nn

from dist_eval.backends.base import Backend
from dist_eval.backends.checkpoint import TrainableState
from dist_eval.backends.families import Family, family_of
from dist_eval.backends.zeroshot import LabelWords, ZeroShotScorer, read_saved_lm_head
from dist_eval.errors import UsageError


class PromptTunedClassifier(Backend):
    """A local transformers sequence classifier with Petals-style (deep) p-tuning.

    Mirrors petals 2.2.0 exactly: ``ptune`` prepends ``pre_seq_len`` prompt vectors to
    the input embeddings; ``deep_ptune`` additionally adds
    ``intermediate_prompts[i]`` to the prefix positions before block ``i`` (as
    ``petals.server.block_functions.run_rpc_forward`` does); the prefix is removed
    before the head, and the head picks the token the family's transformers class picks
    (``Family.last_token_index``). The backbone, called with ``inputs_embeds``, applies
    BLOOM's embedding norm to prompts + tokens, as petals' client does. Causal attention
    over prompts + tokens with no padding mask, as on petals' servers. ``family`` (read from
    the model's config by default) says where the embeddings, blocks and head are.
    """

    def __init__(self, hf_model, tuning_mode: Optional[str], pre_seq_len: int, family: Optional[Family] = None):
        super().__init__()
        if tuning_mode not in (None, "ptune", "deep_ptune"):
            raise ValueError(f"tuning_mode={tuning_mode!r}: expected None, 'ptune' or 'deep_ptune'")
        self.hf_model = hf_model
        self.family = family or family_of(hf_model.config)
        config = hf_model.config
        self.tuning_mode = tuning_mode
        self.pre_seq_len = pre_seq_len if tuning_mode else 0
        if tuning_mode:
            self.prompt_embeddings = nn.Embedding(pre_seq_len, config.hidden_size)
        if tuning_mode == "deep_ptune":
            self.intermediate_prompt_embeddings = nn.Embedding(
                pre_seq_len, config.num_hidden_layers * config.hidden_size
            )
        self._hooks = []
        if tuning_mode == "deep_ptune":
            for layer_index, layer in enumerate(self.family.get(hf_model, self.family.blocks)):
                self._hooks.append(
                    layer.register_forward_pre_hook(self._make_deep_prompt_hook(layer_index), with_kwargs=True)
                )
        # per thread: several batches may be in flight at once (--in-flight)
        self._intermediate = threading.local()
        # one forward at a time: some transformers models fill their rotary cache lazily and
        # without a lock (see backends/families.py); the results do not change
        self._lock = threading.Lock()

    def load_trainable(self, state: TrainableState) -> None:
        """The trained head and prompts of ``state`` (its structure is this model's) into the weights."""
        with torch.no_grad():
            if "score.weight" in state.tensors:  # none with label words (a causal LM's head is used)
                self.family.get(self.hf_model, self.family.head).weight.copy_(state.tensors["score.weight"])
            if self.tuning_mode:
                self.prompt_embeddings.weight.copy_(state.tensors["prompt_embeddings.weight"])
            if self.tuning_mode == "deep_ptune":
                self.intermediate_prompt_embeddings.weight.copy_(state.tensors["intermediate_prompt_embeddings.weight"])

    def prompt_device(self) -> torch.device:
        """Where the model's weights are (the input ids are moved there)."""
        return next(self.hf_model.parameters()).device

    def _make_deep_prompt_hook(self, layer_index: int):
        def hook(module, args, kwargs):
            prompts = getattr(self._intermediate, "value", None)
            if prompts is None:  # the block run outside forward(), e.g. through hf_model itself
                return None
            hidden_states = args[0] if args else kwargs["hidden_states"]
            hidden_states = hidden_states.clone()
            prompt = prompts[layer_index]
            hidden_states[:, : prompt.shape[1]] += prompt
            if args:
                return (hidden_states, *args[1:]), kwargs
            kwargs["hidden_states"] = hidden_states
            return args, kwargs

        return hook

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        input_ids = input_ids.to(self.prompt_device())
        hidden = self.hidden_states(input_ids)
        logits = self.family.get(self.hf_model, self.family.head)(hidden)
        # the same pooling as transformers' classifier of this family (right padding, no mask)
        last = self.family.last_token_index(input_ids, self.hf_model.config.pad_token_id)
        return logits[torch.arange(input_ids.shape[0]), last]

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final (normed) hidden states of the tokens [batch, seq, hidden], prompts removed."""
        with self._lock:
            return self._hidden_states(input_ids.to(self.prompt_device()))

    def _hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        config = self.hf_model.config
        batch_size = input_ids.shape[0]
        inputs_embeds = self.family.get(self.hf_model, self.family.embeddings)(input_ids)
        if self.tuning_mode:
            prompts = self.prompt_embeddings.weight.unsqueeze(0).expand(batch_size, -1, -1).to(inputs_embeds.dtype)
            inputs_embeds = torch.cat([prompts, inputs_embeds], dim=1)
        if self.tuning_mode == "deep_ptune":
            inter = self.intermediate_prompt_embeddings.weight.unsqueeze(0).expand(batch_size, -1, -1)
            inter = inter.reshape(batch_size, self.pre_seq_len, config.num_hidden_layers, config.hidden_size)
            self._intermediate.value = inter.permute([2, 0, 1, 3]).to(inputs_embeds.dtype)
        from dist_eval.backends.layers import ROW_TOKEN_IDS

        # the rows' token ids, for blocks that route by them (DeepSeek-V4's hash_moe); none with prompts before them
        ids = ROW_TOKEN_IDS.set(None if self.pre_seq_len else input_ids)
        try:
            hidden = self.family.final_hidden(self.hf_model, inputs_embeds)
        finally:
            ROW_TOKEN_IDS.reset(ids)
            self._intermediate.value = None
        return hidden[:, self.pre_seq_len :]


def load_local(
    model_dir: str, state: TrainableState, family: Family, device: str = "cpu",
    label_words: Optional[LabelWords] = None,
) -> Backend:
    """The model of ``model_dir`` with the trained prompts and head, in this process, on ``device``.

    With ``label_words``: the causal LM (``Family.local_lm_class``) with the trained prompts,
    scoring the label words (:mod:`dist_eval.backends.zeroshot`); no classifier head; its LM head read where the
    family's releases save it (``Family.saved_lm_head``).
    A base-model layout that also holds ``score.weight``, which transformers refuses as
    "corrupted", is read from its converted copy (:mod:`dist_eval.backends.petals_folder`).
    """
    from dist_eval.backends.blocks import family_class
    from dist_eval.backends.compat import heads_read_after, no_random_init_of_meta_tensors
    from dist_eval.backends.petals_folder import detect_layout, petals_model_folder, require_every_shard

    require_every_shard(model_dir, "--backend local")
    if not detect_layout(model_dir, family).client_ready:
        model_dir = petals_model_folder(model_dir)

    with no_random_init_of_meta_tensors(), heads_read_after(family.head, family.lm_head, unread=family.lm_head_weights):
        if label_words is not None:
            hf_model = _from_folder(family_class(family.local_lm_class, in_petals=False), model_dir, family)
            read_saved_lm_head(family.get(hf_model, family.lm_head), model_dir, hf_model.config, family)
        else:
            hf_model = _from_folder(family_class(family.local_class, in_petals=False), model_dir, family,
                                    num_labels=state.num_labels)
    model = PromptTunedClassifier(hf_model, state.tuning_mode, state.pre_seq_len, family)
    model.load_trainable(state)
    if label_words is not None:
        model = ZeroShotScorer(model, family.get(hf_model, family.lm_head), label_words)
    return model.to(device)


def _from_folder(model_class, model_dir: str, family: Family, **kwargs):
    """``model_class.from_pretrained(model_dir)`` in float32 with the family's attention (``kwargs``: the config's
    fields given). A folder of quantized weights (config.json's ``quantization_config``) where the installed
    transformers loads tensors without the modules' load hooks (5.x: its own quantizers, which refuse partial FP8
    tiles, and no ``_load_from_state_dict``) is read as the pinned one reads it: the model built from its config,
    then the folder's tensors through ``load_state_dict``, whose hooks in dist_eval's layers dequantize them.
    """
    from dist_eval.backends.compat import attention_choice, loads_through_module_hooks
    from dist_eval.backends.config_json import read_config_json
    from dist_eval.backends.petals_folder import read_tensors

    if loads_through_module_hooks() or not read_config_json(model_dir).get("quantization_config"):
        return model_class.from_pretrained(model_dir, torch_dtype=torch.float32, ignore_mismatched_sizes=False,
                                           **kwargs, **attention_choice(family))
    config = model_class.config_class.from_pretrained(model_dir, **kwargs)
    model = model_class._from_config(config, dtype=torch.float32, **attention_choice(family))  # 5.x (torch_dtype warns)
    # the tensors of no module here (mtp.*) not read
    missing, _ = model.load_state_dict(read_tensors(model_dir), strict=False)
    unread = [k for k in missing if k.split(".")[0] not in (family.head, family.lm_head)]
    if unread:
        raise UsageError(f"{len(unread)} weights of the model are not in the folder's tensors (first: {unread[0]}). "
                         "Pass a folder saved whole with save_pretrained().", param="model_dir", value=model_dir)
    return model.eval()
