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
import threading
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
    prompt_tokens: int = 0  # prompt vectors prepended to every row (servers compute them too)

    def close(self) -> None:
        if self.backend == "petals":
            self.module.close()


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
        # per thread: several batches may be in flight at once (--in-flight)
        self._intermediate = threading.local()

    def _make_deep_prompt_hook(self, layer_index: int):
        def hook(module, args, kwargs):
            hidden_states = args[0] if args else kwargs["hidden_states"]
            hidden_states = hidden_states.clone()
            prompt = self._intermediate.value[layer_index]
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
            self._intermediate.value = inter.permute([2, 0, 1, 3]).to(inputs_embeds.dtype)
        try:
            hidden = self.hf_model.model(inputs_embeds=inputs_embeds).last_hidden_state
        finally:
            self._intermediate.value = None
        hidden = hidden[:, self.pre_seq_len :]
        logits = self.hf_model.score(hidden)
        # Same pooling as transformers' LlamaForSequenceClassification: the token before
        # the first pad (right padding, no attention mask), or the last one.
        last = (torch.eq(input_ids, config.pad_token_id).long().argmax(-1) - 1) % input_ids.shape[1]
        return logits[torch.arange(batch_size), last]


class PetalsClassifier(nn.Module):
    """Adapter: ``DistributedLlamaForSequenceClassification`` -> logits.

    The remote part of each forward (the blocks on the swarm) is retried for at most
    ``swarm_timeout`` seconds from the start of its first failing attempt; then a
    UsageError names the blocks whose every server kept failing (see
    :func:`unserved_blocks`). petals alone would retry without a time bound (it
    counts attempts, and re-adds a dead server's DHT record, which lives ~2 minutes).
    """

    def __init__(self, inner, swarm_timeout: float = 60.0):
        super().__init__()
        from dist_eval.petals_helpers import HelperWatch

        self.inner = inner
        self.swarm_timeout = swarm_timeout
        layers = inner.model.layers
        remote_forward = layers.forward
        # Instance attribute: nn.Module.__call__ then runs the bounded version.
        layers.forward = lambda *args, **kwargs: self._bounded_remote(remote_forward, *args, **kwargs)
        self.helper_watch = HelperWatch(layers.sequence_manager).start()

    def close(self) -> None:
        """Stop the client (its DHT process, p2pd and routing thread), in bounded time."""
        from dist_eval.compat import shutdown_petals_model

        self.helper_watch.stop()  # first: a normal shutdown stops the helpers
        shutdown_petals_model(self.inner)
        self.helper_watch.close()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # No attention mask: the petals client rejects any mask that is not all ones.
        return self.inner(input_ids=input_ids).logits

    def _bounded_remote(self, remote_forward, *args, **kwargs):
        import time as _time

        manager = self.inner.model.layers.sequence_manager
        first_failure = None
        while True:
            attempt_started = _time.monotonic()
            if self.helper_watch.check() is not None:
                raise self.helper_watch.died
            try:
                return remote_forward(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - any swarm failure: retried until the deadline
                if self.helper_watch.check() is not None:
                    raise self.helper_watch.died from e
                if first_failure is None:
                    first_failure = attempt_started  # petals' own retries inside count too
                waited = _time.monotonic() - first_failure
                if waited >= self.swarm_timeout:
                    raise _swarm_failure(manager, self.swarm_timeout, waited, e) from e
                # petals gave up after max_retries quick attempts; let its routing refresh
                # (on_request_failure triggered one) before trying again
                _time.sleep(min(1.0, self.swarm_timeout - waited))


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
    if id2label and (
        len(id2label) != state.num_labels
        or all(str(id2label.get(i, id2label.get(str(i)))) == f"LABEL_{i}" for i in range(state.num_labels))
    ):
        id2label = None  # transformers' placeholder map (LABEL_0, ...), not this task's class names
    if backend == "local":
        module = _load_local(model_dir, state)
    elif backend == "petals":
        module = _load_petals(model_dir, state, initial_peers, dht_prefix, petals_client_options or {}, swarm_timeout)
    else:
        raise UsageError(f"--backend {backend}: expected 'petals' or 'local'.")
    module.eval()
    return LoadedModel(module, state.num_labels, int(config.pad_token_id), backend, id2label, state.pre_seq_len)


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


# petals ClientConfig overrides (petals 2.2.0 defaults in brackets). Why each:
# - update_period 10 s [60]: routing refresh; how soon new servers, and servers back from
#   a ban, are used. A failed server leaves routing at once anyway (compat's patch).
# - max_retries 3 [unbounded], min/max_backoff 0.5/2 s [1/60]: petals' attempts per
#   remote call; a failed attempt reroutes around the failed server, so a few quick
#   ones suffice. Longer outages are retried by PetalsClassifier until --swarm-timeout,
#   which bounds a batch's wait in time (petals counts attempts, not seconds).
# - ban_timeout 60 s [15]: a server that failed is not routed to again for 60 s
#   (doubling on each new failure). A SIGKILLed server's DHT record outlives it by up to
#   2 x its update period (120 s by default); with 15 s bans the client would go back to
#   it every 15 s and pay a failed attempt each time. A block whose servers are all
#   banned still uses them (petals ignores bans then), so a false ban never stops a run.
# - request_timeout 60 s [180]: a server that accepts a request and never answers (hung)
#   is given up after this; a forward of one batch takes far less on a working server.
# - daemon_startup_timeout 30 s [60]: --initial-peers that nobody answers fail in 30 s.
DEFAULT_CLIENT_OPTIONS = dict(
    show_route=False,
    daemon_startup_timeout=30,
    request_timeout=60.0,
    update_period=10.0,
    max_retries=3,
    min_backoff=0.5,
    max_backoff=2.0,
    ban_timeout=60.0,
)


def unserved_blocks(manager) -> list:
    """Blocks with no working server: none is listed for them in the last routing
    refresh, or every server listed for them failed its latest request (the outcomes
    that dist_eval.compat.patch_petals_client_failover records)."""
    outcomes = dict(getattr(manager.state, "dist_eval_outcomes", None) or {})
    failing = {peer for peer, (_, ok) in outcomes.items() if not ok}
    info = manager.state.sequence_info
    missing = []
    for block in range(len(manager)):
        # block_infos keeps every listed server; spans drop the ones a failure removed
        servers = set(info.block_infos[block].servers) | {s.peer_id for s in info.spans_containing_block[block]}
        if not servers or servers <= failing:
            missing.append(block)
    return missing


def _swarm_failure(manager, swarm_timeout: float, waited: float, error: Exception) -> UsageError:
    import re as _re

    missing = unserved_blocks(manager)
    if not missing:  # petals names them itself when no server is listed at all
        match = _re.search(r"No servers holding blocks \[?([0-9, ]+)\]? are online", str(error))
        if match:
            missing = [int(b) for b in match.group(1).replace(",", " ").split()]
    detail = " ".join(str(error).split())
    if len(detail) > 200:
        detail = detail[:200] + "..."
    what = (
        f"no working server for block(s) {missing} of {len(manager)}: every server holding them failed"
        if missing
        else "the swarm failed every attempt"
    )
    return UsageError(
        f"--swarm-timeout {swarm_timeout:g}: {what} for {waited:.0f} s, so a batch could not be computed "
        f"(last error: {type(error).__name__}: {detail}). Restart servers for those blocks (python -m "
        "dist_eval.swarm, or petals' run_server), serve every block on 2+ servers to survive a failure, "
        "or raise --swarm-timeout to wait longer."
    )


def wait_for_blocks(inner, timeout: float, dht_prefix: Optional[str]) -> None:
    """Return once every block has a server in the DHT; else a UsageError naming the
    missing blocks after ``timeout`` seconds (petals itself would retry forever)."""
    import time as _time

    manager = inner.model.layers.sequence_manager
    deadline = _time.monotonic() + timeout
    # petals starts its routing thread lazily, on the first forward; update(wait=True)
    # before that waits forever. Start it the way petals does, and never wait unbounded.
    with manager._thread_start_lock:
        if not manager.is_alive():
            manager._thread.start()
    while True:
        manager.update(wait=False)
        manager.ready.wait(timeout=max(0.1, min(10.0, deadline - _time.monotonic())))
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
    from dist_eval.compat import import_petals, patch_petals_client_failover, quiet_hivemind_logs

    import_petals()
    quiet_hivemind_logs()
    patch_petals_client_failover()
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
    return PetalsClassifier(inner, swarm_timeout)
