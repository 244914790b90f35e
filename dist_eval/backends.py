"""Model backends: one small interface, ``model(input_ids) -> logits [batch, num_labels]``.

- ``petals``: ``DistributedLlamaForSequenceClassification``; transformer blocks run on a
  swarm, the embeddings, prompts and the classifier head run here. Imported lazily.
- ``local``: the same model computed in-process with transformers, the reference that
  Petals results are checked against. Prompts are applied exactly as the Petals client
  and servers apply them, so both backends give bitwise-equal fp32 logits.

The trainable part of a prompt-tuned model (prompt embeddings + ``score`` head) comes
from a checkpoint (see :mod:`dist_eval.checkpoint`). A head that would be initialised at
random is refused: each rank would draw a different one and disagree silently.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from dist_eval.checkpoint import TrainableState, load_checkpoint, model_dir_trainable_state
from dist_eval.errors import UsageError


@dataclass
class LoadedModel:
    """A ready-to-run classifier and the facts the report needs about it."""

    module: nn.Module  # called as module(input_ids) -> logits
    num_labels: int
    pad_token_id: int
    backend: str
    id2label: Optional[dict] = None

    def close(self) -> None:
        if self.backend == "petals":
            from dist_eval.compat import shutdown_petals_model

            shutdown_petals_model(self.module.inner)


class PromptTunedLlamaClassifier(nn.Module):
    """A local LlamaForSequenceClassification with Petals-style (deep) p-tuning.

    Mirrors petals 2.2.0 exactly: ``ptune`` prepends ``pre_seq_len`` prompt vectors to
    the input embeddings; ``deep_ptune`` additionally adds
    ``intermediate_prompts[i]`` to the prefix positions before block ``i`` (as
    ``petals.server.block_functions.run_rpc_forward`` does); the prefix is removed
    before the head, and the head picks the last non-pad token.
    """

    def __init__(self, hf_model, tuning_mode: Optional[str], pre_seq_len: int):
        super().__init__()
        self.hf_model = hf_model
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
            for layer_index, layer in enumerate(hf_model.model.layers):
                self._hooks.append(layer.register_forward_pre_hook(self._make_deep_prompt_hook(layer_index), with_kwargs=True))
        self._intermediate = None

    def _make_deep_prompt_hook(self, layer_index: int):
        def hook(module, args, kwargs):
            hidden_states = args[0] if args else kwargs["hidden_states"]
            hidden_states = hidden_states.clone()
            prompt = self._intermediate[layer_index]
            hidden_states[:, : prompt.shape[1]] += prompt
            if args:
                return (hidden_states, *args[1:]), kwargs
            kwargs["hidden_states"] = hidden_states
            return args, kwargs

        return hook

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        config = self.hf_model.config
        batch_size = input_ids.shape[0]
        inputs_embeds = self.hf_model.model.embed_tokens(input_ids)
        if self.tuning_mode:
            prompts = self.prompt_embeddings.weight.unsqueeze(0).expand(batch_size, -1, -1).to(inputs_embeds.dtype)
            inputs_embeds = torch.cat([prompts, inputs_embeds], dim=1)
        if self.tuning_mode == "deep_ptune":
            inter = self.intermediate_prompt_embeddings.weight.unsqueeze(0).expand(batch_size, -1, -1)
            inter = inter.reshape(batch_size, self.pre_seq_len, config.num_hidden_layers, config.hidden_size)
            self._intermediate = inter.permute([2, 0, 1, 3]).to(inputs_embeds.dtype)
        try:
            hidden = self.hf_model.model(inputs_embeds=inputs_embeds).last_hidden_state
        finally:
            self._intermediate = None
        hidden = hidden[:, self.pre_seq_len :]
        logits = self.hf_model.score(hidden)
        # Same pooling as transformers' LlamaForSequenceClassification: the token before
        # the first pad (right padding, no attention mask), or the last one.
        last = (torch.eq(input_ids, config.pad_token_id).long().argmax(-1) - 1) % input_ids.shape[1]
        return logits[torch.arange(batch_size), last]


class PetalsClassifier(nn.Module):
    """Adapter: ``DistributedLlamaForSequenceClassification`` -> logits."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # No attention mask: the petals client rejects any mask that is not all ones.
        return self.inner(input_ids=input_ids).logits


def _resolve_trainable(model_dir: str, checkpoint: Optional[str], tuning_mode, pre_seq_len, num_labels) -> TrainableState:
    """The prompts + head every rank will use; refuses anything that would be random."""
    if checkpoint:
        state = load_checkpoint(checkpoint)
    else:
        state = model_dir_trainable_state(model_dir)
        if state is None:
            raise UsageError(
                f"--model {model_dir}: the model folder has no classifier head ('score.weight') and no "
                "--checkpoint was given; its head would be initialised at random, differently on each "
                "rank. Pass --checkpoint FILE with the trained prompts and head."
            )
    if tuning_mode is None:
        tuning_mode = state.tuning_mode
        pre_seq_len = pre_seq_len or state.pre_seq_len
    if tuning_mode != state.tuning_mode:
        raise UsageError(
            f"--tuning-mode {tuning_mode}: the checkpoint was trained with tuning mode "
            f"{state.tuning_mode!r}. Pass --tuning-mode {state.tuning_mode or 'none'} or another checkpoint."
        )
    if tuning_mode and pre_seq_len != state.pre_seq_len:
        raise UsageError(
            f"--pre-seq-len {pre_seq_len}: the checkpoint holds {state.pre_seq_len} prompt vectors. "
            f"Pass --pre-seq-len {state.pre_seq_len}."
        )
    if num_labels is not None and num_labels != state.num_labels:
        raise UsageError(
            f"--num-labels {num_labels}: the classifier head has {state.num_labels} outputs. "
            f"Pass --num-labels {state.num_labels} or the checkpoint trained for {num_labels} labels."
        )
    return state


def _check_shapes(state: TrainableState, config, source: str) -> None:
    expected = {"score.weight": (state.num_labels, config.hidden_size)}
    if state.tuning_mode:
        expected["prompt_embeddings.weight"] = (state.pre_seq_len, config.hidden_size)
    if state.tuning_mode == "deep_ptune":
        expected["intermediate_prompt_embeddings.weight"] = (
            state.pre_seq_len,
            config.num_hidden_layers * config.hidden_size,
        )
    for key, shape in expected.items():
        got = tuple(state.tensors[key].shape)
        if got != shape:
            raise UsageError(
                f"--checkpoint {source}: {key} has shape {list(got)}, expected {list(shape)} for this model "
                f"(hidden size {config.hidden_size}, {config.num_hidden_layers} layers). The checkpoint was "
                "trained for another model; pass the matching --model or --checkpoint."
            )


def load_model(
    backend: str,
    model_dir: str,
    *,
    checkpoint: Optional[str] = None,
    tuning_mode: Optional[str] = None,
    pre_seq_len: int = 0,
    num_labels: Optional[int] = None,
    initial_peers: Optional[list] = None,
    dht_prefix: Optional[str] = None,
    petals_client_options: Optional[dict] = None,
    swarm_timeout: float = 60.0,
) -> LoadedModel:
    """Load the classifier for ``backend`` ('petals' or 'local') with the trained prompts/head."""
    from transformers import AutoConfig

    if not os.path.isdir(model_dir):
        raise UsageError(f"--model {model_dir}: not a folder. Pass a folder saved with save_pretrained().")
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # a folder without a readable config.json
        raise UsageError(f"--model {model_dir}: cannot read its config.json ({e}). Pass a folder saved with save_pretrained().") from e
    state = _resolve_trainable(model_dir, checkpoint, tuning_mode, pre_seq_len, num_labels)
    _check_shapes(state, config, checkpoint or model_dir)
    if config.pad_token_id is None:
        raise UsageError(
            f"--model {model_dir}: config.json has no pad_token_id; right-padded batches need one to find "
            "each sequence's last token. Set pad_token_id in config.json."
        )
    id2label = getattr(config, "id2label", None)
    if id2label and len(id2label) != state.num_labels:
        id2label = None  # transformers' default 2-label map, not this task's
    if backend == "local":
        module = _load_local(model_dir, state)
    elif backend == "petals":
        module = _load_petals(model_dir, state, initial_peers, dht_prefix, petals_client_options or {}, swarm_timeout)
    else:
        raise UsageError(f"--backend {backend}: expected 'petals' or 'local'.")
    module.eval()
    return LoadedModel(module, state.num_labels, int(config.pad_token_id), backend, id2label)


def _load_local(model_dir: str, state: TrainableState) -> nn.Module:
    from transformers import AutoModelForSequenceClassification

    hf_model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=state.num_labels, torch_dtype=torch.float32, ignore_mismatched_sizes=False
    )
    model = PromptTunedLlamaClassifier(hf_model, state.tuning_mode, state.pre_seq_len)
    with torch.no_grad():
        model.hf_model.score.weight.copy_(state.tensors["score.weight"])
        if state.tuning_mode:
            model.prompt_embeddings.weight.copy_(state.tensors["prompt_embeddings.weight"])
        if state.tuning_mode == "deep_ptune":
            model.intermediate_prompt_embeddings.weight.copy_(state.tensors["intermediate_prompt_embeddings.weight"])
    return model


# Client settings: a failing server is routed around within seconds instead of the
# defaults' minutes, and a request never waits without bound.
DEFAULT_CLIENT_OPTIONS = dict(
    show_route=False,
    daemon_startup_timeout=30,
    request_timeout=60.0,
    update_period=10.0,
    max_backoff=5.0,
    max_retries=10,
)


def wait_for_blocks(inner, timeout: float, dht_prefix: Optional[str]) -> None:
    """Return once every block has a server in the DHT; else a UsageError naming the
    missing blocks after ``timeout`` seconds (petals itself would retry forever)."""
    import time as _time

    manager = inner.model.layers.sequence_manager
    deadline = _time.monotonic() + timeout
    while True:
        manager.update(wait=True)
        spans = manager.state.sequence_info.spans_containing_block
        missing = [i for i in range(len(manager)) if not spans[i]]
        if not missing:
            return
        if _time.monotonic() >= deadline:
            hint = (
                " No block is served at all: check that --dht-prefix matches the servers' prefix"
                f" (used: {dht_prefix!r}) and that --initial-peers is this model's swarm."
                if len(missing) == len(manager)
                else " Start a server for them (python -m dist_eval.swarm, or petals' run_server)."
            )
            raise UsageError(
                f"--initial-peers: after {timeout:.0f} s no server in the swarm holds block(s) {missing} "
                f"of {len(manager)}.{hint} (--swarm-timeout sets the wait.)"
            )
        _time.sleep(1.0)


def _load_petals(model_dir, state, initial_peers, dht_prefix, client_options, swarm_timeout) -> nn.Module:
    from dist_eval.compat import import_petals, quiet_hivemind_logs

    import_petals()
    quiet_hivemind_logs()
    from petals import DistributedLlamaForSequenceClassification

    if not initial_peers:
        raise UsageError("--initial-peers: the petals backend needs the swarm's address (or none, to start a local swarm).")
    kwargs = dict(
        initial_peers=list(initial_peers),
        num_labels=state.num_labels,
        torch_dtype=torch.float32,
        **{**DEFAULT_CLIENT_OPTIONS, **client_options},
    )
    if dht_prefix:
        kwargs["dht_prefix"] = dht_prefix
    if state.tuning_mode:
        kwargs.update(tuning_mode=state.tuning_mode, pre_seq_len=state.pre_seq_len)
    try:
        inner = DistributedLlamaForSequenceClassification.from_pretrained(model_dir, **kwargs)
    except Exception as e:
        if type(e).__name__ == "P2PDaemonError":  # nobody answered at the initial peers
            raise UsageError(
                f"--initial-peers {' '.join(initial_peers)}: no swarm answered ({str(e).strip()[:160]}). "
                "Check the addresses (the servers print them) and that the servers are running."
            ) from e
        raise
    try:
        wait_for_blocks(inner, swarm_timeout, dht_prefix)
    except BaseException:
        from dist_eval.compat import shutdown_petals_model

        shutdown_petals_model(inner)
        raise
    with torch.no_grad():
        inner.score.weight.copy_(state.tensors["score.weight"])
        if state.tuning_mode:
            inner.model.prompt_embeddings.weight.copy_(state.tensors["prompt_embeddings.weight"])
        if state.tuning_mode == "deep_ptune":
            inner.model.intermediate_prompt_embeddings.weight.copy_(
                state.tensors["intermediate_prompt_embeddings.weight"]
            )
    return PetalsClassifier(inner)
